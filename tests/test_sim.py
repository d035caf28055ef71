"""The trace-driven simulator: hand-worked scenarios, timed-mode ordering, properties on random traces, the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from expertflow.policy import Policy, make_policy, policy_names
from expertflow.policy.prefetching import PrefetchingLRU
from expertflow.sim import Timing, Workload, capacity_from_fraction, loads_lower_bound, lower_bound_ms_per_token, \
    simulate, simulate_policies
from expertflow.trace import Trace

REPO = Path(__file__).resolve().parents[1]


def _trace(steps: list[list[list[int]]], num_experts: int = 4) -> Trace:
    """One token per step: steps[s][l] = that token's experts at layer l (padded with -1)."""
    k = max(len(experts) for step in steps for experts in step)
    array = np.full((len(steps), len(steps[0]), k), -1, dtype=np.int32)
    for s, step in enumerate(steps):
        for layer, experts in enumerate(step):
            array[s, layer, :len(experts)] = experts
    return Trace(experts=array, num_experts=num_experts)


class ScriptedPrefetch(PrefetchingLRU):
    """Test policy (not registered): LRU that prefetches exactly `script[(step, layer)]` before that request."""

    name = "scripted-prefetch"

    def __init__(self, capacity: int, num_layers: int, num_experts: int, script: dict) -> None:
        super().__init__(capacity, num_layers, num_experts)
        self.script = script

    def prefetches(self, step: int, layer: int) -> list[tuple[int, int]]:
        return self._offer(self.script.get((step, layer), []))


def _scripted(trace: Trace, capacity: int, script: dict, timing: Timing | None = None):
    policy = ScriptedPrefetch(capacity, trace.num_layers, trace.num_experts, script)
    return simulate(trace, policy, capacity, timing)


# -- counting mode, by hand -------------------------------------------------------------------------------------------

def test_lru_lfu_belady_on_one_layer():
    trace = _trace([[[e]] for e in (0, 1, 0, 2, 1, 0)])
    # lru: 0m 1m 0h 2m(evicts 1) 1m(evicts 0) 0m(evicts 2)
    assert (simulate(trace, "lru", 2).hits, simulate(trace, "lru", 2).loads) == (1, 5)
    # lfu: 2m evicts 1 (needed once), 1m evicts 2 (once, vs 0 twice), 0h
    assert (simulate(trace, "lfu", 2).hits, simulate(trace, "lfu", 2).loads) == (2, 4)
    # belady: 2m evicts 0 (next need furthest), 1h, 0m
    assert (simulate(trace, "belady", 2).hits, simulate(trace, "belady", 2).loads) == (2, 4)


def test_lru_layer_keeps_a_share_per_layer():
    trace = _trace([[[0], [0]], [[1], [1]], [[0], [0]]])
    lru, per_layer = simulate(trace, "lru", 3), simulate(trace, "lru-layer", 3)
    assert (lru.hits, lru.loads) == (0, 6)  # global recency cycles through all three slots
    assert (per_layer.hits, per_layer.loads) == (1, 5)  # quotas [2, 1]: layer 0 keeps expert 0


def test_pinned_experts_survive_even_when_ranked_lowest():
    # at step 4 expert 0 is resident and least frequent, but pinned by its own request: lfu must evict 1
    trace = _trace([[[0]], [[1]], [[1]], [[1]], [[0, 2]], [[0]]])
    result = simulate(trace, "lfu", 2)
    assert (result.needs, result.hits, result.loads) == (7, 4, 3)


def test_waves_when_a_request_exceeds_the_cache():
    trace = _trace([[[0, 1, 2]], [[0, 1, 2]]])
    result = simulate(trace, "lru", 2)
    # step 0: 0,1 (wave 1), 2 evicts 0 (wave 2); step 1: 1,2 hit (wave 1), 0 evicts 1 (wave 2)
    assert (result.needs, result.hits, result.misses, result.loads) == (6, 2, 4, 4)
    timed = simulate(trace, "lru", 2, Timing(transfer_ms=10, layer_ms=6))
    # Once a wave with more to come is ready, the next expert takes the slot of the policy's victim among the
    # wave's (the one lru would evict once the wave is done) and its copy starts when that expert has computed:
    # t=0 load 0,1 -> ready 20; compute 0 -> 22, load 2 into its slot 22-32; compute 1 -> 24; wait, compute 2 -> 34;
    # hits 1,2: compute 1 -> 36, load 0 into its slot 36-46; compute 2 -> 38; wait, compute 0 -> 48. Two tokens.
    assert (timed.hits, timed.loads) == (2, 4)
    assert timed.modeled_ms_per_token == 24 and timed.stall_ms == 20 + 8 + 8
    assert timed.link_busy_share == round(40 / 48, 6)  # copying 0-20, 22-32 and 36-46 of 48 ms


def test_prefetch_counts_and_waste():
    steps = [[[0], [0]], [[1], [0]], [[0], [1]]]
    script = {(1, 1): [(1, 3)]}  # before R(1, 1): fetch layer 1 expert 3, evicting layer 0's least recent
    wasted = _scripted(_trace(steps), 3, script)
    assert (wasted.hits, wasted.on_demand_loads, wasted.prefetches, wasted.loads) == (1, 5, 1, 6)
    assert wasted.wasted_prefetches == 1  # (1, 3) evicted at R(2, 1) before any use
    steps[2][1] = [3]
    used = _scripted(_trace(steps), 3, script)
    assert (used.hits, used.loads, used.wasted_prefetches, used.prefetch_hits) == (2, 5, 0, 1)
    assert wasted.prefetch_hits == 0 and used.late_prefetches is None  # lateness only exists in timed mode


def test_prev_step_beats_lru_on_a_cycle_larger_than_the_cache():
    trace = _trace([[[0], [1], [2], [3]]] * 5)
    lru, prev = simulate(trace, "lru", 2), simulate(trace, "prev-step", 2)
    assert (lru.hits, lru.loads) == (0, 20)
    assert (prev.hits, prev.prefetches, prev.loads, prev.wasted_prefetches) == (16, 16, 20, 0)


