"""Single rules of the live data path, each on a small hand-made case: the cache's counts, hand-offs, prefetch batches
and cancellations; the copy engines' priorities, gates and emulated link clock (CPU and emulated CUDA); the store's
alignment and pinning; the printed and derived statistics; and the runtime's step, layer and next-request
bookkeeping (encoder-decoder models, loops, threads, planned steps)."""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import time

import pytest
import torch

import expertflow
from emulated_cuda import emulate
from expertflow import store as store_module
from expertflow import transfer
from expertflow.counters import Stats
from expertflow.policy import register_policy
from expertflow.policy.lru import LRUPolicy
from expertflow.policy.prefetching import PrefetchingLRU
from expertflow.store import ExpertLayout, ExpertStore
from expertflow.runtime import runtime_of
from expertflow.transfer import HIGH, LOW, CpuTransferEngine, CudaTransferEngine, Gate
from families import batch, make_tiny
from test_faults import _cache, _read
from test_families_sweep import _two_looped_steps
from test_live_accounting import _recorded
from test_sim import ScriptedPrefetch


def _copy(engine, priority=LOW, gate=None):
    return engine.submit(torch.ones(4, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8), priority, gate=gate)


# ---- cache.py ---------------------------------------------------------------------------------------------------

# per_layer: "the same counts per MoE layer" (Stats)
def test_a_load_counts_in_the_per_layer_row_of_its_own_layer():
    cache = _cache(2, layers=2)
    try:
        _read(cache, 0, 1, [0, 1])
        rows = [(p.needs, p.misses, p.loads) for p in cache.stats.per_layer]
    finally:
        cache.engine.close()
    assert rows == [(0, 0, 0), (2, 2, 2)]


# a demand load into a handed-off slot is "held until it has computed, queued with the prefetches meanwhile, and
# raised to high priority once it may go" (cache._demand_load)
def test_a_demand_load_into_a_handed_off_slot_goes_high_once_the_expert_it_displaces_has_computed():
    # one layer, 2 slots, cold; the request needs 0..3: wave 1 = {0, 1}; 2 takes 0's slot (held) before 0 computes
    cache = _cache(2, layers=1)
    tickets = _recorded(cache)
    seen = []
    try:
        for part in cache.request(0, 0, [0, 1, 2, 3]):
            held = [t for t in tickets if t.tag == (0, 2)]
            seen.append(([e for e, _ in part], held[0].priority if held else None))
    finally:
        cache.engine.close()
    assert seen[0] == ([0], LOW), "while 0 computes the copy into its slot is held, queued low"
    assert seen[1] == ([1], HIGH), "0 has computed: the demand load into its slot goes at high priority"


# docs/cache_engine.md: "a prefetch that gets None without a free slot, or WAVE, is not issued, and neither are the
# rest of that call's keys"
class _RefusesOne(LRUPolicy):
    name = "refuses-one-live-test"

    def victim(self, key, evictable, free_slots):
        if key == (1, 0):
            return None
        return super().victim(key, evictable, free_slots)


def test_the_first_live_prefetch_refused_a_slot_ends_the_batch():
    cache = _cache(1, layers=2, policy=_RefusesOne(1, 2, 4))
    try:
        _read(cache, 0, 0, [0])  # the only slot holds (0, 0), unpinned
        issued = cache.prefetch([(1, 0), (1, 1)])
        resident = [key for key in [(0, 0), (1, 0), (1, 1)] if cache.table.resident(key)]
    finally:
        cache.engine.close()
    assert (issued, resident) == (0, [(0, 0)])


# ExpertCache.cancel: "Drop prefetches ... if their copy has not finished and nobody uses them": an expert the running
# request has pinned stays (the runtime cancels only between requests; this is the documented contract)
def test_cancel_leaves_an_expert_the_running_request_has_pinned():
    cache = _cache(2, layers=1)
    try:
        parts = cache.request(0, 0, [0, 1, 2, 3])
        next(parts)  # wave 1 computes; (0, 2) is pinned by the request, its copy held in the queue
        assert cache.table.pinned((0, 2)) and not cache.engine.is_done(cache._tickets[(0, 2)])
        cache.cancel([(0, 2)])
        assert cache.table.resident((0, 2))
        rest = [[e for e, _ in part] for part in parts]
    finally:
        cache.engine.close()
    assert rest == [[1], [2, 3]]


