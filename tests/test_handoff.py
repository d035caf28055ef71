"""Slot hand-off: a prefetch may take the slot of an expert the running request still reads; its copy starts only
when that request is done. Checked in the slot table, the simulator's link, the CPU copy thread and a live run."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from expertflow import slots
from expertflow.policy import make_policy
from expertflow.policy.prefetching import PrefetchingLRU
from expertflow.sim import SerialLink, Timing, simulate
from expertflow.slots import SlotTable, serve_request
from expertflow.trace import Trace
from expertflow.transfer import HIGH, LOW, CpuTransferEngine, Gate
from families import generate_wrapped


def _loaded(table: SlotTable, *keys) -> None:
    for key in keys:
        table.allocate(key)
        table.mark_ready(key)


def test_handoff_takes_a_ready_pinned_expert_and_reports_it_busy():
    table = SlotTable(2, make_policy("lru", 2, 2, 4))
    _loaded(table, (0, 0), (0, 1))
    request = serve_request(table, 0, 0, [0, 1], lambda *a: None)
    next(request)  # both pinned and computing
    assert table.allocate((1, 3)) is None, "a demand load never takes a pinned slot"
    got = table.allocate((1, 3), handoff=True)
    assert got is not None and got.busy and got.evicted == (0, 0)
    assert not table.resident((0, 0)) and table.resident((1, 3))
    list(request)  # the request ends: unpinning the handed-off expert is not an error
    assert not table.pinned((1, 3)) and not table.pinned((0, 1))


def _serve_in_waves(start_next: bool, policy: str = "lru"):
    """One layer, 2 slots holding experts 0 and 1 (ready); the request needs 0, 1, 2 and 3: two waves."""
    table = SlotTable(2, make_policy(policy, 2, 1, 4))
    _loaded(table, (0, 0), (0, 1))
    table.policy.on_access((0, 1))  # 0 is the least recent
    loads = []
    request = serve_request(table, 0, 0, [0, 1, 2, 3], lambda key, slot, gone, *busy: loads.append(
        (key, gone, *busy)))
    first = next(request)
    assert (first.experts, first.more, loads) == ([0, 1], True, [])
    if start_next:
        first.start_next()
        first.start_next()  # once per wave
    before_second = list(loads)
    second = next(request)
    assert not second.more and list(request) == []
    assert not any(table.pinned(k) for k in table.residents())
    return before_second, loads, second.experts


def test_start_next_loads_the_next_expert_into_the_slot_the_policy_would_free_and_changes_no_choice():
    early, loads, second = _serve_in_waves(True)
    # 2 takes 0's slot (lru's victim) while the first wave still holds it; its copy is held until 0 has computed
    assert early == [((0, 2), (0, 0), True)]
    assert loads == [((0, 2), (0, 0), True), ((0, 3), (0, 1))] and second == [2, 3]
    late, same, again = _serve_in_waves(False)
    assert late == [] and [load[:2] for load in same] == [load[:2] for load in loads] and again == second


def test_a_demand_load_held_by_a_gate_goes_ahead_of_queued_prefetches_when_it_opens():
    engine = CpuTransferEngine(bytes_per_s=4 / 0.05)  # a 4-byte copy occupies the link for 50 ms

    def copy(priority, gate=None):
        return engine.submit(torch.ones(4, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8), priority, gate=gate)

    try:
        copy(HIGH)  # on the link
        prefetch = copy(LOW)
        gate = Gate()
        held = copy(LOW, gate)
        engine.open_gate(gate, first=held)
        assert held.priority == HIGH
        held.wait()
        assert prefetch.state in ("queued", "running"), "the prefetch queued before it went after it"
        prefetch.wait()
    finally:
        engine.close()


def test_handoff_never_takes_an_expert_still_loading():
    table = SlotTable(1, make_policy("lru", 1, 2, 4))
    request = serve_request(table, 0, 0, [2], lambda *a: None)  # a miss: loading, not ready
    next(request)
    assert table.allocate((1, 0), handoff=True) is None
    list(request)


def _trace(steps):
    top_k = max(len(experts) for step in steps for experts in step)
    array = np.full((len(steps), len(steps[0]), top_k), -1, dtype=np.int32)
    for s, step in enumerate(steps):
        for layer, experts in enumerate(step):
            array[s, layer, :len(experts)] = experts
    return Trace(experts=array, num_experts=5)


class _Scripted(PrefetchingLRU):
    name = "scripted-handoff"

    def __init__(self, script, capacity=1):
        super().__init__(capacity, 2, 5)
        self.script = script

    def prefetches(self, step, layer):
        return self._offer(self.script.get((step, layer), []))


def test_simulated_copy_into_a_handed_off_slot_waits_for_the_request():
    trace = _trace([[[0], []], [[0], [2]]])
    result = simulate(trace, _Scripted({(1, 1): [(1, 2)]}), 1, Timing(transfer_ms=10, layer_ms=1))
    # (0,0) loads 0-10, computes -> 11; empty layer -> 12; R(1,0) hits (0,0) and hands its only slot to (1,2),
    # whose copy waits for R(1,0)'s compute: 13-23 (not 12-22); R(1,1) waits for it and computes -> 24.
    assert result.modeled_ms_per_token == 12.0
    assert (result.hits, result.prefetches, result.on_demand_loads, result.loads) == (1, 1, 1, 2)


def test_simulated_prefetch_waits_for_the_running_experts_to_arrive_then_takes_their_slot():
    trace = _trace([[[0], [2]]])
    result = simulate(trace, _Scripted({(0, 1): [(1, 2)]}), 1, Timing(transfer_ms=10, layer_ms=1))
    # R(0,0) misses (0,0): 0-10. Only then is the prefetch of (1,2) issued, so it may take that slot (hand-off,
    # gated): copy 11-21 after R(0,0)'s compute 10-11; R(0,1) waits for it and computes -> 22. Issued at the miss,
    # it would have found the slot still loading and (1,2) would have been a demand load.
    assert result.modeled_ms_per_token == 22.0
    assert (result.hits, result.prefetches, result.on_demand_loads, result.loads) == (0, 1, 1, 2)


def test_simulated_request_computes_its_handed_off_experts_first_and_each_copy_starts_after_its_expert():
    trace = _trace([[[0, 1, 2], [3, 4]]])
    result = simulate(trace, _Scripted({(0, 1): [(1, 3), (1, 4)]}, 3), 3, Timing(transfer_ms=10, layer_ms=3))
    # (0,0), (0,1), (0,2) load 0-10, 10-20, 20-30. The prefetches take the slots of (0,0) and (0,1), least recent
    # first (hand-off). R(0,0) computes them first, one ms each: (0,0) 30-31, so (1,3) copies 31-41; (0,1) 31-32,
    # and (1,4) copies 41-51 behind it; (0,2) 32-33. R(0,1) waits for both and computes 51-54. Releasing both
    # copies after both experts (32) would end at 55, after the whole request (33) at 56.
    assert result.modeled_ms_per_token == 54.0
    assert (result.prefetches, result.on_demand_loads, result.loads) == (2, 3, 5)


def test_serial_link_gate_holds_the_low_queue_but_not_demand():
    link = SerialLink(10)
    gated = link.issue((1, 0), 0.0, high=False, gated=True)
    behind = link.issue((1, 1), 0.0, high=False)
    demand = link.issue((0, 0), 0.0, high=True)
    link.advance(5.0)
    assert demand.start == 0.0 and gated.start is None and behind.start is None
    link.advance(20.0)
    assert gated.start is None and behind.start is None, "the gated head holds the prefetch queue"
    link.release(gated, 20.0)
    link.advance(20.0)
    assert gated.start == 20.0 and link.finish_time(behind) == 40.0


def test_cpu_engine_starts_a_gated_copy_only_after_the_gate_opens():
    engine = CpuTransferEngine()
    try:
        gate = Gate()
        dst = torch.zeros(4, dtype=torch.uint8)
        held = engine.submit(torch.full((4,), 7, dtype=torch.uint8), dst, LOW, gate=gate)
        demand = engine.submit(torch.ones(4, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8), HIGH)
        demand.wait()
        assert held.state == "queued" and int(dst.sum()) == 0
        engine.open_gate(gate)
        held.wait()
        assert held.state == "done" and dst.tolist() == [7] * 4
    finally:
        engine.close()


def test_cpu_engine_runs_a_prefetch_promoted_from_behind_a_held_copy():
    engine = CpuTransferEngine()
    try:
        gate = Gate()
        engine.submit(torch.zeros(4, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8), LOW, gate=gate)
        behind = engine.submit(torch.ones(4, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8), LOW)
        time.sleep(0.05)  # the copy thread is now waiting: nothing it may start
        assert behind.state == "queued"
        engine.promote(behind)  # needed now: it no longer waits for the held copy, and the thread must notice
        assert behind.done_event.wait(timeout=5), "the promoted copy never started"
        engine.open_gate(gate)
    finally:
        engine.close()


def test_emulated_link_runs_queued_copies_back_to_back_and_idles_when_nothing_is_queued():
    link_s = 0.1
    engine = CpuTransferEngine(bytes_per_s=4 / link_s)  # a 4-byte copy occupies the link for 100 ms
    try:
        def copy():
            return engine.submit(torch.ones(4, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8), LOW)

        start = time.perf_counter()
        copy()
        second = copy()
        end = start + 1.5 * link_s  # hold the interpreter past the first copy's end: the copy thread gets it late
        while time.perf_counter() < end:
            pass
        second.wait()
        # On the link's clock the second copy started when the first ended, whatever the thread's delays.
        assert engine.busy_s == pytest.approx(2 * link_s, abs=1e-6)
        assert engine.busy_time() == pytest.approx(2 * link_s, abs=1e-6), "no copy runs: the finished ones"
        time.sleep(0.05)  # the link idles: a copy submitted now starts now, not when the last one ended
        submitted = time.perf_counter()
        third = copy()
        time.sleep(link_s / 2)
        midway = engine.busy_time()  # the running copy counts for the part of it done so far
        assert 2 * link_s + 0.3 * link_s < midway < 2 * link_s + 0.9 * link_s
        third.wait()
        assert time.perf_counter() - submitted >= link_s
        assert time.perf_counter() - start >= 2 * link_s + 0.05 + link_s
        assert engine.busy_s == pytest.approx(3 * link_s, abs=1e-6), "the idle 50 ms are not busy time"
        assert engine.busy_time() == pytest.approx(3 * link_s, abs=1e-6)
    finally:
        engine.close()


def test_a_failed_copy_raises_in_the_waiter_and_the_copy_thread_goes_on():
    engine = CpuTransferEngine()
    try:
        bad = engine.submit(torch.ones(4), torch.zeros(3), HIGH, tag=(0, 1))  # shapes do not match
        good = engine.submit(torch.ones(4), torch.zeros(4), HIGH)
        with pytest.raises(RuntimeError, match=r"copy of \(0, 1\) failed"):
            bad.wait()
        good.wait()
        assert good.state == "done" and bad.state == "failed"
    finally:
        engine.close()


def test_live_run_hands_off_slots_and_keeps_outputs_exact(monkeypatch):
    from transformers import AutoTokenizer

    from expertflow.models import tiny_moe

    model = tiny_moe(dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model.name_or_path)
    inputs = dict(tokenizer(["Translate to French: the cat sleeps.", "def add(a, b):"], return_tensors="pt",
                            padding=True))
    gen = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False)
    reference = model.generate(**inputs, **gen)
    busy = []
    original = slots.SlotTable.allocate

    def spy(self, key, handoff=False):
        got = original(self, key, handoff)
        if got is not None and got.busy:
            busy.append(key)
        return got

    monkeypatch.setattr(slots.SlotTable, "allocate", spy)
    out, stats = generate_wrapped(model, inputs, gen, cache_slots=48, policy="expertflow", device="cpu",
                                  link_bandwidth="2GB/s")
    assert busy, "no prefetch took a slot from a running layer"
    assert torch.equal(out, reference)
    assert stats.prefetches > 0 and stats.hits + stats.misses == stats.needs