def test_lookahead_learns_cross_layer_transitions():
    # layer 0 cycles through 8 experts, layer 1 always takes the next one: a cycle far larger than 2 slots
    trace = _trace([[[s % 8], [(s + 1) % 8]] for s in range(40)], num_experts=8)
    ahead, lru = simulate(trace, "lookahead", 2), simulate(trace, "lru", 2)
    assert lru.hits == 0
    # steps 0-7 teach the 8 transitions; from step 8 on every layer-1 need was prefetched (layer 0 never is)
    assert (ahead.hits, ahead.prefetches, ahead.wasted_prefetches) == (32, 32, 0)


def test_lookahead_offers_each_tokens_top_k_by_summed_transition_chances():
    policy = make_policy("lookahead", 8, 2, 4)
    policy.on_route(0, 0, [[0, 1], [2, -1]])
    policy.on_route(0, 1, [[2, 3], [0, -1]])  # P(2|0) = P(3|0) = P(2|1) = P(3|1) = 1/2, P(0|2) = 1
    policy.on_route(1, 0, [[0, -1], [2, 1], [2, 3], [-1, -1]])
    # token 0 (one expert): 2 and 3 tie at 1/2, the lower id wins; token 1 (two): 0 (1.0), then 2 (1/2) before 3;
    # token 2 (two, but expert 3 never led anywhere): only 0 has a chance; token 3: no expert.
    # Summed: 0 -> 2.0, 2 -> 1.0
    assert policy.prefetches(1, 1) == [(1, 0), (1, 2)]


def test_lfu_memory_stays_bounded_when_nothing_is_evicted():
    """Every need of a resident expert adds a heap entry; without evictions nothing popped them (a server whose
    experts all fit grew by one entry per expert use)."""
    policy = make_policy("lfu", 8, 1, 8)
    for e in range(8):
        policy.on_insert((0, e))
    for _ in range(2_500):
        for e in (0, 0, 0, 1, 2, 3, 4, 5, 6, 7):
            policy.on_access((0, e))
    assert len(policy._heap) <= 2 * 8 + 64
    assert policy.victim((0, 9), lambda key: True, 0) == (0, 1)  # 1..7 are needed least, 1 least recently


class _ReferenceLookahead:
    """lookahead's rule written plainly (counts in lists, scores per token in Python), the oracle for the policy."""

    def __init__(self, num_layers: int, num_experts: int) -> None:
        self.e = num_experts
        self.pairs = [[[0] * num_experts for _ in range(num_experts)] for _ in range(num_layers)]
        self.totals = [[0] * num_experts for _ in range(num_layers)]
        self.last = None

    def on_route(self, step, layer, routes):
        if self.last is not None and self.last[:2] == (step, layer - 1) and len(self.last[2]) == len(routes):
            for before, after in zip(self.last[2], routes):
                chosen = [b for b in after if b >= 0]
                for a in (a for a in before if a >= 0):
                    for b in chosen:
                        self.pairs[layer - 1][a][b] += 1
                    self.totals[layer - 1][a] += len(chosen)
        self.last = (step, layer, routes)

    def prefetches(self, step, layer):
        if self.last is None or self.last[:2] != (step, layer - 1):
            return []
        pairs, totals, score = self.pairs[layer - 1], self.totals[layer - 1], {}
        for route in self.last[2]:
            sources = [a for a in route if a >= 0 and totals[a]]
            chance = [sum(pairs[a][b] / totals[a] for a in sources) for b in range(self.e)]
            ranked = sorted((b for b in range(self.e) if chance[b] > 0), key=lambda b: (-chance[b], b))
            for b in ranked[:sum(1 for a in route if a >= 0)]:
                score[b] = score.get(b, 0.0) + chance[b]
        return [(layer, b) for b in sorted(score, key=lambda b: (-score[b], b))]


