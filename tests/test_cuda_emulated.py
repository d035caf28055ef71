"""The CUDA transfer path on emulated streams (see `emulated_cuda`): every wait, event and cancellation of
`CudaTransferEngine` and the cache is exercised on the CPU, with copies landing late and in random orders. Tokens must
equal the unwrapped model's and no slot may be read or written out of order. The same checks on a real GPU are in
`test_gpu.py`."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch

import expertflow
from emulated_cuda import emulate
from expertflow.cache import ExpertCache
from expertflow.counters import Stats
from expertflow.policy import make_policy
from expertflow.store import ExpertLayout, ExpertStore
from expertflow.transfer import HIGH, LOW, CudaTransferEngine
from families import batch, make_tiny

PROMPTS = ["Translate to French: the cat sleeps on the mat.", "def add(a, b):", "What is 12 times 7?",
           "Summarize: the meeting was moved to Friday because the room was booked."]
GEN = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False)


@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoTokenizer

    from expertflow.models import tiny_moe

    model = tiny_moe(dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model.name_or_path)
    tokenizer.padding_side = "left"
    inputs = dict(tokenizer(PROMPTS, return_tensors="pt", padding=True))
    with torch.no_grad():
        reference = model.generate(**inputs, **GEN)
    return model, inputs, reference


def _generate(model, inputs, slots: int, policy: str):
    expertflow.wrap(model, cache_slots=slots, policy=policy, device="cpu")
    try:
        out = model.generate(**inputs, **GEN)
        stats = expertflow.stats(model).copy()
    finally:
        expertflow.unwrap(model)
    return out, stats


# Two orders: side streams that run early (copies usually land before they are needed) and late (they rarely do).
@pytest.mark.parametrize("seed, progress", [(0, 0.5), (1, 0.05)])
@pytest.mark.parametrize("policy", ["lru", "lookahead", "prev-step", "expertflow"])
def test_every_policy_keeps_tokens_and_slot_order_on_emulated_streams(tiny, monkeypatch, policy, seed, progress):
    model, inputs, reference = tiny
    total = model.config.num_hidden_layers * model.config.num_local_experts
    with emulate(monkeypatch, seed, progress) as device:
        for slots in (1, total // 4, total // 2):
            out, stats = _generate(model, inputs, slots, policy)
            assert torch.equal(out, reference), f"{policy} at {slots} slots gave other tokens"
            assert not device.hazards, f"{policy} at {slots} slots: {device.hazards[:3]}"
            assert stats.hits + stats.misses == stats.needs
            assert stats.link_busy_s is None, "copies on CUDA streams are not timed one by one"
            if policy != "lru" and slots > 1:
                assert stats.prefetches > 0, "nothing exercised the prefetch stream"
    assert not any(s.ops for s in device.streams), "unwrap left copies on the streams"


def _bare_cache(slots: int, experts: int = 4) -> ExpertCache:
    """One layer whose expert e holds the value e everywhere, so wrong bytes show at once."""
    layout = ExpertLayout.from_tensors([("w", (64,), torch.float32)])
    store = ExpertStore(layout.nbytes)
    store.add_layer(layout, [{"w": torch.full((64,), float(e))} for e in range(experts)])
    engine = CudaTransferEngine(torch.device("cuda", 0))
    return ExpertCache(store, slots, make_policy("lru", slots, 1, experts), torch.device("cpu"), engine, Stats())


def _values(cache: ExpertCache, experts: list[int]) -> list[set[float]]:
    return [set(views["w"].tolist()) for wave in cache.request(0, 0, experts) for _, views in wave]


def _prefetch_held_behind_a_running_one(cache: ExpertCache) -> None:
    """Prefetch A = (0, 0) on the stream into the only slot; prefetch B = (0, 1) evicts the loading A and is held on
    the host behind it (the prefetch window is full once A is issued)."""
    cache.engine.MAX_LOW_IN_FLIGHT = 1
    cache.prefetch([(0, 0)])
    cache.policy.on_access((0, 0))
    cache.prefetch([(0, 1)])
    cache.policy.on_access((0, 1))


def _failing(monkeypatch, target, name: str, times: int = 1, error: type[BaseException] = RuntimeError) -> list:
    """`target.name` raises `error("injected")` on its first `times` calls, then works; returns the calls seen."""
    original, calls = getattr(target, name), []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) <= times:
            raise error("injected")
        return original(*args, **kwargs)

    monkeypatch.setattr(target, name, failing)
    return calls


def _policy_bug_on_evicting(monkeypatch, cache: ExpertCache, key) -> None:
    on_evict = cache.policy.on_evict

    def policy_bug(evicted):
        if evicted == key:
            raise ValueError("policy hook bug")
        return on_evict(evicted)

    monkeypatch.setattr(cache.policy, "on_evict", policy_bug)


def test_demand_after_a_cancelled_prefetch_still_waits_for_the_older_copy(monkeypatch):
    """Prefetch A is on the stream; prefetch B evicts the loading A and is held on the host behind it; demand C
    evicts B, cancelling it. C's copy must still be ordered after A's, or A's bytes may land last over C's."""
    with emulate(monkeypatch, progress=0.0) as device:  # side streams run only when the host waits
        cache = _bare_cache(slots=1)
        _prefetch_held_behind_a_running_one(cache)
        assert _values(cache, [2]) == [{2.0}]
        cache.engine.close()
        assert not device.hazards, device.hazards
        assert set(cache.bank.data.view(torch.float32)[0].tolist()) == {2.0}, "A's copy landed over C's"


@pytest.mark.parametrize("then", ["evicted", "needed", "cancelled"])
def test_a_prefetch_that_fails_to_issue_passes_on_its_wait_for_the_older_copy(monkeypatch, then):
    """Prefetch A is on the stream into the only slot; prefetch B evicts the loading A, so its copy waits for A's,
    and B's copy fails to issue. Whatever takes the slot next (C evicting B, B needed and loaded again, or C after
    the policy cancels B) must still be ordered after A's copy, or A's bytes may land last under a resident expert."""
    with emulate(monkeypatch, progress=0.0) as device:  # side streams run only when the host waits
        cache = _bare_cache(slots=1)
        device.fail_copies = {2}  # B's copy
        cache.prefetch([(0, 0)])
        cache.policy.on_access((0, 0))
        cache.prefetch([(0, 1)])
        cache.policy.on_access((0, 1))
        assert cache._tickets[(0, 1)].state == "failed"
        expert = 1 if then == "needed" else 2
        if then == "cancelled":
            cache.cancel([(0, 1)])
        assert _values(cache, [expert]) == [{float(expert)}]
        cache.engine.low_stream.synchronize()  # any later host sync lets the prefetch stream catch up
        assert _values(cache, [expert]) == [{float(expert)}], "A's copy landed over the slot's expert"
        cache.engine.close()
        assert not device.hazards, device.hazards


@pytest.mark.parametrize("failing", ["cancel", "submit", "expert_bytes"])
def test_a_copy_not_queued_after_cancelling_a_prefetch_keeps_its_wait_for_the_older_copy(monkeypatch, failing):
    """As above, but C's copy fails to be queued (the engine's cancel of B raises, and B is cancelled on the way out;
    or the engine refuses C's copy, or reading C's bytes fails, once B is cancelled). The next copy into the slot
    must still wait for A; once B was settled, the counters must still add up: B's eviction counted, B a wasted and
    cancelled prefetch, no longer outstanding, C not resident."""
    with emulate(monkeypatch, progress=0.0) as device:
        cache = _bare_cache(slots=1)
        _prefetch_held_behind_a_running_one(cache)
        held = cache._tickets[(0, 1)]
        _failing(monkeypatch, cache.engine if failing in ("cancel", "submit") else cache.store, failing)
        with pytest.raises(RuntimeError, match="injected"):
            _values(cache, [2])
        assert not cache.table.resident((0, 2)) and held.state == "cancelled"
        if failing != "cancel":  # settled before the failure
            s = cache.stats
            assert (s.evictions, s.wasted_prefetches, s.cancelled_prefetches) == (2, 2, 1)
            assert (0, 1) not in cache._prefetched
        assert _values(cache, [2]) == [{2.0}]
        cache.engine.low_stream.synchronize()  # any later host sync lets the prefetch stream catch up
        assert _values(cache, [2]) == [{2.0}], "A's copy landed over C's"
        cache.engine.close()
        assert not device.hazards, device.hazards


@pytest.mark.parametrize("failing", ["cancel", "expert_bytes"])
def test_a_copy_not_queued_after_evicting_a_running_prefetch_keeps_its_wait_for_it(monkeypatch, failing):
    """Prefetch A is running into the only slot; demand B evicts it and fails before its copy is queued (the engine's
    cancel of A, or reading B's bytes, raises). The next copy into the slot, C's, must still be ordered after A's, or
    A's bytes land over C's."""
    with emulate(monkeypatch, progress=0.0) as device:
        cache = _bare_cache(slots=1)
        cache.prefetch([(0, 0)])
        cache.policy.on_access((0, 0))
        assert cache._tickets[(0, 0)].state == "running"
        _failing(monkeypatch, cache.engine if failing == "cancel" else cache.store, failing)
        with pytest.raises(RuntimeError, match="injected"):
            _values(cache, [1])
        assert not cache.table.resident((0, 1))
        assert _values(cache, [2]) == [{2.0}]
        cache.engine.close()
        assert not device.hazards, device.hazards
        assert set(cache.bank.data.view(torch.float32)[0].tolist()) == {2.0}, "A's copy landed over C's"


def _not_resident_after_a_policy_bug(monkeypatch, cache, also=lambda patch: None) -> None:
    """Expert 1 is needed while the policy's `on_evict` raises as it is taken out (and whatever `also` patches fails):
    the error surfaces, expert 1 is not left resident, and once the bug is gone it loads its own bytes."""
    with monkeypatch.context() as patch:
        also(patch)
        _policy_bug_on_evicting(patch, cache, (0, 1))
        with pytest.raises(ValueError, match="policy hook bug"):
            _values(cache, [1])
    assert not cache.table.resident((0, 1))
    assert _values(cache, [1]) == [{1.0}]


def test_a_copy_not_queued_leaves_its_expert_not_resident_even_if_the_policys_eviction_hook_raises(monkeypatch):
    """Reading B's bytes fails after B took the slot, and then the policy's `on_evict` raises as B is taken back out:
    B must still not look resident (with nothing copied into its slot, a hit would compute from other bytes)."""
    with emulate(monkeypatch, progress=0.0):
        cache = _bare_cache(slots=1)
        assert _values(cache, [0]) == [{0.0}]
        _not_resident_after_a_policy_bug(monkeypatch, cache, lambda patch: _failing(patch, cache.store, "expert_bytes"))
        cache.engine.close()


def test_a_copy_not_queued_leaves_its_expert_not_resident_even_if_cancelling_the_evicted_copy_fails_twice(
        monkeypatch):
    """The engine's cancel of the evicted prefetch B raises in `_leaves` and again on the way out (an application's
    Ctrl-C handler raising twice): C, whose copy was never queued, must still not look resident."""
    with emulate(monkeypatch, progress=0.0):
        cache = _bare_cache(slots=1)
        _prefetch_held_behind_a_running_one(cache)
        calls = _failing(monkeypatch, cache.engine, "cancel", times=2, error=KeyboardInterrupt)
        with pytest.raises(KeyboardInterrupt):
            _values(cache, [2])
        assert len(calls) == 2 and not cache.table.resident((0, 2))
        assert _values(cache, [2]) == [{2.0}]
        cache.engine.close()


def test_a_failed_copys_expert_is_not_resident_even_if_the_policys_eviction_hook_raises(monkeypatch):
    """A prefetch's copy failed; when the expert is needed, it is taken out of the table to be loaded again, and the
    policy's `on_evict` raises then. It must not stay resident: every later need would be a hit on bytes never
    copied."""
    with emulate(monkeypatch, progress=0.0):
        cache = _bare_cache(slots=2)
        assert _values(cache, [0]) == [{0.0}]
        cache.prefetch([(0, 1)])
        ticket = cache._tickets[(0, 1)]
        ticket.state, ticket.error = "failed", RuntimeError("copy failed")  # as the engine marks a failed copy
        _not_resident_after_a_policy_bug(monkeypatch, cache)
        cache.engine.close()


def test_prefetch_into_a_slot_still_read_waits_for_the_compute(monkeypatch):
    """A prefetch issued for the next layer may take the slot of an expert the running layer reads (hand-off);
    its copy must be ordered after that expert's compute."""
    with emulate(monkeypatch, progress=0.0) as device:
        cache = _bare_cache(slots=2)
        assert _values(cache, [0, 1]) == [{0.0}, {1.0}]
        cache.prefetch([(0, 2), (0, 3)])
        assert _values(cache, [2, 3]) == [{2.0}, {3.0}]
        cache.engine.close()
        assert not device.hazards, device.hazards


