"""Single rules of the policies, the slot table and the simulator, each on a small hand-made case: how the simulator
calls a predictive policy and times a step, which experts `prev-step` and `lru-layer` keep, how a prefetch batch and a
cancellation are served, and how `expertflow` combines chances, ranks its waits, keeps a hot set and refines a layer
from the router."""

from __future__ import annotations

import numpy as np
import pytest

from expertflow.policy import make_policy
from expertflow.policy.prefetching import PrefetchingLRU
from expertflow.sim import Timing, simulate
from expertflow.slots import SlotTable, serve_request
from expertflow.trace import Trace


def _trace(steps: list[list[list[int]]], num_experts: int = 4) -> Trace:
    """One token per step: steps[s][l] = that token's experts at layer l (padded with -1)."""
    k = max(1, max(len(experts) for step in steps for experts in step))
    array = np.full((len(steps), len(steps[0]), k), -1, dtype=np.int32)
    for s, step in enumerate(steps):
        for layer, experts in enumerate(step):
            array[s, layer, :len(experts)] = experts
    return Trace(experts=array, num_experts=num_experts)


def _probs(layers: int, experts: int, hot: dict[tuple[int, int], float], rows: int = 1) -> np.ndarray:
    p = np.zeros((rows, layers, experts))
    for (layer, expert), value in hot.items():
        p[:, layer, expert] = value
    return p


class Scripted(PrefetchingLRU):
    """LRU that prefetches exactly `script[(step, layer)]` before that request (not registered)."""

    name = "scripted-test"

    def __init__(self, capacity, num_layers, num_experts, script):
        super().__init__(capacity, num_layers, num_experts)
        self.script = script

    def prefetches(self, step, layer):
        return self._offer(self.script.get((step, layer), []))


# timed mode: a step's compute grows with its tokens
def test_timed_mode_compute_grows_with_the_tokens_of_the_step():
    # one step of two sequences (two tokens), one MoE layer, both on expert 0
    trace = Trace(experts=np.array([[[0]], [[0]]], np.int32), num_experts=4, seq_ids=np.array([0, 1]),
                  positions=np.array([0, 0]), steps=np.array([0, 0]))
    result = simulate(trace, "lru", 4, Timing(transfer_ms=10, layer_ms=1, token_ms=2))
    # demand load 0-10, then the request computes for layer_ms + token_ms x 2 tokens = 5 -> 15; 15 ms / 2 tokens
    assert result.modeled_ms_per_token == 7.5 and result.stall_ms == 10


# prev-step: every expert of the layer's previous request
def test_prev_step_prefetches_every_expert_the_layer_needed_in_the_previous_step():
    policy = make_policy("prev-step", 4, 2, 4)
    policy.on_request(0, 1, [0, 2, 3])
    assert policy.prefetches(1, 1) == [(1, 0), (1, 2), (1, 3)]


# lru-layer: a slot is taken back from a layer over its share first
def test_lru_layer_takes_a_slot_back_from_a_layer_over_its_quota_before_one_at_its_quota():
    # 3 layers, 6 slots: quota 2 each. Step 0: layer 0 -> {0}, layer 2 -> {0, 1} (at its quota).
    # Step 1: layer 0 needs {0, 1, 2, 3}: all pinned, it borrows two free slots (4 > quota). The cache is full.
    # Step 1, layer 1 -> {0}: under its quota, no free slot: it takes back layer 0's least recent expert (0,0),
    # not the globally least recent (2,0), whose layer is only at its quota. Step 2: layer 2 -> {0} is a hit.
    trace = _trace([[[0], [], [0, 1]], [[0, 1, 2, 3], [0], []], [[], [], [0]]])
    result = simulate(trace, "lru-layer", 6)
    assert (result.hits, result.loads) == (2, 7)


# the simulator: on_step once per forward step, then the step's first layer's prefetches
class _Recorder(PrefetchingLRU):
    name = "recorder-test"
    wants_predictions = True

    def __init__(self, capacity, num_layers, num_experts):
        super().__init__(capacity, num_layers, num_experts)
        self.events = []

    def on_step(self, step, probs, next_probs=None):
        self.events.append(("on_step", step))

    def prefetches(self, step, layer):
        self.events.append(("prefetches", step, layer))
        return self._offer([])


def test_the_simulator_tells_a_predictive_policy_each_step_once_then_asks_for_its_first_layer():
    trace = _trace([[[0], [1]], [[2], [3]]])
    policy = _Recorder(4, 2, 4)
    simulate(trace, policy, 4, predictions=np.zeros((2, 2, 4)))
    assert [e for e in policy.events if e[0] == "on_step"] == [("on_step", 0), ("on_step", 1)]
    for step in (0, 1):
        at = policy.events.index(("on_step", step))
        assert policy.events[at + 1] == ("prefetches", step, 0), "layer 0 of the step is planned from its prediction"


# expertflow: demand of several tokens / sequences as independent chances, and the speculate threshold
def test_expertflow_demand_combines_tokens_and_sequences_as_independent_chances():
    policy = make_policy("expertflow", 8, 2, 4, theta=0.6, refine=0.0, speculate=0.7)
    # two tokens, each 0.5 on (1, 2): the chance layer 1 needs expert 2 is 1 - 0.5 * 0.5 = 0.75 >= theta
    # the head: two sequences, each 0.5 on (0, 1) for their next token: 0.75 >= speculate
    policy.on_step(0, _probs(2, 4, {(1, 2): 0.5}, rows=2), _probs(2, 4, {(0, 1): 0.5}, rows=2)[:, None])
    assert policy.demand[1, 2] == pytest.approx(0.75)
    policy.on_route(0, 0, [[0], [0]])
    assert policy.prefetches(0, 1) == [(1, 2)]
    policy.on_route(0, 1, [[2], [2]])
    assert policy.prefetches(1, 0) == [(0, 1)]
    # a guess below speculate (0.8 here) but above theta is not prefetched for the next step
    policy = make_policy("expertflow", 8, 2, 4, theta=0.6, speculate=0.8)
    policy.on_step(0, _probs(2, 4, {}), _probs(2, 4, {(0, 1): 0.7}))
    policy.on_route(0, 0, [[0]])
    policy.on_route(0, 1, [[0]])
    assert policy.prefetches(1, 0) == []