# CUDA: a prefetch cancelled by the policy while held on the host leaves the copy it waited for (an older copy into
# the same slot, still on the stream) for the next copy into the slot to wait for
def test_a_copy_after_a_policy_cancellation_still_waits_for_the_older_copy_into_the_slot(monkeypatch):
    from test_cuda_emulated import _bare_cache, _values

    with emulate(monkeypatch, progress=0.0) as device:  # side streams run only when the host waits
        cache = _bare_cache(slots=1)
        cache.engine.MAX_LOW_IN_FLIGHT = 1  # the prefetch window is full once A is issued
        cache.prefetch([(0, 0)])  # A: on the stream
        cache.policy.on_access((0, 0))
        cache.prefetch([(0, 1)])  # B: evicts the loading A, held on the host behind it
        cache.cancel([(0, 1)])  # the policy no longer wants B
        assert _values(cache, [2]) == [{2.0}]  # demand C into the same slot
        cache.engine.close()
        assert not device.hazards, device.hazards
        assert set(cache.bank.data.view(torch.float32)[0].tolist()) == {2.0}, "A's copy landed over C's"


# Stats.slots_per_layer: "resident experts per MoE layer at the start of each step (the last 4096 steps)"
def test_the_occupancy_history_keeps_exactly_the_last_4096_steps():
    cache = _cache(2)
    try:
        for _ in range(4100):
            cache.snapshot_occupancy()
    finally:
        cache.engine.close()
    assert len(cache.stats.slots_per_layer) == 4096


# request(upcoming=...): the policy's prefetches for the next request are issued by every request, one that needs
# no expert (every token routed to an expert-parallel sentinel) too, as the simulator serves it
def test_a_request_for_no_expert_still_issues_the_next_requests_prefetches():
    cache = _cache(2, layers=2, policy=ScriptedPrefetch(2, 2, 4, {(0, 1): [(1, 3)]}))
    try:
        assert _read(cache, 0, 0, [], upcoming=(0, 1)) == {}
        assert cache.stats.prefetches == 1 and cache.table.resident((1, 3))
        assert _read(cache, 0, 1, [3]) == {3: (103.0, 103.0)}
        s = cache.stats
    finally:
        cache.engine.close()
    assert (s.prefetch_hits, s.on_demand_loads) == (1, 0)


# _handed_off_first: "each expert whose slot a prefetch took, alone and in the order of the copies (a held copy
# holds the prefetch queue)"
class _NewestFirst(ScriptedPrefetch):
    """Prefetches evict the most recently used expert first, so the copies go in falling expert order here."""

    name = "newest-first-live-test"

    def victim(self, key, evictable, free_slots):
        if key not in self._targets:
            return super().victim(key, evictable, free_slots)
        if free_slots > 0:
            return None
        return next((k for k in reversed(self._order) if k not in self._targets and evictable(k)), None)


def test_handed_off_experts_compute_in_the_order_of_the_copies_into_their_slots():
    cache = _cache(2, layers=2, policy=_NewestFirst(2, 2, 4, {(0, 1): [(1, 0), (1, 1)]}))
    tickets = _recorded(cache)
    try:
        parts = [[e for e, _ in part] for part in cache.request(0, 0, [0, 1], upcoming=(0, 1))]
        copies = [t.tag for t in tickets[2:]]
    finally:
        cache.engine.close()
    assert copies == [(1, 0), (1, 1)]  # (1, 0) into 1's slot first, then (1, 1) into 0's
    assert parts == [[1], [0]]


# ---- transfer.py --------------------------------------------------------------------------------------------------

# promote: "the copy thread may be waiting behind a held prefetch: this one can go now" (it is woken, not left to
# its next poll)
def test_a_promoted_copy_starts_at_once_not_at_the_copy_threads_next_poll(monkeypatch):
    monkeypatch.setattr(transfer, "_POLL_S", 3.0)
    engine = CpuTransferEngine()
    try:
        gate = Gate()
        _copy(engine, LOW, gate)  # held: it holds the prefetch queue
        behind = _copy(engine, LOW)
        time.sleep(0.1)  # the copy thread waits: nothing it may start
        assert behind.state == "queued"
        start = time.perf_counter()
        engine.promote(behind)
        assert behind.done_event.wait(timeout=1.5), "the copy thread slept through the promotion"
        assert time.perf_counter() - start < 1.5
        engine.open_gate(gate)
    finally:
        engine.close()