def test_the_first_copy_into_each_slot_waits_for_the_banks_zero_fill(monkeypatch):
    """The bank is zero-filled on the compute stream when the cache is made; a first copy into a slot, on a side
    stream, must be ordered after that fill, or the fill may land over the expert's bytes."""
    with emulate(monkeypatch, progress=0.0) as device:  # no host sync between the fill and the copies
        cache = _bare_cache(slots=2)
        cache.prefetch([(0, 0)])  # on the prefetch stream
        assert _values(cache, [0, 1]) == [{0.0}, {1.0}]  # (0, 1) on the demand stream
        cache.engine.close()
        assert not device.hazards, device.hazards


def test_a_request_cut_short_after_its_waits_keeps_the_next_copy_into_a_slot_after_the_last_one(monkeypatch):
    """A wait for a copy is the compute stream's; if the request ends before the part that reads the slot computes
    (its compute raised), the next copy into that slot, on the other stream, must still go after the copy waited
    for. The emulation runs the side streams when the compute stream waits, so the host is made to learn of no
    copy's end before it synchronizes (a schedule a GPU allows)."""
    import emulated_cuda

    with emulate(monkeypatch, progress=0.0) as device:
        def query(event):
            event.device.advance()
            return not event.recorded  # as in CUDA, an event never recorded is complete
        monkeypatch.setattr(emulated_cuda.FakeEvent, "query", query)
        cache = _bare_cache(slots=2)
        cache.prefetch([(0, 0), (0, 1)])  # both on the prefetch stream
        for key in ((0, 0), (0, 1)):
            cache.policy.on_access(key)
        monkeypatch.setattr(cache.policy, "prefetches", lambda step, layer: [(0, 2)])
        parts = cache.request(0, 0, [0, 1], upcoming=(1, 0))
        assert [e for e, _ in next(parts)] == [0]  # both waited for; (0, 2) took (0, 0)'s slot: its part goes first
        parts.close()  # that part's compute raised: (0, 1)'s part never computes
        cache.policy.on_access((0, 2))
        assert _values(cache, [3]) == [{3.0}]  # a demand load evicts (0, 1), on the demand stream
        cache.engine.close()
        assert not device.hazards, device.hazards