# expertflow: the hot set, and recency among equal waits
def _victim(policy, residents, step_probs=None, next_probs=None, route=1):
    table = SlotTable(len(residents), policy)
    for key in residents:
        table.allocate(key)
        table.mark_ready(key)
    if step_probs is not None:
        policy.on_step(0, step_probs, next_probs)
    policy.on_route(0, 0, [[route]])
    evicted = []
    list(serve_request(table, 0, 0, [route], lambda key, slot, gone: evicted.append(gone)))
    return evicted


def test_expertflow_keeps_a_hot_expert_unless_nothing_else_can_go_and_otherwise_evicts_the_least_recent():
    # expert 2 is the most used (hot with hot_fraction 0.5 of 2 slots); the head says the next token wants expert 3
    policy = make_policy("expertflow", 2, 1, 4, ema=0.0, hot_fraction=0.5)
    policy.freq[0] = [0.01, 0.01, 0.9, 0.01]
    head = _probs(1, 4, {(0, 3): 1.0})
    assert _victim(policy, [(0, 2), (0, 3)], _probs(1, 4, {(0, 1): 1.0}), head) == [(0, 3)], "the hot one stays"
    policy = make_policy("expertflow", 2, 1, 4, ema=0.0)
    policy.freq[0] = [0.01, 0.01, 0.9, 0.01]
    assert _victim(policy, [(0, 2), (0, 3)], _probs(1, 4, {(0, 1): 1.0}), head) == [(0, 2)], "no hot set: by wait"
    # equal waits: the least recently used goes first
    assert _victim(make_policy("expertflow", 2, 1, 4, ema=0.0), [(0, 2), (0, 3)]) == [(0, 2)]
    assert _victim(make_policy("expertflow", 2, 1, 4, ema=0.0), [(0, 3), (0, 2)]) == [(0, 3)]


# a prefetch never evicts another expert of its own batch
def test_a_prefetch_never_evicts_another_expert_of_the_same_batch():
    trace = _trace([[[0], [1]]])
    # one slot: (1,1) takes (0,0)'s slot by hand-off; (1,2) finds no victim outside the batch and is dropped
    result = simulate(trace, Scripted(1, 2, 4, {(0, 1): [(1, 1), (1, 2)]}), 1)
    assert (result.prefetches, result.wasted_prefetches, result.prefetch_hits, result.hits) == (1, 0, 1, 1)


# the simulator: the first prefetch that gets no slot ends the batch, as live
def test_the_first_prefetch_refused_a_slot_ends_the_batch():
    class RefusesTwo(Scripted):
        name = "refuses-two-test"

        def victim(self, key, evictable, free_slots):
            if key == (1, 2):
                return None  # no slot for this one
            return super().victim(key, evictable, free_slots)

    trace = _trace([[[0], [1]]])
    result = simulate(trace, RefusesTwo(1, 2, 4, {(0, 1): [(1, 2), (1, 1)]}), 1)
    assert (result.prefetches, result.hits) == (0, 0)


# the simulator: a cancellation evicts only prefetches whose copy has not finished
def test_cancelling_a_prefetch_that_has_landed_keeps_it():
    class Cancelling(Scripted):
        name = "cancelling-test"

        def on_route(self, step, layer, routes):
            self.cancel = [(1, 0)] if (step, layer) == (0, 1) else []

        def cancellations(self):
            return self.cancel

    trace = _trace([[[0], [1]], [[0], [0]]])
    # counting mode: the prefetch of (1,0) lands at once; layer 1's router then chooses 1, and the cancellation of
    # (1,0) finds its copy finished: it stays, and step 1's layer 1 uses it
    result = simulate(trace, Cancelling(4, 2, 4, {(0, 1): [(1, 0)]}), 4)
    assert (result.hits, result.prefetch_hits, result.wasted_prefetches, result.loads) == (2, 1, 0, 3)


# expertflow: before the first layer every layer is ahead; the router's choice refines the next layer
def test_expertflow_counts_requests_from_before_the_first_layer_and_refines_the_next_layer_from_the_router():
    policy = make_policy("expertflow", 4, 2, 4)
    policy.on_step(0, _probs(2, 4, {(0, 1): 1.0, (1, 3): 1.0}))
    enu = policy.expected_next_use()
    # no layer of the step has run: layer 0's sure expert is needed at the next request, layer 1's at the one after
    assert enu[0, 1] == pytest.approx(1.0, abs=1e-3) and enu[1, 3] == pytest.approx(2.0, abs=1e-3)
    # without predictions, layer 0's router choice refines layer 1's demand by the transitions learned online
    policy = make_policy("expertflow", 4, 2, 4, ema=0.0, refine=0.3)
    for step in range(10):
        policy.on_route(step, 0, [[0]])
        policy.on_route(step, 1, [[2]])
    policy.on_route(10, 0, [[0]])
    assert policy.demand[1, 2] == pytest.approx(0.3, abs=1e-3)
    enu = policy.expected_next_use()
    assert enu[1, 2] < enu[1, 3]