# emulated link: "On the link's clock the copy starts when it was both startable and the link was free"
def test_on_the_emulated_link_a_queued_copy_starts_when_the_one_before_ended_even_if_the_thread_comes_late():
    link_s = 0.4
    engine = CpuTransferEngine(bytes_per_s=4 / link_s)
    try:
        start = time.perf_counter()
        _copy(engine)
        second = _copy(engine)
        time.sleep(0.05)  # the first copy is on the link
        with engine._cv:  # the copy thread cannot finish the first or take the second before start + 0.7
            while time.perf_counter() < start + 0.7:
                time.sleep(0.005)
        second.wait()
        elapsed = time.perf_counter() - start
    finally:
        engine.close()
    # on the link: first 0-0.4, second 0.4-0.8 (not 0.7-1.1, from when the thread took it)
    assert 2 * link_s - 0.01 < elapsed < 2 * link_s + 0.15


# emulated link: a DMA engine free when a prefetch was queued starts it at once; a demand copy queued a moment later,
# before the copy thread got the interpreter, waits for it (a copy on the link is not pre-empted)
def test_on_the_emulated_link_a_prefetch_queued_first_on_a_free_link_goes_before_a_later_demand_copy():
    link_s = 0.1
    engine = CpuTransferEngine(bytes_per_s=4 / link_s)
    try:
        time.sleep(0.05)  # the link has been free a while
        with engine._cv:  # the copy thread cannot take the prefetch before the demand copy is queued too
            start = time.perf_counter()
            prefetch = _copy(engine, LOW)
            time.sleep(0.02)
            demand = _copy(engine, HIGH)
        demand.wait()
        elapsed = time.perf_counter() - start
    finally:
        engine.close()
    assert prefetch.state == "done"
    # on the link: the prefetch 0-0.1, the demand copy 0.1-0.2 (not 0.02-0.12, backdated to its own queueing)
    assert 2 * link_s - 0.01 < elapsed < 2 * link_s + 0.15


# a failed copy held the link while it ran (its time is counted): the copy after it starts there, not over it
def test_on_the_emulated_link_the_copy_after_a_failed_one_starts_when_it_failed():
    link_s = 0.1
    engine = CpuTransferEngine(bytes_per_s=4 / link_s)
    try:
        with engine._cv:  # both queued; the failing copy runs long enough to count
            start = time.perf_counter()
            bad = engine.submit(torch.ones(4), torch.zeros(3), HIGH)  # shapes do not match
            good = _copy(engine, HIGH)
            time.sleep(0.2)
        good.wait()
        busy, elapsed = engine.busy_time(), time.perf_counter() - start
    finally:
        engine.close()
    assert bad.state == "failed"
    assert busy <= elapsed + 0.01


# link_busy_s: "seconds the host→device link has spent copying, up to the moment it is read": a copy that `close`
# stops waiting out counts up to the close
def test_a_copy_close_stops_waiting_out_counts_its_link_time_up_to_the_close():
    link_s = 2.0
    engine = CpuTransferEngine(bytes_per_s=4 / link_s)
    start = time.perf_counter()
    _copy(engine, HIGH)
    time.sleep(0.1)
    engine.close()
    assert engine.busy_time() <= time.perf_counter() - start < link_s


# a failed copy is not running: the link's busy time stops growing
def test_a_failed_copy_adds_no_busy_time_to_the_link():
    engine = CpuTransferEngine()
    try:
        bad = engine.submit(torch.ones(4), torch.zeros(3), HIGH, tag=(0, 1))  # shapes do not match
        with pytest.raises(RuntimeError, match="failed"):
            bad.wait()
        before = engine.busy_time()
        time.sleep(0.1)
        after = engine.busy_time()
    finally:
        engine.close()
    assert after == before


# Gate.opened_at: "perf_counter() when opened (the emulated link's clock)": a held copy occupies the link after its
# gate opens, not from when it was queued
def test_on_the_emulated_link_a_held_copy_takes_its_full_time_after_its_gate_opens():
    link_s = 0.1
    engine = CpuTransferEngine(bytes_per_s=4 / link_s)
    try:
        gate = Gate()
        held = _copy(engine, LOW, gate)
        time.sleep(0.25)  # longer than the copy itself
        opened = time.perf_counter()
        engine.open_gate(gate)
        held.wait()
        waited = time.perf_counter() - opened
    finally:
        engine.close()
    assert waited >= link_s