def test_waiting_for_a_copy_cancelled_by_close_raises(monkeypatch):
    with emulate(monkeypatch, progress=0.0):
        engine = CudaTransferEngine(torch.device("cuda", 0))
        engine.MAX_LOW_IN_FLIGHT = 1
        src, dst = torch.ones(16, dtype=torch.uint8), torch.zeros(16, dtype=torch.uint8)
        engine.submit(src, torch.zeros(16, dtype=torch.uint8), LOW)  # on the stream
        held = engine.submit(src, dst, LOW, tag=(0, 3))  # held on the host
        engine.close()  # unwrap: the held copy is cancelled
        with pytest.raises(RuntimeError, match=r"copy of \(0, 3\) was cancelled .*the transfer engine is closed"):
            held.wait()
        assert not dst.any()
        with pytest.raises(RuntimeError, match=r"the transfer engine is closed \(the model was unwrapped or released"):
            engine.submit(src, dst, HIGH)


def test_close_settles_the_prefetches_on_the_stream_and_lets_go_of_their_buffers(monkeypatch):
    """Copies still on the stream at close have landed once it returns: their tickets are done, and the engine (which
    a kept Stats holds) holds neither the slot bank nor the store buffers they copied between."""
    with emulate(monkeypatch, progress=0.0):  # side streams run only when the host waits
        engine = CudaTransferEngine(torch.device("cuda", 0))
        bank, store = torch.zeros(3, 16, dtype=torch.uint8), torch.arange(1, 4, dtype=torch.uint8).repeat_interleave(16)
        tickets = [engine.submit(store[16 * i: 16 * (i + 1)], bank[i], LOW) for i in range(3)]
        assert [t.state for t in tickets] == ["running"] * 3, "the copies should be on the stream, not landed"
        engine.close()
        assert [t.state for t in tickets] == ["done"] * 3 and all(engine.is_done(t) for t in tickets)
        assert bank[:, 0].tolist() == [1, 2, 3]
        buffers = weakref.ref(bank), weakref.ref(store)
        del tickets, bank, store
        gc.collect()
        assert [ref() is None for ref in buffers] == [True, True], "the closed engine still holds copy buffers"


