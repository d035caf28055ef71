"""Faults in the live path: a failed or interrupted copy, an error or Ctrl-C inside a layer, a second thread. The
cache must never compute from a slot whose bytes are not in place, must not hang afterwards, and must keep counting
right; the model must keep giving the unwrapped model's tokens."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import torch

import expertflow
from expertflow.adapters import experts3d
from expertflow.cache import ExpertCache
from expertflow.counters import Stats
from expertflow.policy import make_policy
from expertflow.policy.lru import LRUPolicy
from expertflow.runtime import runtime_of
from expertflow.store import ExpertLayout, ExpertStore
from expertflow.transfer import LOW, CpuTransferEngine, Gate

N = 1 << 12  # floats per expert


def _cache(slots: int, layers: int = 2, experts: int = 4, policy=None, bytes_per_s: float | None = None):
    """A bare cache whose expert (l, e) holds the value 100 l + e everywhere, so wrong bytes show at once."""
    layout = ExpertLayout.from_tensors([("w", (N,), torch.float32)])
    store = ExpertStore(layout.nbytes)
    for layer in range(layers):
        store.add_layer(layout, [{"w": torch.full((N,), float(100 * layer + e))} for e in range(experts)])
    policy = policy or make_policy("lru", slots, layers, experts)
    return ExpertCache(store, slots, policy, torch.device("cpu"), CpuTransferEngine(bytes_per_s), Stats())


def _read(cache, step, layer, experts, upcoming=None) -> dict[int, tuple[float, float]]:
    seen = {}
    for wave in cache.request(step, layer, experts, upcoming):
        for expert, views in wave:
            seen[expert] = (float(views["w"].min()), float(views["w"].max()))
    return seen


def _interrupt_first_wait(engine) -> Callable:
    """Make the engine's first wait raise KeyboardInterrupt (Ctrl-C while a layer waits for a copy); returns the
    original wait."""
    wait, calls = engine.wait, []

    def interrupted_once(ticket):
        calls.append(ticket)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return wait(ticket)

    engine.wait = interrupted_once
    return wait


def test_an_interrupted_wait_leaves_the_copy_awaited_by_the_next_request():
    cache = _cache(2, bytes_per_s=N * 4 / 0.2)  # one copy takes 200 ms
    engine = cache.engine
    _interrupt_first_wait(engine)  # Ctrl-C while the layer waits for its expert
    try:
        with pytest.raises(KeyboardInterrupt):
            _read(cache, 0, 0, [1])
        assert _read(cache, 1, 0, [1]) == {1: (1.0, 1.0)}, "computed from a slot before its bytes arrived"
        assert _read(cache, 2, 0, [1]) == {1: (1.0, 1.0)}
        s = cache.stats
        assert (s.hits, s.needs, s.loads) == (1, 3, 1), "the expert became a hit once its copy had been awaited"
    finally:
        engine.close()


def test_a_failed_copy_is_loaded_again_not_computed_from_stale_bytes():
    cache = _cache(1)
    try:
        assert _read(cache, 0, 0, [0]) == {0: (0.0, 0.0)}  # the slot holds expert 0's bytes
        good = cache.store.expert_bytes
        cache.store.expert_bytes = lambda layer, expert: torch.zeros(3, dtype=torch.uint8)  # the copy will fail
        with pytest.raises(RuntimeError, match=r"copy of \(0, 2\) failed"):
            _read(cache, 1, 0, [2])
        cache.store.expert_bytes = good
        assert _read(cache, 2, 0, [2]) == {2: (2.0, 2.0)}
    finally:
        cache.engine.close()


def test_a_copy_that_cannot_be_submitted_leaves_the_expert_not_resident():
    cache = _cache(2)
    submit = cache.engine.submit

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("out of memory")  # how a CUDA copy error surfaces

    try:
        cache.engine.submit = out_of_memory
        with pytest.raises(RuntimeError, match="out of memory"):
            _read(cache, 0, 0, [2])
        cache.engine.submit = submit
        assert _read(cache, 1, 0, [2]) == {2: (2.0, 2.0)}
        s = cache.stats  # the copy that could not be submitted is counted nowhere, not as an on-demand load either
        assert (s.misses, s.loads, s.on_demand_loads) == (2, 1, 1)
        assert s.loads == s.on_demand_loads + s.prefetches
    finally:
        cache.engine.close()


class _NewestFirst(LRUPolicy):
    """Evicts the most recently inserted expert it may; prefetches layer 1's experts 0 and 1 during R(1, 0)."""

    name = "newest-first-test"

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.inserted: list = []

    def on_insert(self, key) -> None:
        super().on_insert(key)
        self.inserted.append(key)

    def on_evict(self, key) -> None:
        super().on_evict(key)
        self.inserted.remove(key)

    def victim(self, key, evictable, free_slots):
        return None if free_slots else next((k for k in reversed(self.inserted) if evictable(k)), None)

    def prefetches(self, step, layer):
        return [(1, 0), (1, 1)] if (step, layer) == (1, 1) else []