# CUDA: slot_released pumps "after every computed part: prefetches held on the host advance even when no layer
# misses"
def test_cuda_prefetches_held_on_the_host_advance_after_a_computed_part(monkeypatch):
    with emulate(monkeypatch, progress=0.0) as device:
        engine = CudaTransferEngine(torch.device("cuda", 0))
        engine.MAX_LOW_IN_FLIGHT = 1
        _copy(engine)  # on the stream, not run yet
        second = _copy(engine)  # held on the host
        assert second.state == "queued"
        device.progress_p = 1.0  # the stream runs the first copy at the next CUDA call
        engine.slot_released()  # a layer computed, no miss, no wait
        state = second.state
        engine.close()
    assert state == "running"


# CUDA: a prefetch whose copy has landed is a hit (Stats: "hits: needs whose expert was resident and fully loaded
# when the layer asked"), as on the CPU
def test_cuda_a_prefetch_whose_copy_has_landed_is_a_hit(monkeypatch):
    from test_cuda_emulated import _bare_cache, _values

    with emulate(monkeypatch, progress=1.0) as device:  # side streams run at once
        cache = _bare_cache(slots=2)
        assert cache.prefetch([(0, 1)]) == 1
        assert _values(cache, [1]) == [{1.0}]
        s = cache.stats
        cache.engine.close()
        assert not device.hazards, device.hazards
    assert (s.hits, s.misses, s.prefetch_hits) == (1, 0, 1)


# ---- store.py -----------------------------------------------------------------------------------------------------

# store.py: "every expert of every layer occupies `slot_bytes` bytes (the largest expert, rounded up to 64); inside,
# each named tensor starts at a 64-byte aligned offset"
def test_tensors_start_64_byte_aligned_and_experts_and_slots_are_rounded_up_to_64_bytes():
    layout = ExpertLayout.from_tensors([("a", (3,), torch.float32), ("b", (5,), torch.float16)])
    assert [spec.offset for spec in layout.tensors] == [0, 64]
    assert layout.nbytes == 128
    assert ExpertStore(74).slot_bytes == 128


# _clear_cuda_error: "A failed runtime call leaves its error pending on this thread, where the next kernel launch
# would raise it": a failed unregister clears it, as a failed register does
def test_a_failed_unregister_clears_the_pending_cuda_error_and_warns(monkeypatch, caplog):
    class FailingCudart:
        def cudaHostUnregister(self, address):
            return 1  # cudaErrorInvalidValue

    cleared = []
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FailingCudart())
    monkeypatch.setattr(store_module, "_clear_cuda_error", lambda device: cleared.append(device))
    with caplog.at_level(logging.WARNING, logger="expertflow.store"):
        store_module._unregister(12345, None)
    assert cleared == [None]
    assert "CUDA error 1" in caplog.text


# ---- counters.py --------------------------------------------------------------------------------------------------

# loads_per_token: loads / tokens ("steps / tokens: forward calls and token positions")
def test_loads_per_token_divides_by_the_tokens_not_the_steps():
    s = Stats(loads=12, steps=2, tokens=4)
    assert s.loads_per_token == 3.0
    assert "loads_per_token=3.00" in str(s)


# print(stats): "the totals and the derived rates on one line"
def test_the_printed_rates_are_the_properties_of_the_same_name():
    s = Stats(needs=4, hits=3, misses=1, loads=4, on_demand_loads=1, prefetches=4, prefetch_hits=1, tokens=2)
    s.wasted_prefetches, s.cancelled_prefetches, s.wasted_prefetch_bytes = 3, 1, 2048
    text = str(s)
    rates = [name for name, value in vars(Stats).items() if isinstance(value, property) and name != "link_busy_s"]
    assert len(rates) == 5
    for name in rates:
        value = getattr(s, name)
        assert re.search(rf"\b{name}=({value:.3f}|{value:.2f})(,|\))", text), name
    for f in dataclasses.fields(Stats):  # every total, but not the per-layer rows or the per-step history
        assert (f"{f.name}=" in text) == (f.name not in ("per_layer", "slots_per_layer")), f.name
    assert "hit_rate=0.750" in text and "prefetch_precision=0.250" in text and "async_load_fraction=1.000" in text
    totals = [f for f in dataclasses.fields(Stats) if f.type in (int, "int")]
    for value, f in enumerate(totals, start=101):  # a distinct value each: a total printed under another name shows
        setattr(s, f.name, value)
    text = str(s)
    for f in totals:
        assert re.search(rf"\b{f.name}={getattr(s, f.name)}(,|\))", text), f.name