@pytest.mark.parametrize("release", ["unwrap", "drop the model"])
def test_a_kept_stats_object_keeps_no_slot_bank_alive(monkeypatch, release):
    """The live `expertflow.stats(model)` holds the transfer engine (its stall collector). Prefetches are still on the
    stream when the model is unwrapped or dropped: the slot bank, device memory, must be freed all the same."""
    model = make_tiny("mixtral")
    with emulate(monkeypatch, seed=1, progress=0.05) as device:  # side streams lag: prefetches are left in flight
        expertflow.wrap(model, cache_slots=6, policy="prev-step", device="cpu")
        model.generate(**batch("mixtral"), max_new_tokens=6, do_sample=False)
        stats = expertflow.stats(model)
        if release == "unwrap":
            expertflow.unwrap(model)
        else:
            del model
        bank = weakref.ref(device.bank)
        device.bank = None  # the emulator's own reference (a real GPU has none)
        gc.collect()
        alive = bank() is not None
        assert stats.prefetches > 0
        assert not alive, f"a kept Stats keeps the slot bank alive after {release}"


def test_emulation_reports_a_copy_ordered_before_the_compute_that_reads_its_slot(monkeypatch):
    """The checker itself: a "slot released" event recorded after the views are handed out but before their compute
    is issued would let a copy overwrite the slot while the compute still reads it on a GPU."""
    with emulate(monkeypatch, progress=0.0) as device:
        cache = _bare_cache(slots=1)
        parts = cache.request(0, 0, [0])
        next(parts)  # slot 0's views handed out; the compute reading them comes next
        too_early = cache.engine.slot_released()
        cache.engine.submit(cache.store.expert_bytes(0, 1), cache.bank.data[0], HIGH, after=[too_early])
        assert not device.hazards
        next(parts, None)  # resumed: the compute has been issued
        cache.engine.close()
        assert device.hazards, "a copy ordered only before the compute reading its slot went unreported"