def test_a_prefetch_replacing_a_held_prefetch_stays_held_until_its_slot_is_computed():
    # During R(1, 0) = experts 0 and 1, the prefetch of (1, 0) takes expert 1's slot (held until it is computed);
    # the prefetch of (1, 1) then evicts (1, 0) and takes the same slot: its copy must be held just the same.
    cache = _cache(2, policy=_NewestFirst(2, 2, 4))
    try:
        _read(cache, 0, 0, [0, 1])
        assert _read(cache, 1, 0, [0, 1], upcoming=(1, 1)) == {0: (0.0, 0.0), 1: (1.0, 1.0)}
        assert _read(cache, 1, 1, [1]) == {1: (101.0, 101.0)}
    finally:
        cache.engine.close()


def test_cancelled_prefetches_move_no_bytes_and_close_cancels_what_is_queued():
    cache = _cache(4, bytes_per_s=N * 4 / 0.1)
    engine = cache.engine
    try:
        assert cache.prefetch([(1, 0), (1, 1), (1, 2)]) == 3
        cache.cancel([(1, 1), (1, 2)])  # still queued behind (1, 0): cancelled, never copied
        s = cache.stats
        assert s.cancelled_prefetches == 2 and s.evictions == 2
        assert s.bytes_to_device == N * 4
        cache.prefetch([(0, 0), (0, 1)])
        queued = cache.table.residents()
    finally:
        engine.close()  # the queued copies are cancelled, not run: closing takes one copy at most, not three
    assert len(queued) == 3 and engine.bytes_copied <= 2 * N * 4



def test_close_does_not_wait_out_the_emulated_link_for_a_copy_whose_bytes_are_in_place():
    """`unwrap` on a slow emulated link waited until the running copy's emulated end (seconds at 20 kB/s)."""
    engine = CpuTransferEngine(bytes_per_s=N * 4 / 5.0)  # one copy occupies the link for 5 s
    src, dst = torch.ones(N), torch.zeros(N)
    ticket = engine.submit(src, dst)
    deadline = time.perf_counter() + 5
    while ticket.state == "queued" and time.perf_counter() < deadline:
        time.sleep(0.01)
    start = time.perf_counter()
    engine.close()
    assert time.perf_counter() - start < 2 and ticket.state == "done" and torch.equal(dst, src)


def test_a_reset_with_prefetches_in_flight_keeps_the_counters_consistent():
    # prefetches issued before `Stats.reset` and used, cancelled or wasted after it are not counted after it
    cache = _cache(4, bytes_per_s=N * 4 / 1.0)  # 1 s a copy: (1, 2) is still queued when cancelled
    try:
        cache.prefetch([(1, 0), (1, 1), (1, 2)])
        cache.stats.reset()
        _read(cache, 0, 1, [0])  # uses (1, 0)
        cache.cancel([(1, 2)])  # cancels the queued (1, 2)
        s = cache.stats
        assert (s.prefetches, s.prefetch_hits, s.cancelled_prefetches, s.wasted_prefetches) == (0, 0, 0, 0)
        assert s.bytes_to_device == 0 and s.loads == 0
        cache.prefetch([(1, 3)])  # issued after the reset: counted as before
        cache.cancel([(1, 3)])
        assert (s.prefetches, s.cancelled_prefetches, s.wasted_prefetches, s.bytes_to_device) == (1, 1, 1, 0)
    finally:
        cache.engine.close()


def _bytes(value: int = 1) -> torch.Tensor:
    return torch.full((4,), value, dtype=torch.uint8)