@pytest.mark.parametrize("num_experts, top_k, batches", [(8, 2, (1, 2, 3)), (32, 4, (1, 16, 40)), (60, 4, (1, 64))])
def test_lookahead_matches_its_rule_written_plainly(num_experts, top_k, batches):
    """Small batches and large ones (prefill) take different code paths; both must give the oracle's lists."""
    rng = np.random.default_rng(num_experts)
    policy, reference = make_policy("lookahead", 64, 4, num_experts), _ReferenceLookahead(4, num_experts)
    compared = 0
    for step in range(30):
        tokens = int(rng.choice(batches))
        for layer in range(4):
            # skewed choices so that transitions repeat and ties happen
            routes = [[int(e) if rng.random() > 0.1 else -1 for e in rng.choice(num_experts // 2, top_k, replace=False)
                       + (layer % 2)] for _ in range(tokens)]
            policy.on_route(step, layer, routes)
            reference.on_route(step, layer, routes)
            if layer + 1 < 4:
                assert policy.prefetches(step, layer + 1) == reference.prefetches(step, layer + 1), (step, layer)
                compared += 1
    assert compared == 90


def test_lfu_compaction_keeps_a_resident_that_was_never_needed():
    """A prefetched expert that nothing needed yet has no rank; compaction must keep it as the first victim."""
    policy = make_policy("lfu", 4, 1, 8)
    for e in (0, 1, 2):
        policy.on_access((0, e))
        policy.on_insert((0, e))
    policy.on_insert((0, 7))  # prefetched, never needed
    for _ in range(100):
        for e in (0, 1, 2):
            policy.on_access((0, e))
    assert len(policy._heap) <= 2 * 4 + 64
    assert policy.victim((0, 5), lambda key: True, 0) == (0, 7)


def test_routes_array_pads_rows_and_drops_ids_outside_the_layer():
    from expertflow.policy import routes_array

    assert routes_array([[0, 5], [2], [-1, 3]], 4).tolist() == [[0, -1], [2, -1], [-1, 3]]
    assert routes_array([], 4).shape == (0, 1)
    assert routes_array(np.array([[1, 2]]), 4).tolist() == [[1, 2]]


@pytest.mark.parametrize("name", ["lookahead", "expertflow"])
def test_learning_policies_read_ragged_and_out_of_range_routes_as_none(name):
    """A plug-in caller may pass rows of different lengths or ids past the last expert (the runtime maps those to
    -1): the policy must decide as it does on the same routes written with -1, not raise or count a wrong cell."""
    messy = [[[0, 1], [2]], [[1, 4], [7, -1]], [[0], [2, 1]]]
    clean = [[[0, 1], [2, -1]], [[1, -1], [-1, -1]], [[0, -1], [2, 1]]]
    decisions = []
    for routes in (messy, clean):
        policy = make_policy(name, 4, 2, 4)
        policy.on_route(0, 0, routes[0])
        policy.on_route(0, 1, routes[1])
        policy.on_route(1, 0, routes[2])
        ranking = policy.expected_next_use().tolist() if name == "expertflow" else None
        decisions.append((policy.prefetches(1, 1), ranking))
    assert decisions[0] == decisions[1]
    assert policy.prefetches(1, 0) == []  # layer 0 has no previous layer in the step


# -- timed mode ----------------------------------------------------------------------------------------------------

def test_demand_jumps_queued_prefetches_but_not_the_one_in_flight():
    trace = _trace([[[0], [1]]])
    result = _scripted(trace, 4, {(0, 0): [(1, 2), (1, 3)]}, Timing(transfer_ms=10, layer_ms=1))
    # (1,2) in flight 0-10; demand (0,0) goes next 10-20 (ahead of queued (1,3)), compute -> 21;
    # (1,3) 20-30; demand (1,1) issued at 21 runs 30-40, compute -> 41
    assert result.modeled_ms_per_token == 41 and result.stall_ms == 39
    assert (result.hits, result.on_demand_loads, result.prefetches, result.loads) == (0, 2, 2, 4)
    assert result.link_busy_share == round(40 / 41, 6)


def test_link_busy_share_leaves_out_what_runs_past_the_end():
    trace = _trace([[[0], [1]]])
    result = _scripted(trace, 4, {(0, 1): [(0, 3), (0, 2)]}, Timing(transfer_ms=10, layer_ms=1))
    # (0,0) 0-10, compute -> 11; prefetches issued at 10: (0,3) 10-20, (0,2) queued; demand (1,1) at 11 goes
    # 20-30 ahead of it, compute -> 31; (0,2) runs 30-40, past the end: 31 of 31 ms busy, not 40
    assert result.modeled_ms_per_token == 31 and result.loads == 4
    assert result.link_busy_share == 1.0
    assert _scripted(trace, 4, {}, Timing(transfer_ms=10, layer_ms=1)).link_busy_share == round(20 / 22, 6)
    assert _scripted(trace, 4, {}).link_busy_share is None, "only timed mode has a link"


def test_needed_prefetch_is_promoted_to_high_priority():
    trace = _trace([[[0], [1]]])
    script = {(0, 0): [(1, 2), (1, 3), (0, 3), (1, 1)]}
    result = _scripted(trace, 8, script, Timing(transfer_ms=10, layer_ms=1))
    # (1,2) 0-10, demand (0,0) 10-20 -> 21; (1,3) 20-30; R(0,1) needs queued (1,1): it overtakes (0,3), 30-40 -> 41
    assert result.modeled_ms_per_token == 41
    assert (result.hits, result.misses, result.on_demand_loads, result.loads) == (0, 2, 1, 5)
    assert (result.prefetch_hits, result.late_prefetches) == (1, 1)  # (1,1) was used while still queued


def test_a_cancelled_prefetch_still_queued_never_takes_the_link():
    class Cancelling(ScriptedPrefetch):
        name = "scripted-cancel"

        def on_route(self, step, layer, routes):
            self.cancel = [(1, 0)] if (step, layer) == (0, 1) else []

        def cancellations(self):
            return self.cancel

    trace = _trace([[[0], [1]]])
    timing = Timing(transfer_ms=10, layer_ms=1)
    script = {(0, 0): [(1, 2), (1, 3), (1, 0)]}
    # (1,2) 0-10; demand (0,0) 10-20, compute -> 21; (1,3) 20-30 with (1,0) queued behind it. Layer 1's router
    # chose at 21: (1,0) is evicted and its queued copy dropped (issued copies count as loads either way); demand
    # (1,1) 30-40, compute -> 41: the link copied 40 of 41 ms. Kept, (1,0) would run 40-50 (busy to the end) and stay.
    result = simulate(trace, Cancelling(8, 2, 4, script), 8, timing)
    kept = _scripted(trace, 8, script, timing)
    assert (result.loads, result.wasted_prefetches, result.link_busy_share) == (5, 1, round(40 / 41, 6))
    assert (kept.loads, kept.wasted_prefetches, kept.link_busy_share) == (5, 0, 1.0)
    assert result.modeled_ms_per_token == kept.modeled_ms_per_token == 41


def test_a_held_demand_copy_released_while_a_prefetch_waits_goes_after_it():
    """A demand copy into a slot the running request hands off is held until that expert has computed: a prefetch
    the link could start before then goes first (the link sat idle and then ran the later copy first)."""
    from expertflow.policy.base import WAVE

    class TwoWaves(Policy):
        name = "two-waves"

        def __init__(self, *args):
            super().__init__(*args)
            self.waved = False

        def prefetches(self, step, layer):
            return [(2, 0), (2, 1), (2, 2), (2, 3), (0, 1), (0, 2)] if (step, layer) == (0, 1) else []

        def victim(self, key, evictable, free_slots):
            if free_slots:
                return None
            if not self.waved:  # R(0,1) = {0, 1} in two waves
                self.waved = True
                return WAVE
            return (1, 0)  # the second wave takes the first one's slot

    trace = Trace(experts=np.array([[[0, -1], [0, 1], [-1, -1]]], np.int32), num_experts=4)
    # (0,0) 0-10, compute -> 40; prefetches (2,0..3) 10-50; (1,0) 50-60, then (0,1) 60-70, (0,2) 70-80. The second
    # wave's (1,1) waits for (1,0) to compute (60-75), then goes next: 80-90; compute 90-105; layer 2 -> 135.
    result = simulate(trace, TwoWaves(8, 3, 4), 8, Timing(transfer_ms=10, layer_ms=30))
    assert (result.modeled_ms_per_token, result.stall_ms) == (135, 45)


def test_a_prefetch_that_lands_in_time_is_a_hit_and_not_late():
    trace = _trace([[[0], [1]]])
    result = _scripted(trace, 4, {(0, 0): [(1, 1)]}, Timing(transfer_ms=10, layer_ms=30))
    # (1,1) 0-10, demand (0,0) 10-20, compute -> 50: (1,1) landed long before R(0,1) starts
    assert (result.hits, result.prefetch_hits, result.late_prefetches) == (1, 1, 0)
    assert result.modeled_ms_per_token == 80


def test_lower_bound_and_json_document():
    trace = _trace([[[0, 1, 2]], [[0, 1, 2]]])
    timing = Timing(transfer_ms=10, layer_ms=6)
    # belady: 4 loads x 10 ms = 40 ms > 2 x 6 ms of compute; two tokens
    assert lower_bound_ms_per_token(Workload.from_trace(trace), 2, timing) == 20
    report = simulate_policies(trace, ["lru", "belady"], 2, timing)
    assert report["capacity_slots"] == 2 and report["lower_bound_ms_per_token"] == 20
    assert set(report["policies"]["lru"]) >= {"needs", "hits", "hit_rate", "loads", "on_demand_loads",
                                              "wasted_prefetches", "modeled_ms_per_token"}
    counting = simulate_policies(trace, ["lru"], 2)
    assert "lower_bound_ms_per_token" not in counting and "modeled_ms_per_token" not in counting["policies"]["lru"]
    assert "lower_bound_waves_ms_per_token" not in counting
    # requests that fit: Belady's 6 loads for pinned requests, 5 for any policy (test_loads_lower_bound_by_hand)
    report = simulate_policies(_trace([[[0, 3]], [[1, 2]], [[1, 3]], [[1, 2]]]), ["belady"], 2, timing)
    assert (report["lower_bound_ms_per_token"], report["lower_bound_waves_ms_per_token"]) == (60 / 4, 50 / 4)
    assert report["lower_bound_holds"] is True  # every request fits in the 2 slots


def test_lower_bound_holds_when_a_request_does_not_fit():
    # one layer, 2 slots, requests of 3 experts: waves, where Belady's rule is no longer optimal (6 loads; lru 5)
    trace = Trace(experts=np.array([[[1, 2, 3]], [[1, 2, 3]], [[0, 1, 3]]], np.int32), num_experts=4)
    timing = Timing(transfer_ms=10, layer_ms=1)
    report = simulate_policies(trace, ["lru", "belady"], 2, timing)
    assert (report["policies"]["lru"]["loads"], report["policies"]["belady"]["loads"]) == (5, 6)
    # per request at least max(experts needed first here, 3 − 2): 3 + 1 + 1 = 5 loads, lru's; the bound (stays
    # 1, 3 from step 0 to 1 and 1, 3 from 1 to 2 in two slots: 9 needs − 4) says as much; 50 ms / 3 tokens
    assert report["lower_bound_waves_ms_per_token"] == pytest.approx(50 / 3, abs=1e-6)
    assert report["policies"]["lru"]["modeled_ms_per_token"] >= report["lower_bound_waves_ms_per_token"]
    # the pinned figure keeps the output format's definition, Belady's loads (6: 60 ms / 3 tokens), though lru beats
    # it here; the table says it is no bound
    assert report["lower_bound_ms_per_token"] == pytest.approx(60 / 3, abs=1e-6)
    assert report["policies"]["lru"]["modeled_ms_per_token"] < report["lower_bound_ms_per_token"]
    assert report["lower_bound_holds"] is False  # and the document says so


def test_loads_lower_bound_by_hand():
    # one layer, 2 slots, steps {0, 3}, {1, 2}, {1, 3}, {1, 2}: stays 3 (step 0 → 2), 1 (1 → 2, 2 → 3), 2 (1 → 3);
    # two slots hold 3 then 1, and 1 again: 8 needs − 3 = 5 loads, which a policy in waves reaches
    # (tests/test_policy_plugins.py), while Belady's rule with pinned requests makes 6
    workload = Workload.from_trace(_trace([[[0, 3]], [[1, 2]], [[1, 3]], [[1, 2]]]))
    assert loads_lower_bound(workload, 2) == 5 and simulate(workload, "belady", 2).loads == 6
    timing = Timing(transfer_ms=10, layer_ms=1)
    assert lower_bound_ms_per_token(workload, 2, timing) == 60 / 4
    assert lower_bound_ms_per_token(workload, 2, timing, waves=True) == 50 / 4
    # a bound, not always reached: needs 0, 1, 0, 2, 1, 0 with 2 slots; stays 0 (0 → 2), 1 (1 → 4), 0 (2 → 5) fit
    # in two slots (3 loads), but then 2 finds no slot at step 3; Belady's 4 is the minimum
    workload = Workload.from_trace(_trace([[[e]] for e in (0, 1, 0, 2, 1, 0)]))
    assert (loads_lower_bound(workload, 2), simulate(workload, "belady", 2).loads) == (3, 4)
    assert loads_lower_bound(workload, 3) == 3 == simulate(workload, "belady", 3).loads  # first needs only


def _most_stays_plainly(workload: Workload, capacity: int) -> int:
    """The most stays (an expert kept in a slot from one need to its next) that fit in `capacity` slots, by trying
    every subset: a subset fits when at no request more than `capacity` of its stays are open ([start, end))."""
    last, stays = {}, []
    for i, r in enumerate(workload.requests):
        for e in r.experts:
            if (r.layer, e) in last:
                stays.append((last[(r.layer, e)], i))
            last[(r.layer, e)] = i
    best = 0
    for mask in range(1 << len(stays)):
        chosen = [s for j, s in enumerate(stays) if mask >> j & 1]
        if len(chosen) > best and all(sum(a <= t < b for a, b in chosen) <= capacity
                                      for t in range(len(workload.requests))):
            best = len(chosen)
    return best


def test_loads_lower_bound_holds_the_most_stays():
    """The greedy rule must keep the most stays (fewer would make the bound too high, so not a bound): checked
    against trying every subset, on random traces with up to 12 stays."""
    rng = np.random.default_rng(3)
    checked = 0
    while checked < 40:
        layers, experts = int(rng.integers(1, 3)), int(rng.integers(2, 6))
        tokens, k = int(rng.integers(2, 8)), int(rng.integers(1, 3))
        routes = np.stack([[rng.choice(experts, min(k, experts), replace=False) for _ in range(layers)]
                           for _ in range(tokens)])
        workload = Workload.from_trace(Trace(experts=routes.astype(np.int32), num_experts=experts))
        needs = sum(len(r.experts) for r in workload.requests)
        distinct = len(set(workload.future))
        if needs - distinct > 12:
            continue
        for capacity in range(1, layers * experts + 1):
            assert loads_lower_bound(workload, capacity) == needs - _most_stays_plainly(workload, capacity), capacity
        checked += 1


def test_capacity_and_timing_helpers():
    assert capacity_from_fraction(0.5, 32, 8) == 128 and capacity_from_fraction(1.0, 32, 8) == 256
    assert capacity_from_fraction(0.35, 45, 2) == 32  # 31.5 rounds up, though 0.35 × 90 is 31.499… in binary
    assert capacity_from_fraction(1e-6, 32, 8) == 1 and capacity_from_fraction(0.125, 3, 4) == 2  # 1.5 rounds up
    with pytest.raises(ValueError, match="must be in"):
        capacity_from_fraction(1.5, 2, 2)
    assert Timing.from_link(link_gbps=25, expert_mb=352, layer_ms=1.5).transfer_ms == pytest.approx(14.08)
    with pytest.raises(ValueError, match="offline oracle"):
        make_policy("belady", 4, 2, 4)


# -- properties on random traces -------------------------------------------------------------------------------------

@st.composite
def traces(draw) -> Trace:
    layers, experts = draw(st.integers(1, 3)), draw(st.integers(2, 5))
    k, n = draw(st.integers(1, min(experts, 3))), draw(st.integers(1, 14))
    route = st.lists(st.integers(0, experts - 1), min_size=k, max_size=k, unique=True)
    array = np.array(draw(st.lists(st.lists(route, min_size=layers, max_size=layers), min_size=n, max_size=n)))
    gaps = draw(st.lists(st.integers(0, 2), min_size=n, max_size=n))  # 0 = same step as the previous token
    return Trace(experts=array.astype(np.int32), num_experts=experts, steps=np.cumsum(gaps))


PROPERTY = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
POLICIES = [p for p in policy_names(include_oracles=False) if p != "expertflow"]  # expertflow: tests/test_ece.py
TIMING = Timing(transfer_ms=3, layer_ms=1, token_ms=0.5)


def _no_wave_capacities(workload: Workload) -> range:
    # with a cache smaller than one request, waves make "furthest next need" no longer optimal (see belady.py)
    largest = max((len(r.experts) for r in workload.requests), default=1)
    return range(max(largest, 1), workload.num_layers * workload.num_experts + 1)


@PROPERTY
@given(traces())
def test_belady_loads_are_minimal(trace):
    workload = Workload.from_trace(trace)
    for capacity in _no_wave_capacities(workload):
        best = simulate(workload, "belady", capacity).loads
        for name in POLICIES:
            assert simulate(workload, name, capacity).loads >= best, (name, capacity)
            assert simulate(workload, name, capacity, TIMING).loads >= best, (name, capacity)


@PROPERTY
@given(traces())
def test_hit_rate_does_not_fall_with_capacity(trace):
    workload = Workload.from_trace(trace)
    for name in ("lru", "belady"):
        hits = [simulate(workload, name, c).hits for c in _no_wave_capacities(workload)]
        assert hits == sorted(hits), name


@PROPERTY
@given(traces(), st.integers(1, 15))
def test_counts_add_up_in_both_modes(trace, capacity):
    workload = Workload.from_trace(trace)
    capacity = min(capacity, trace.num_layers * trace.num_experts)
    needs = sum(len(r.experts) for r in workload.requests)
    # none of these policies answers WAVE; Belady's loads bound them while every request fits
    pinned = lower_bound_ms_per_token(workload, capacity, TIMING) if capacity in _no_wave_capacities(workload) else 0
    bound = lower_bound_ms_per_token(workload, capacity, TIMING, waves=True)  # no policy may beat it
    fewest = loads_lower_bound(workload, capacity)
    assert bound <= lower_bound_ms_per_token(workload, capacity, TIMING) + 1e-9
    for name in [*POLICIES, "belady"]:
        counting, timed = simulate(workload, name, capacity), simulate(workload, name, capacity, TIMING)
        assert timed.modeled_ms_per_token >= max(pinned, bound) - 1e-9, name
        assert min(counting.loads, timed.loads) >= fewest, name
        for r in (counting, timed):
            assert r.hits + r.misses == r.needs == needs
            assert r.loads == r.on_demand_loads + r.prefetches and r.on_demand_loads <= r.misses
            assert r.wasted_prefetches <= r.prefetches
        if name in ("lru", "lru-layer", "lfu", "belady"):  # demand-only: time never changes a decision
            assert (timed.hits, timed.loads) == (counting.hits, counting.loads)


# -- command line ----------------------------------------------------------------------------------------------------

def _cli(argv: list[str]) -> int:
    from expertflow.cli import main

    return main(argv)


@pytest.fixture
def trace_file(tmp_path) -> Path:
    rows = [{"problem_id": p, "layer": l, "token_idx": t, "experts": [(p + l + t) % 4, (p + 2 * l + t + 1) % 4]}
            for p in range(2) for l in range(3) for t in range(5)]
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "t.safetensors"
    assert _cli(["trace", "import", "--format", "jsonl", "--input", str(log), "--out", str(out)]) == 0
    return out


def test_cli_stats_and_simulate_print_one_json_document(trace_file, capsys, tmp_path):
    capsys.readouterr()
    assert _cli(["trace", "stats", str(trace_file), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == 10
    argv = ["simulate", "--trace", str(trace_file), "--policy", "lru,belady", "--cache-fraction", "0.5", "--json"]
    assert _cli(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["capacity_slots"] == 6 and set(report["policies"]) == {"lru", "belady"}
    timed = argv[:-1] + ["--rebatch", "2", "--link-gbps", "16", "--expert-mb", "32", "--layer-ms", "1", "--json",
                         "--plot", str(tmp_path / "p.png")]
    assert _cli(timed) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["policies"]["lru"]["modeled_ms_per_token"] >= report["lower_bound_ms_per_token"] > 0
    assert report["lower_bound_ms_per_token"] >= report["lower_bound_waves_ms_per_token"] > 0
    assert (tmp_path / "p.png").stat().st_size > 1000
    assert _cli(timed[:timed.index("--json")]) == 0  # the table names both bounds
    table = capsys.readouterr().out
    assert f"lower bound for pinned requests (Belady's loads, transfers hidden behind compute): " \
           f"{report['lower_bound_ms_per_token']:.2f} ms/token" in table
    assert f"lower bound with waves (no policy goes below): {report['lower_bound_waves_ms_per_token']:.2f}" in table


def test_cli_errors_are_one_clear_line(trace_file, capsys):
    base = ["simulate", "--trace", str(trace_file), "--slots", "4"]
    assert _cli(base + ["--policy", "lru,nope"]) == 2
    assert "--policy: unknown policy nope; known policies:" in capsys.readouterr().err
    assert _cli(["simulate", "--trace", str(trace_file), "--cache-fraction", "2", "--policy", "lru"]) == 2
    assert "--cache-fraction 2.0 must be in (0, 1]" in capsys.readouterr().err
    assert _cli(["simulate", "--trace", str(trace_file), "--slots", "0", "--policy", "lru"]) == 2
    assert "--slots 0 must be at least 1" in capsys.readouterr().err
    assert _cli(base + ["--policy", "lru", "--link-gbps", "16"]) == 2
    assert "missing --expert-mb, --layer-ms" in capsys.readouterr().err
    assert _cli(base + ["--policy", "lru", "--link-gbps", "16", "--expert-mb", "32", "--layer-ms", "-1"]) == 2
    assert "--layer-ms -1.0 must be at least 0" in capsys.readouterr().err


def test_cli_table_says_when_the_pinned_bound_is_none(tmp_path, capsys):
    # requests of 3 experts in 2 slots (test_lower_bound_holds_when_a_request_does_not_fit)
    path = tmp_path / "big.safetensors"
    Trace(experts=np.array([[[1, 2, 3]], [[1, 2, 3]], [[0, 1, 3]]], np.int32), num_experts=4).save(path)
    timed = ["--link-gbps", "1", "--expert-mb", "10", "--layer-ms", "1"]
    capsys.readouterr()
    assert _cli(["simulate", "--trace", str(path), "--policy", "lru,belady", "--slots", "2", *timed]) == 0
    assert "not a bound here: a request needs more experts than the cache holds): 20.00 ms/token" in \
        capsys.readouterr().out
    assert _cli(["simulate", "--trace", str(path), "--policy", "lru,belady", "--slots", "3", *timed]) == 0
    assert "(Belady's loads, transfers hidden behind compute): " in capsys.readouterr().out
    for slots, holds in (("2", False), ("3", True)):
        assert _cli(["simulate", "--trace", str(path), "--policy", "lru", "--slots", slots, *timed, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["lower_bound_holds"] is holds


def test_cli_plot_file_is_named_as_written_and_never_the_trace(trace_file, capsys, tmp_path):
    base = ["simulate", "--trace", str(trace_file), "--policy", "lru", "--slots", "4", "--json"]
    capsys.readouterr()
    assert _cli(base + ["--plot", str(tmp_path / "sweep")]) == 0  # no extension: matplotlib's PNG
    assert capsys.readouterr().err.strip().endswith(f"wrote {tmp_path / 'sweep.png'}")
    assert (tmp_path / "sweep.png").stat().st_size > 1000 and not (tmp_path / "sweep").exists()
    pdf = tmp_path / "trace.pdf"
    pdf.write_bytes(trace_file.read_bytes())
    assert _cli(["simulate", "--trace", str(pdf), "--policy", "lru", "--slots", "4", "--plot", str(pdf)]) == 2
    assert f"--plot {pdf} is the input {pdf}; write the result to another file" in capsys.readouterr().err
    assert Trace.load(pdf).num_tokens == 10  # untouched


def test_cli_rebatch_beyond_the_sequences_is_one_batch_and_odd_timings_name_their_flags(trace_file, capsys):
    base = ["simulate", "--trace", str(trace_file), "--policy", "lru", "--slots", "4", "--json"]
    capsys.readouterr()
    assert _cli(base + ["--rebatch", "2"]) == 0
    both = json.loads(capsys.readouterr().out)
    assert _cli(base + ["--rebatch", str(2 ** 64)]) == 0  # more than the two sequences, past int64
    assert json.loads(capsys.readouterr().out) == both
    assert _cli(base + ["--link-gbps", "1", "--expert-mb", "1", "--layer-ms", "1e308", "--token-ms", "1e308"]) == 2
    err = capsys.readouterr().err
    assert "overflow (no finite result) with one expert's transfer taking 1 ms (--expert-mb 1.0 over --link-gbps " \
        "1.0) and --layer-ms 1e+308, --token-ms 1e+308" in err and err.count("\n") == 1
    # a transfer time that overflows once added up names the transfer's flags, not the compute's
    assert _cli(base + ["--link-gbps", "1e-5", "--expert-mb", "1.5e302", "--layer-ms", "1"]) == 2
    err = capsys.readouterr().err
    assert "transfer taking 1.5e+307 ms (--expert-mb 1.5e+302 over --link-gbps 1e-05) and --layer-ms 1.0;" in err
    for gbps, mb in (("1e-300", "1e300"), ("1e300", "1e-300")):
        assert _cli(base + ["--link-gbps", gbps, "--expert-mb", mb, "--layer-ms", "1"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"expertflow simulate: error: --expert-mb {float(mb)} over --link-gbps {float(gbps)}")
        assert err.count("\n") == 1


def test_a_report_with_any_infinite_or_nan_number_is_not_finite():
    from expertflow.commands.simulate import _finite

    assert _finite({"a": 1, "b": [0.5, {"c": 2.0}], "d": None, "e": "text"})
    for bad in (float("inf"), -float("inf"), float("nan")):
        assert not _finite({"policies": {"lru": {"modeled_ms_per_token": bad}}})
        assert not _finite({"rows": [1.0, bad]})


def test_cli_timed_mode_accepts_compute_proportional_to_tokens_alone(trace_file, capsys):
    argv = ["simulate", "--trace", str(trace_file), "--slots", "4", "--policy", "lru", "--link-gbps", "16",
            "--expert-mb", "32", "--layer-ms", "0", "--token-ms", "0.5", "--json"]
    capsys.readouterr()
    assert _cli(argv) == 0
    assert json.loads(capsys.readouterr().out)["policies"]["lru"]["modeled_ms_per_token"] > 0


@pytest.mark.skipif(not (REPO / "expertflow" / "__main__.py").is_file(), reason="`python -m expertflow` is absent")
def test_python_m_expertflow_simulate(trace_file):
    out = subprocess.run([sys.executable, "-m", "expertflow", "simulate", "--trace", str(trace_file), "--policy",
                          "lru,lfu", "--slots", "3", "--json"], capture_output=True, text=True, cwd=REPO, check=True)
    assert set(json.loads(out.stdout)["policies"]) == {"lru", "lfu"}


def _two_sequences(path: Path) -> Trace:
    """Two sequences of four tokens, each token its own step, one MoE layer of 8 experts; saved to `path`."""
    rng = np.random.default_rng(1)
    experts = np.stack([[rng.choice(8, 2, replace=False)] for _ in range(8)]).astype(np.int32)
    trace = Trace(experts=experts, num_experts=8, seq_ids=np.repeat([0, 1], 4), positions=np.tile(np.arange(4), 2),
                  steps=np.arange(8), phase=np.tile([0, 1, 1, 1], 2), model="toy")
    trace.save(path)
    return Trace.load(path)


def test_cli_plot_takes_an_upper_case_extension(files, capsys):
    argv = ["simulate", "--trace", str(files / "t.safetensors"), "--policy", "lru", "--slots", "2", "--json"]
    assert _cli(argv + ["--plot", str(files / "P.PNG")]) == 0
    assert (files / "P.PNG").stat().st_size > 1000


def test_cli_cache_fraction_1_caches_every_expert_and_0_names_the_flag(files, capsys):
    argv = ["simulate", "--trace", str(files / "t.safetensors"), "--policy", "lru", "--json", "--cache-fraction"]
    assert _cli(argv + ["1"]) == 0
    assert json.loads(capsys.readouterr().out)["capacity_slots"] == 4
    assert _cli(argv + ["0"]) == 2
    assert "expertflow simulate: error: --cache-fraction 0.0 must be in (0, 1]" in capsys.readouterr().err


def test_cli_policy_list_naming_no_policy_is_refused(files, capsys):
    assert _cli(["simulate", "--trace", str(files / "t.safetensors"), "--policy", ",", "--slots", "2", "--json"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "--policy: unknown policy ','; known policies: lru" in err


def test_cli_negative_token_ms_names_its_flag(files, capsys):
    argv = ["simulate", "--trace", str(files / "t.safetensors"), "--policy", "lru", "--slots", "2", "--link-gbps", "1",
            "--expert-mb", "1", "--layer-ms", "1", "--token-ms", "-1"]
    assert _cli(argv) == 2
    assert "expertflow simulate: error: --token-ms -1.0 must be at least 0" in capsys.readouterr().err


def test_cli_token_ms_is_compute_per_token_of_the_step(tmp_path, capsys):
    trace = _two_sequences(tmp_path / "t.safetensors")
    timed = ["--link-gbps", "16", "--expert-mb", "32", "--layer-ms", "0.5", "--token-ms", "3"]
    assert _cli(["simulate", "--trace", str(tmp_path / "t.safetensors"), "--policy", "lru", "--slots", "4", "--json",
                 *timed]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report == simulate_policies(trace, ["lru"], 4, Timing.from_link(16, 32, 0.5, 3.0))
    assert report != simulate_policies(trace, ["lru"], 4, Timing.from_link(16, 32, 0.5, 0.0))


def test_cli_rebatch_replays_sequences_together(tmp_path, capsys):
    trace = _two_sequences(tmp_path / "t.safetensors")
    argv = ["simulate", "--trace", str(tmp_path / "t.safetensors"), "--policy", "lru,belady", "--slots", "3", "--json"]
    assert _cli(argv + ["--rebatch", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report == simulate_policies(trace.rebatch(2), ["lru", "belady"], 3)
    assert report != simulate_policies(trace, ["lru", "belady"], 3)  # rebatching changes the requests here


def test_cli_refuses_a_predictor_no_policy_uses(files, capsys):
    argv = ["simulate", "--trace", str(files / "t.safetensors"), "--policy", "lru,belady", "--slots", "2", "--json",
            "--predictor", str(files)]
    assert _cli(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f"expertflow simulate: error: --predictor {files} is read only by predictive policies (" in captured.err
    assert "expertflow" in captured.err.split("(")[1].split(")")[0]  # plug-ins registered by other tests may follow
    assert "), and --policy lru,belady leaves them out: add one to --policy, or drop --predictor" in captured.err
    assert _cli(argv[:-2]) == 0


def test_cli_feeds_the_next_token_head_as_the_library_does(tmp_path, capsys):
    from expertflow.predictor import default_predictor_path, load_predictor
    from expertflow.predictor.evaluate import predict_trace

    rng = np.random.default_rng(0)
    experts = np.stack([[rng.choice(32, 4, replace=False) for _ in range(6)] for _ in range(5)])
    trace = Trace(experts=experts, num_experts=32, token_ids=rng.integers(10, 200, 5),
                  model="/srv/x/expertflow/assets/tiny-moe")  # the built-in model: the shipped predictor
    trace.save(tmp_path / "t.safetensors")
    trace = Trace.load(tmp_path / "t.safetensors")
    assert _cli(["simulate", "--trace", str(tmp_path / "t.safetensors"), "--policy", "expertflow", "--slots", "8",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    predictor = load_predictor(str(default_predictor_path()))
    assert predictor.has_next_head
    assert report == simulate_policies(trace, ["expertflow"], 8, None, predictor,
                                       predict_trace(predictor, trace, with_next=True))


def test_cli_table_columns_hold_their_figures(files, capsys):
    assert _cli(["simulate", "--trace", str(files / "t.safetensors"), "--policy", "lru", "--slots", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    head, row = lines[1].split(), lines[2].split()
    assert head[:3] == ["policy", "hit", "rate"] and head[3:6] == ["hits", "needs", "loads"]
    assert row[:5] == ["lru", "0.333", "2", "6", "4"]  # hits 2 of 6 needs, 4 loads


@pytest.mark.parametrize("kwargs", [dict(transfer_ms=-1.0, layer_ms=1.0), dict(transfer_ms=0.0, layer_ms=1.0),
                                    dict(transfer_ms=float("nan"), layer_ms=1.0), dict(transfer_ms=1.0, layer_ms=-0.5),
                                    dict(transfer_ms=1.0, layer_ms=1.0, token_ms=float("inf"))])
def test_timing_refuses_times_that_make_no_sense(kwargs):
    with pytest.raises(ValueError, match="must be a time"):
        Timing(**kwargs)


class _NewestFirst(Policy):
    """Prefetches (1, 0) then (1, 1) for layer 1, each evicting the newest resident: the second evicts the first
    while its copy is still held for the running request's expert."""

    name = "newest-first-test"

    def __init__(self, capacity, num_layers, num_experts):
        super().__init__(capacity, num_layers, num_experts)
        self.inserted = []

    def on_insert(self, key):
        self.inserted.append(key)

    def on_evict(self, key):
        self.inserted.remove(key)

    def prefetches(self, step, layer):
        return [(1, 0), (1, 1)] if layer == 1 else []

    def victim(self, key, evictable, free_slots):
        return None if free_slots else next((k for k in reversed(self.inserted) if evictable(k)), None)


def test_a_prefetch_replacing_a_held_prefetch_waits_as_it_did():
    # one slot: R(0, 0) reads expert 0 in it from t = 10 to 15; the prefetch of (1, 0) takes the slot (held until
    # then), and (1, 1) replaces it in the same slot: its copy too may start only at 15, as live
    trace = Trace(experts=np.array([[[0], [1]]], np.int32), num_experts=4)
    timing = Timing(transfer_ms=10.0, layer_ms=5.0)
    result = simulate(trace, _NewestFirst(1, 2, 4), 1, timing)
    assert result.prefetches == 2 and result.wasted_prefetches == 1
    assert result.modeled_ms_per_token == pytest.approx(10 + 5 + 10 + 5)  # (1, 1) lands at 25, layer 1: 30


def test_a_compute_bound_lower_bound_counts_every_token_of_each_step():
    # two sequences decoded together: each of the 2 steps x 2 layers computes for 1 ms + 0.5 ms per token (2 tokens);
    # 3 experts needed, all kept, on a link that takes 0.1 ms: compute decides, 4 x 2 ms over 4 tokens
    trace = Trace(experts=np.array([[[0], [1]], [[0], [2]], [[0], [1]], [[0], [2]]], np.int32), num_experts=4,
                  seq_ids=np.array([0, 1, 0, 1]), positions=np.array([0, 0, 1, 1]), steps=np.array([0, 0, 1, 1]))
    workload = Workload.from_trace(trace)
    timing = Timing(transfer_ms=0.1, layer_ms=1.0, token_ms=0.5)
    assert [r.tokens for r in workload.requests] == [2, 2, 2, 2]
    for waves in (False, True):
        assert lower_bound_ms_per_token(workload, 8, timing, waves=waves) == 4 * 2.0 / 4
    assert simulate(workload, "lru", 8, timing).modeled_ms_per_token >= 2.0


def test_hit_rate_is_kept_to_six_decimals():
    # one layer, needs 0 1 0 with 2 slots: one hit in three
    trace = Trace(experts=np.array([[[0]], [[1]], [[0]]], np.int32), num_experts=2)
    assert simulate(trace, "lru", 2).hit_rate == 0.333333
    assert simulate_policies(trace, ["lru"], 2)["policies"]["lru"]["hit_rate"] == 0.333333


def test_lookahead_refuses_a_transition_table_too_large_by_name(tmp_path, capsys):
    path = tmp_path / "wide.safetensors"
    Trace(experts=np.array([[[0], [1]], [[5], [65535]]], np.int32), num_experts=65536).save(path)
    assert _cli(["simulate", "--trace", str(path), "--policy", "lookahead", "--slots", "4", "--json"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "policy 'lookahead' keeps (layers - 1) x experts x experts transition counts: 32.0 GiB for " \
        "2 layers of 65536 experts (at most 4 GiB); choose another policy" in err


# Config refuses a cache_slots that is not a whole number; the simulator and make_policy did not (True ran with one
# slot, 2.0 failed deep inside with a TypeError, 2.5 built a policy)
@pytest.mark.parametrize("capacity", [True, 2.0, 2.5, 0, "2"])
def test_a_capacity_that_is_not_a_whole_number_of_slots_is_refused(capacity):
    trace = Trace(experts=np.array([[[0, 1]], [[1, 2]], [[2, 3]]]), num_experts=4, model="toy")
    with pytest.raises(ValueError, match="must be a whole number of slots, at least 1"):
        simulate(trace, "lru", capacity)
    with pytest.raises(ValueError, match="must be a whole number of slots, at least 1"):
        make_policy("lru", capacity, 1, 4)
    assert simulate(trace, "lru", np.int64(2)).hits == simulate(trace, "lru", 2).hits