@pytest.mark.parametrize("broken", ["compute does not wait", "copies ignore their after-events"])
def test_emulation_reports_a_missing_wait(tiny, monkeypatch, broken):
    """The checker itself: with one ordering removed from the engine it must report hazards."""
    model, inputs, _ = tiny
    if broken == "compute does not wait":
        monkeypatch.setattr(CudaTransferEngine, "wait", lambda self, ticket: 0.0)
    else:
        issue = CudaTransferEngine._issue

        def issue_without_after(self, ticket):
            ticket.after = None
            issue(self, ticket)

        monkeypatch.setattr(CudaTransferEngine, "_issue", issue_without_after)
    with emulate(monkeypatch, seed=0, progress=0.05) as device:
        _generate(model, inputs, 8, "lookahead")
    kind = "read after write" if broken == "compute does not wait" else "write after read"
    assert any(h.startswith(kind) for h in device.hazards), device.hazards[:3]


# (policy, slots, which copy fails, the priority of its stream): a demand copy, then a prefetch held on the host
@pytest.mark.parametrize("policy, slots, fail_at, stream_priority", [("lru", 8, 5, -1), ("expertflow", 48, 1, 0)])
def test_a_copy_that_fails_to_issue_is_loaded_again(tiny, monkeypatch, policy, slots, fail_at, stream_priority):
    """A CUDA error while issuing a copy: a demand copy raises out of `generate`; a prefetch is marked failed and its
    expert loaded again when needed. Either way the next `generate` gives the unwrapped tokens, in order."""
    model, inputs, reference = tiny
    with emulate(monkeypatch, seed=0, progress=0.05) as device:
        device.fail_copies = {fail_at}
        expertflow.wrap(model, cache_slots=slots, policy=policy, device="cpu")
        try:
            if stream_priority < 0:
                with pytest.raises(RuntimeError, match=f"emulated failure of copy {fail_at}"):
                    model.generate(**inputs, **GEN)
            else:
                assert torch.equal(model.generate(**inputs, **GEN), reference)
            assert torch.equal(model.generate(**inputs, **GEN), reference)
            stats = expertflow.stats(model)
            assert stats.hits + stats.misses == stats.needs
        finally:
            expertflow.unwrap(model)
    assert device.failed_on == [stream_priority], "the failure did not hit the intended stream"
    assert not device.hazards, device.hazards[:3]