@pytest.mark.parametrize("how", ["close", "cancel"])
def test_waiting_for_a_cancelled_copy_raises_instead_of_returning(how):
    engine = CpuTransferEngine(bytes_per_s=4 / 0.2)  # a 4-byte copy occupies the link for 200 ms
    try:
        engine.submit(_bytes(), _bytes(0), LOW, tag="running")
        dst = _bytes(0)
        queued = engine.submit(_bytes(), dst, LOW, tag="queued")
        if how == "close":  # unwrap, or the model released
            engine.close()
        else:
            assert engine.cancel(queued)
        why = "the transfer engine is closed" if how == "close" else "before it ran"
        with pytest.raises(RuntimeError, match=f"copy of queued was cancelled .*{why}"):
            queued.wait()
        assert not dst.any(), "a cancelled copy moved its bytes"
    finally:
        engine.close()
    with pytest.raises(RuntimeError, match=r"the transfer engine is closed \(the model was unwrapped or released\)"):
        engine.submit(_bytes(), _bytes(0))


def test_a_layer_whose_copies_are_cancelled_by_close_raises_instead_of_computing_from_empty_slots():
    # `close` (unwrap, or the model released) from another thread while a layer waits for its experts
    cache = _cache(2, bytes_per_s=N * 4 / 0.3)  # one copy takes 300 ms: (0, 1) is still queued when closed
    closer = threading.Timer(0.05, cache.engine.close)
    try:
        closer.start()
        with pytest.raises(RuntimeError, match=r"copy of \(0, 1\) was cancelled .*the transfer engine is closed"):
            _read(cache, 0, 0, [0, 1])
    finally:
        closer.join()
        cache.engine.close()


def test_cancelling_a_held_copy_at_the_head_of_the_queue_lets_the_ones_behind_it_start():
    engine = CpuTransferEngine()
    try:
        held = engine.submit(_bytes(), _bytes(0), LOW, gate=Gate())
        behind = engine.submit(_bytes(), _bytes(0), LOW)
        time.sleep(0.05)
        assert behind.state == "queued", "a held copy holds the queue behind it"
        assert engine.cancel(held)
        assert behind.done_event.wait(timeout=5), "the copy behind a cancelled held copy never started"
        assert behind.state == "done"
    finally:
        engine.close()


def test_a_forward_with_autograd_on_works_after_one_under_inference_mode():
    from families import batch, make_tiny

    model = make_tiny("mixtral")
    inputs = batch("mixtral")
    expected = model(**inputs).logits.detach()
    expertflow.wrap(model, cache_slots=4, policy="lru", device="cpu")
    try:
        with torch.inference_mode():  # pipelines and evaluation harnesses run so
            model.generate(**inputs, max_new_tokens=2, do_sample=False)
        out = model(**inputs).logits  # autograd on: the slots' views must not be inference tensors
        assert torch.allclose(out.detach(), expected, atol=1e-5)
        with pytest.raises(RuntimeError, match="expertflow runs inference only"):
            out.sum().backward()
    finally:
        expertflow.unwrap(model)

@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoTokenizer

    from expertflow.models import tiny_moe

    model = tiny_moe(dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model.name_or_path)
    tokenizer.padding_side = "left"
    inputs = dict(tokenizer(["Translate to French: the cat sleeps.", "def add(a, b):"], return_tensors="pt",
                            padding=True))
    return model, inputs


GEN = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False)


@pytest.mark.parametrize("policy, slots", [("expertflow", 48), ("lru", 4)])
def test_ctrl_c_inside_a_layer_with_the_traceback_kept_then_generate_again(tiny, policy, slots, monkeypatch):
    model, inputs = tiny
    torch.set_num_threads(1)
    reference = model.generate(**inputs, **GEN)
    expertflow.wrap(model, cache_slots=slots, policy=policy, device="cpu", link_bandwidth="2GB/s")
    try:
        ffn, calls = experts3d._expert_ffn, []

        def interrupted(*args):
            calls.append(1)
            if len(calls) == 40:
                raise KeyboardInterrupt
            return ffn(*args)

        monkeypatch.setattr(experts3d, "_expert_ffn", interrupted)
        with pytest.raises(KeyboardInterrupt) as kept:  # the traceback stays alive, as an interactive session keeps it
            model.generate(**inputs, **GEN)
        monkeypatch.setattr(experts3d, "_expert_ffn", ffn)
        assert torch.equal(model.generate(**inputs, **GEN), reference)
        del kept  # only now may the interrupted frames go
    finally:
        expertflow.unwrap(model)