# ---- runtime.py ---------------------------------------------------------------------------------------------------



class _Recording(PrefetchingLRU):
    """LRU that prefetches nothing and records what the runtime tells and asks it."""

    name = "recording-live-test"

    def __init__(self, capacity, num_layers, num_experts):
        super().__init__(capacity, num_layers, num_experts)
        self.events = []

    def on_route(self, step, layer, routes):
        self.events.append(("route", step, layer, [list(r) for r in routes]))

    def on_request(self, step, layer, experts):
        super().on_request(step, layer, experts)
        self.events.append(("request", step, layer))

    def prefetches(self, step, layer):
        self.events.append(("ask", step, layer))
        return self._offer([])


def _check_asks(events) -> None:
    """docs/cache_engine.md: `prefetches(s', l')` gives the keys to load "for the next request": each ask names the
    request that runs next, each request is asked for once, and every request was asked for."""
    asks = [e[1:] for e in events if e[0] == "ask"]
    requests = [e[1:] for e in events if e[0] == "request"]
    assert len(set(asks)) == len(asks), f"a request asked for twice: {asks}"
    for i, event in enumerate(events):
        if event[0] == "ask":
            following = next((e[1:] for e in events[i + 1:] if e[0] == "request"), None)
            assert following in (None, event[1:]), f"asked for {event[1:]}, then {following} ran"
    assert set(requests) <= set(asks)


# every request's prefetches are asked for once, naming the request that runs next: a step's first layer once, the
# decoder's first layer after its last (not the encoder's), the decoder after the encoder in the decoder's step
@pytest.mark.parametrize("family", ["mixtral", "switch_transformers"])
def test_each_requests_prefetches_are_asked_for_once_naming_the_request_that_runs_next(registry, family):
    register_policy(_Recording)
    model = make_tiny(family)
    expertflow.wrap(model, cache_slots=4, policy=_Recording.name, device="cpu")
    try:
        with torch.no_grad():
            model.generate(**batch(family), max_new_tokens=3, min_new_tokens=3, do_sample=False)
        events = runtime_of(model).cache.policy.events
    finally:
        expertflow.unwrap(model)
    _check_asks(events)


class _RecordingPredictive(_Recording):
    """The same, driven by route predictions: `on_step` is recorded too."""

    name = "recording-predictive-test"
    wants_predictions = True

    def on_step(self, step, probs, next_probs=None):
        self.events.append(("step", step))


def test_a_predictive_policy_is_asked_for_a_steps_prefetches_after_its_predictions_in_the_simulator_as_live():
    """Live, `plan_step` gives a step's predictions (`on_step`) and then asks for its first layer's prefetches; the
    simulator asked for step 0's once before its predictions too, and acted on that answer (a prefetch live never
    made)."""
    import numpy as np

    from expertflow import sim
    from expertflow.trace import Trace

    experts = np.array([[[0, 1], [2, 3]], [[1, 2], [3, 0]], [[2, 3], [0, 1]]], dtype=np.int32)
    trace = Trace(experts=experts, num_experts=4, seq_ids=[0, 0, 0], model="toy")
    policy = _RecordingPredictive(2, 2, 4)
    sim.simulate(trace, policy, 2, predictions=np.full((3, 2, 4), 0.5, dtype=np.float32))
    assert policy.events[:3] == [("step", 0), ("ask", 0, 0), ("route", 0, 0, [[0, 1]])], policy.events[:4]
    assert policy.events.count(("ask", 0, 0)) == 1


# _starts_step: "its first MoE layer starts one [a step], and so does the first MoE layer of another stack (an
# encoder–decoder's decoder runs after its encoder, once per generated token)"
def test_a_forward_of_an_encoder_decoder_counts_its_encoder_and_its_decoder_as_two_steps(registry):
    register_policy(_Recording)
    model = make_tiny("switch_transformers")
    inputs = batch("switch_transformers")
    decoder = torch.tensor([[0, 5, 6], [0, 7, 8]])
    expertflow.wrap(model, cache_slots=4, policy=_Recording.name, device="cpu")
    try:
        with torch.no_grad():
            model(**inputs, decoder_input_ids=decoder)
        stats = expertflow.stats(model)
        events = runtime_of(model).cache.policy.events
        steps = (stats.steps, stats.tokens)
    finally:
        expertflow.unwrap(model)
    assert steps == (2, inputs["input_ids"].numel() + decoder.numel())
    assert [e[1] for e in events if e[0] == "request"] == [0, 0, 1]  # two encoder MoE layers, one decoder
    _check_asks(events)