@pytest.mark.parametrize("batch", [1, 16])
def test_counters_add_up_after_a_reset_between_generations(monkeypatch, batch):
    """As `benchmarks/gpu_bench.py` counts: a warm-up generation, `reset`, then the counted one. With a demand-only
    policy every miss is one load; at batch 16 a layer needs all 8 experts and 16 slots hold two layers' worth, so
    LRU hits nothing."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2)
    model = MixtralForCausalLM(config).eval()
    ids, other = torch.randint(3, 512, (2, batch, 16))
    with emulate(monkeypatch, seed=0, progress=0.5):
        expertflow.wrap(model, cache_slots=16, policy="lru", device="cpu")
        try:
            model.generate(input_ids=other, attention_mask=torch.ones_like(other), max_new_tokens=2, do_sample=False)
            expertflow.stats(model).reset()
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8,
                           do_sample=False)
            stats = expertflow.stats(model)
        finally:
            expertflow.unwrap(model)
    assert stats.needs == stats.hits + stats.misses > 8 * 8 * batch // 16
    assert stats.loads == stats.on_demand_loads == stats.misses
    if batch == 16:
        assert stats.hits == 0 and stats.needs > 8 * 7 * 8, stats.as_dict()


def test_device_waits_timed_before_a_reset_stay_before_it_and_unwrap_keeps_the_last(monkeypatch):
    """On a GPU the last stalled layer's timing events are often still pending when generate returns: `reset` must
    not count them after it, and `unwrap` must not drop them (a Stats held across it gets them)."""
    import emulated_cuda
    from expertflow.runtime import runtime_of

    monkeypatch.setattr(emulated_cuda.FakeEvent, "elapsed_time", lambda self, other: 7.0)  # every wait: 7 ms
    model = make_tiny("mixtral")
    with emulate(monkeypatch, progress=0.0):
        expertflow.wrap(model, cache_slots=2, device="cpu")
        try:
            model.generate(**batch("mixtral"), max_new_tokens=2, do_sample=False)
            stats = expertflow.stats(model)
            engine = runtime_of(model).cache.engine

            def pending_wait():  # what a wait still timing on the device leaves
                pair = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                pair[0].record()
                pair[1].record()
                engine._stalls.append(pair)

            pending_wait()
            stats.reset()
            assert expertflow.stats(model).stall_s == 0.0
            pending_wait()
        finally:
            expertflow.unwrap(model)
    assert stats.stall_s == pytest.approx(0.007)


class _Timing:
    """A timing event of a stall whose end has landed; `on_query` runs inside `query`, as a signal handler may."""

    def __init__(self, t: float, on_query=None) -> None:
        self.t, self.on_query = t, on_query

    def query(self) -> bool:
        if self.on_query is not None:
            on_query, self.on_query = self.on_query, None
            on_query()
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: "_Timing") -> float:
        return (end.t - self.t) * 1000.0


def test_counts_read_inside_the_engines_stall_collection_on_its_own_thread_are_collected_once(monkeypatch):
    """`Event.query` runs Python code, so a signal handler may run inside `collect_stall` on the counting thread and
    reset or read the counts, which collects the stalls again there: it must not wait for itself, and each stall is
    counted once."""
    with emulate(monkeypatch):
        engine = CudaTransferEngine(torch.device("cuda", 0))
        stats = Stats()
        stats.time_stalls(engine.collect_stall)
        engine._stalls.extend([(_Timing(0.0), _Timing(0.002, on_query=stats.reset)), (_Timing(0.0), _Timing(0.003))])
        done = []
        collecting = threading.Thread(target=lambda: done.append(engine.collect_stall()), daemon=True)
        collecting.start()
        collecting.join(timeout=10)
        assert not collecting.is_alive(), "collect_stall waits for the lock its own thread holds"
        assert not engine._stalls and stats.resets == 1
        assert done == [0.0] and stats.stall_s == 0.0  # the reset took both: waits before it, not counted after it
        engine.close()