def _ctrl_c_once(target, name: str, monkeypatch, after: bool = False) -> list:
    """A real Ctrl-C (SIGINT to this process) that lands inside `target.name` on its 30th call: before it runs, or
    with `after`, once it has run and before it returns. Returns the calls seen."""
    import signal

    original, calls = getattr(target, name), []

    def landing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 30 and not after:
            signal.raise_signal(signal.SIGINT)  # Python raises it at once here, unless it is held back
        result = original(*args, **kwargs)
        if len(calls) == 30 and after:
            signal.raise_signal(signal.SIGINT)
        return result

    monkeypatch.setattr(target, name, landing)
    return calls


@pytest.mark.usefixtures("pythons_ctrl_c")
@pytest.mark.parametrize("where, policy, slots", [("slot taken, copy not yet queued", "lfu", 96),
                                                   ("copy queued, ticket not yet kept", "expertflow", 12),
                                                   ("layer lock taken", "lru", 4)])
def test_a_ctrl_c_landing_in_the_caches_bookkeeping_is_raised_where_nothing_is_half_done(tiny, where, policy, slots,
                                                                                          monkeypatch):
    """Python raises a Ctrl-C between any two bytecodes. Inside the cache's bookkeeping it left an expert resident in
    a slot no copy filled (later forwards computed from other bytes), a queued copy nobody owned (it could land over a
    later one), or the layer lock held (every later call refused as "another thread"). Held back while a layer or a
    step's plan changes that state, it is raised at a wait or on leaving: the next generate is exact."""
    import signal

    from expertflow.cache import ExpertCache

    model, inputs = tiny
    torch.set_num_threads(1)
    reference = model.generate(**inputs, **GEN)
    with torch.no_grad():
        logits = model(**inputs).logits
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    expertflow.wrap(model, cache_slots=slots, policy=policy, device="cpu")
    try:
        runtime = runtime_of(model)
        with monkeypatch.context() as patch:
            if where == "slot taken, copy not yet queued":
                calls = _ctrl_c_once(ExpertCache, "_copy", patch)
            elif where == "copy queued, ticket not yet kept":
                calls = _ctrl_c_once(runtime.cache.engine, "submit", patch, after=True)
            else:
                lock = runtime._busy

                class Landing:  # the lock's acquire returns, then the Ctrl-C lands
                    acquire, release = lock.acquire, lock.release

                runtime._busy = Landing()
                calls = _ctrl_c_once(runtime._busy, "acquire", patch, after=True)
            with pytest.raises(KeyboardInterrupt):
                model.generate(**inputs, **GEN)
            assert len(calls) >= 30
        runtime._busy = lock if where == "layer lock taken" else runtime._busy
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # given back
        with torch.no_grad():
            assert torch.equal(model(**inputs).logits, logits)
        assert torch.equal(model.generate(**inputs, **GEN), reference)
        s = expertflow.stats(model)
        assert s.hits + s.misses == s.needs
    finally:
        expertflow.unwrap(model)


@pytest.mark.usefixtures("pythons_ctrl_c")
def test_a_ctrl_c_during_a_long_wait_for_a_copy_ends_the_wait(tiny):
    """Held back while a layer runs, a Ctrl-C must still end a long wait for a copy (a slow link) at once."""
    import signal

    model, inputs = tiny
    torch.set_num_threads(1)
    expertflow.wrap(model, cache_slots=4, policy="lru", device="cpu", link_bandwidth="20kB/s")  # ~5 s per copy
    try:
        timer = threading.Timer(0.5, signal.raise_signal, (signal.SIGINT,))
        start = time.perf_counter()
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            model.generate(**inputs, **GEN)
        assert time.perf_counter() - start < 3
    finally:
        timer.cancel()
        expertflow.unwrap(model)