# exclusive: "A second thread is refused ... while the first is inside the model's forward call"
def test_a_layer_called_from_a_second_thread_while_the_first_is_between_two_layers_is_refused():
    model = make_tiny("mixtral")
    inputs = batch("mixtral")
    experts = model.model.layers[0].mlp.experts
    call = (torch.randn(3, model.config.hidden_size), torch.tensor([[0, 1], [2, 3], [1, 4]]), torch.full((3, 2), 0.5))
    expertflow.wrap(model, cache_slots=4, device="cpu")
    between, release, errors = threading.Event(), threading.Event(), []

    def hold(module, args):
        if threading.current_thread().name == "first" and not between.is_set():
            between.set()
            release.wait(timeout=30)

    def first():
        try:
            with torch.no_grad():
                model(**inputs)
        except Exception as error:  # noqa: BLE001
            errors.append(error)

    handle = model.model.layers[1].register_forward_pre_hook(hold)
    thread = threading.Thread(target=first, name="first")
    try:
        thread.start()
        assert between.wait(timeout=30)
        with pytest.raises(RuntimeError, match="one thread at a time"), torch.no_grad():
            experts(*call)
        release.set()
        thread.join(timeout=60)
        assert errors == [] and expertflow.stats(model).steps == 1
    finally:
        release.set()
        thread.join(timeout=60)
        handle.remove()
        expertflow.unwrap(model)


# leave_forward: a forward call that ran no MoE layer does not start a step for layers run outside it afterwards
# ("Layers run outside the model's forward call run in order, so there a lower index starts a new step")
def test_a_forward_that_ran_no_moe_layer_leaves_the_next_layer_run_outside_it_in_its_step():
    model = make_tiny("mixtral")
    experts = [layer.mlp.experts for layer in model.model.layers]
    call = (torch.randn(3, model.config.hidden_size), torch.tensor([[0, 1], [2, 3], [1, 4]]), torch.full((3, 2), 0.5))
    expertflow.wrap(model, cache_slots=2, device="cpu")

    def fail(module, args):
        raise ValueError("before any MoE layer")

    try:
        with torch.no_grad():
            experts[0](*call)  # a step, outside the forward call
            handle = model.model.layers[0].register_forward_pre_hook(fail)
            try:
                with pytest.raises(ValueError, match="before any MoE layer"):
                    model(**batch("mixtral"))
            finally:
                handle.remove()
            experts[1](*call)  # follows layer 0: the same step
        steps = expertflow.stats(model).steps
    finally:
        expertflow.unwrap(model)
    assert steps == 1


# Stats.slots_per_layer: "resident experts per MoE layer at the start of each step": one row per step also when the
# route predictor plans the step (plan_step takes it, before its prefetches)
def test_a_planned_step_records_its_occupancy_once(tmp_path):
    from families import random_predictor

    model = make_tiny("mixtral")
    predictor = random_predictor(model, tmp_path)
    expertflow.wrap(model, cache_slots=4, policy="expertflow", predictor=predictor, device="cpu")
    try:
        with torch.no_grad():
            model.generate(**batch("mixtral"), max_new_tokens=3, min_new_tokens=3, do_sample=False)
        stats = expertflow.stats(model).copy()
    finally:
        expertflow.unwrap(model)
    assert stats.steps == 3 and len(stats.slots_per_layer) == stats.steps
    assert stats.slots_per_layer[0] == [0, 0], "the first step starts with an empty cache, before its prefetches"


# a looped model: "inside it [the forward call], a lower index is a looped model running some of its layers again in
# the same step"; a layer looped on its own runs again right after itself, and the request after its first pass is
# that layer again
def test_a_layer_looped_on_its_own_announces_itself_as_the_next_request(monkeypatch):
    steps, requested = _two_looped_steps(  # layer 1 alone, twice per step
        monkeypatch, lambda d: d.update(loop_layer_index_start=1, loop_layer_index_end=2))
    assert steps == 2
    # the second step, once the loop is known: 0, then 1 twice, then 2
    assert requested[4:] == [(1, 0, (1, 1)), (1, 1, (1, 1)), (1, 1, (1, 2)), (1, 2, (2, 0))]