def test_a_second_thread_is_refused_while_the_first_runs_a_step(tiny, monkeypatch):
    model, inputs = tiny
    torch.set_num_threads(1)
    reference = model.generate(**inputs, **GEN)
    expertflow.wrap(model, cache_slots=48, policy="expertflow", device="cpu")
    inside, release, results = threading.Event(), threading.Event(), {}
    ffn = experts3d._expert_ffn

    def held_once(*args):
        if threading.current_thread().name == "first" and not inside.is_set():
            inside.set()
            release.wait(timeout=30)  # the first thread stays inside a layer until the second has tried
        return ffn(*args)

    def first():
        results["first"] = model.generate(**inputs, **GEN)

    monkeypatch.setattr(experts3d, "_expert_ffn", held_once)
    thread = threading.Thread(target=first, name="first")
    try:
        thread.start()
        assert inside.wait(timeout=30)
        with pytest.raises(RuntimeError, match="one thread at a time"):
            model.generate(**inputs, **GEN)
        release.set()
        thread.join(timeout=60)
        assert torch.equal(results["first"], reference)
        assert torch.equal(model.generate(**inputs, **GEN), reference)  # and from this thread afterwards
    finally:
        release.set()
        thread.join(timeout=60)
        expertflow.unwrap(model)


def test_a_second_thread_is_refused_between_two_layers_of_the_firsts_step(tiny):
    # between two MoE layers (in attention) the first thread holds no lock, but it is inside the model's forward
    model, inputs = tiny
    torch.set_num_threads(1)
    reference = model.generate(**inputs, **GEN)
    expertflow.wrap(model, cache_slots=48, policy="expertflow", device="cpu")
    between, release, results = threading.Event(), threading.Event(), {}

    def hold(module, args):
        if threading.current_thread().name == "first" and not between.is_set():
            between.set()
            release.wait(timeout=30)

    handle = model.model.layers[1].register_forward_pre_hook(hold)
    thread = threading.Thread(target=lambda: results.update(first=model.generate(**inputs, **GEN)), name="first")
    try:
        thread.start()
        assert between.wait(timeout=30)
        with pytest.raises(RuntimeError, match="one thread at a time"), torch.no_grad():
            model(**inputs)
        release.set()
        thread.join(timeout=60)
        assert torch.equal(results["first"], reference)
        steps = expertflow.stats(model).steps
        assert torch.equal(model.generate(**inputs, **GEN), reference)  # and from this thread afterwards
        assert expertflow.stats(model).steps == 2 * steps  # the refused forward counted no step
    finally:
        release.set()
        thread.join(timeout=60)
        handle.remove()
        expertflow.unwrap(model)


@pytest.fixture
def wrapped_lru():
    """The tiny Mixtral, its inputs and its unwrapped tokens, wrapped with 4 LRU slots on the CPU for one test."""
    from families import batch, make_tiny

    model = make_tiny("mixtral")
    inputs = batch("mixtral")
    reference = model.generate(**inputs, **GEN)
    expertflow.wrap(model, cache_slots=4, policy="lru", device="cpu")
    yield model, inputs, reference
    expertflow.unwrap(model)


def test_after_ctrl_c_in_one_threads_forward_another_thread_may_call_the_model(wrapped_lru):
    model, inputs, reference = wrapped_lru

    def interrupt(module, args):
        raise KeyboardInterrupt

    handle = model.model.layers[1].register_forward_pre_hook(interrupt)
    try:
        with pytest.raises(KeyboardInterrupt), torch.no_grad():
            model(**inputs)  # this thread's forward ends without its forward hooks
        handle.remove()
        results = {}
        worker = threading.Thread(target=lambda: results.update(out=model.generate(**inputs, **GEN)))
        worker.start()
        worker.join(timeout=60)
        assert torch.equal(results["out"], reference)
    finally:
        handle.remove()


def test_stats_polled_from_another_thread_while_generate_runs(wrapped_lru):
    model, inputs, reference = wrapped_lru
    engine = runtime_of(model).cache.engine
    collect = engine.collect_stall

    def like_cuda(block=False):  # on CUDA the poll waits a few ms for the device's timing events
        if block:
            time.sleep(0.005)
        return collect(block)

    engine.collect_stall = like_cuda
    stop, polls = threading.Event(), []

    def monitor():
        while not stop.wait(0.001):
            polls.append(expertflow.stats(model).loads)

    poller = threading.Thread(target=monitor, daemon=True)
    try:
        poller.start()
        for _ in range(5):
            assert torch.equal(model.generate(**inputs, **GEN), reference)
    finally:
        stop.set()
        poller.join(timeout=30)
    assert polls and polls == sorted(polls)
