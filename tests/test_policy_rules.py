"""Single rules of the policies, the slot table and the simulator, each on a small hand-made case: how the simulator
calls a predictive policy and times a step (and a wave's early copy), which experts `prev-step` and `lru-layer` keep,
how a prefetch batch and a cancellation are served, which prefetches and futures are refused, and how `expertflow`
combines chances, ranks its waits (geometric, truncated, ties by recency), keeps a hot set, refines a layer from the
router, learns step-to-step transitions, chooses and places its prefetches and reads the predictions."""

from __future__ import annotations

import numpy as np
import pytest

from expertflow.policy import WAVE, PolicyError, make_policy
from expertflow.policy.prefetching import PrefetchingLRU
from expertflow.sim import Timing, simulate
from expertflow.slots import SlotTable, serve_request
from expertflow.trace import Trace
from test_sim import ScriptedPrefetch


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
    result = simulate(trace, ScriptedPrefetch(1, 2, 4, {(0, 1): [(1, 1), (1, 2)]}), 1)
    assert (result.prefetches, result.wasted_prefetches, result.prefetch_hits, result.hits) == (1, 0, 1, 1)


# the simulator: the first prefetch that gets no slot ends the batch, as live
def test_the_first_prefetch_refused_a_slot_ends_the_batch():
    class RefusesTwo(ScriptedPrefetch):
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
    class Cancelling(ScriptedPrefetch):
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


# expertflow without a next-token head: a geometric wait, one step being L requests
def test_expertflow_without_a_head_waits_geometrically_a_step_of_all_layers_at_a_time():
    policy = make_policy("expertflow", 4, 2, 4, beta=0.5, refine=0.0)
    policy.freq[1] = 0.5  # layer 1's experts: used in half the steps
    policy.on_route(0, 0, [[0]])
    enu = policy.expected_next_use()
    # layer 1 runs next but no prediction names its expert 3 (d = 0): q = 0.5 x 0 + 0.5 x 0.5 = 1/4 per step. Its first
    # chance is the next step's layer 1, 1 + 2 = 3 requests away; each step that misses adds 2 requests:
    # 3 + 2 x (1 - q) / q = 9
    assert enu[1, 3] == pytest.approx(9.0, abs=1e-3)


# expertflow: only experts that are not resident are offered for prefetch
def test_expertflow_offers_for_prefetch_only_experts_that_are_not_resident():
    policy = make_policy("expertflow", 4, 2, 4)
    policy.on_insert((1, 1))
    policy.on_step(0, _probs(2, 4, {(1, 1): 1.0, (1, 2): 0.9}))
    assert policy.prefetches(0, 1) == [(1, 2)]


# expertflow: a prefetch never takes the slot of an expert offered before it in the same batch
def test_expertflow_prefetch_never_takes_the_slot_of_one_offered_before_it_in_the_same_batch():
    policy = make_policy("expertflow", 2, 3, 4, horizon=2, margin=0.0)
    table = SlotTable(2, policy)
    table.allocate((0, 0))
    table.mark_ready((0, 0))
    # before the step: (0,0) is needed first; the batch for layers 1 and 2 is (1,1), then (2,2)
    policy.on_step(0, _probs(3, 4, {(0, 0): 1.0, (1, 1): 0.7, (2, 2): 1.0}))
    assert policy.prefetches(0, 1) == [(1, 1), (2, 2)]
    assert table.allocate((1, 1), handoff=True).evicted is None  # the free slot
    enu = policy.expected_next_use()
    assert enu[1, 1] > enu[2, 2] > enu[0, 0]  # (1,1) may be needed later than (2,2), but it is of the same batch
    assert table.allocate((2, 2), handoff=True) is None
    assert table.residents() == [(0, 0), (1, 1)]


# expertflow: ties go to the least recently used, a use being a need (as `lru` orders them), not a demand load
def test_expertflow_ties_go_to_the_least_recently_needed_as_in_lru_not_the_least_recently_loaded():
    def evicted(name):
        policy = make_policy(name, 2, 1, 4, **({"ema": 0.0} if name == "expertflow" else {}))
        table = SlotTable(2, policy)
        table.allocate((0, 2))
        table.mark_ready((0, 2))
        gone = []
        for step, experts in ((0, [1, 2]), (1, [3])):
            # step 0: expert 1 is needed before expert 2 and missed, so its demand load is placed after both needs
            policy.on_route(step, 0, [experts])
            for _ in serve_request(table, step, 0, experts, lambda key, slot, out: gone.append(out)):
                pass
        return gone

    # step 1: experts 1 and 2 are equally likely next (no prediction); expert 1 was needed least recently
    assert evicted("lru") == [None, (0, 1)]
    assert evicted("expertflow") == [None, (0, 1)]


# the simulator: a prefetch of a layer the model does not have is a PolicyError
def test_a_prefetch_of_a_layer_beyond_the_models_last_is_a_policy_error():
    trace = _trace([[[0], [1]]])
    with pytest.raises(PolicyError, match="outside the trace's 2 MoE layers"):
        simulate(trace, ScriptedPrefetch(4, 2, 4, {(0, 1): [(2, 0)]}), 4)


# belady: a future that is not the requests' need sequence is refused
def test_belady_refuses_a_future_that_differs_from_the_requests_served():
    trace = _trace([[[0], [1]], [[0], [1]]])
    wrong = [(0, 0), (1, 1), (0, 0), (1, 2)]  # as long as the needs, but the last one differs
    with pytest.raises(ValueError, match="differs from the requests served"):
        simulate(trace, make_policy("belady", 4, 2, 4, future=wrong), 4)


# expertflow: on_step reads the predictions and leaves the caller's arrays as they were (clipping its own copy)
def test_expertflow_clips_the_predictions_without_changing_the_callers_arrays():
    policy = make_policy("expertflow", 4, 1, 4)
    probs = np.array([[[np.nan, 1.5, -0.5, 0.7]]])  # float64, as the caller's own memory; the head's is a view of it
    policy.on_step(0, probs, probs[:, None])
    assert policy.demand[0] == pytest.approx([0.0, 1.0, 0.0, 0.7])  # a NaN counts as 0, the rest clipped to [0, 1]
    assert policy.next_demand[0, 0] == pytest.approx([0.0, 1.0, 0.0, 0.7])
    assert np.array_equal(probs, [[[np.nan, 1.5, -0.5, 0.7]]], equal_nan=True)


# timed mode: the next wave's early copy is raised to high priority once the expert it displaces has computed
def test_timed_mode_raises_the_next_waves_early_copy_above_queued_prefetches_once_its_gate_opens():
    class KeepsItsPrefetches(ScriptedPrefetch):
        """Demand loads never evict a prefetched expert: the request is served in waves instead."""

        name = "keeps-prefetches-test"

        def victim(self, key, evictable, free_slots):
            if key in self._targets or free_slots:
                return super().victim(key, evictable, free_slots)
            kept = set(self.script[(0, 1)])
            return self._oldest(lambda k: k not in kept and evictable(k)) or WAVE

    trace = _trace([[[0], [0, 1]]])
    policy = KeepsItsPrefetches(4, 2, 4, {(0, 1): [(0, 1), (0, 2), (0, 3)]})  # three prefetches layer 1 does not use
    result = simulate(trace, policy, 4, Timing(transfer_ms=10, layer_ms=4))
    # 0-10 (0,0) on demand; at 10 the three prefetches queue (the first copies 10-20); (0,0) computes 10-14.
    # Layer 1 takes (0,0)'s slot for (1,0) (copied 20-30, after the copy in flight): the prefetches hold the other
    # three, so (1,1) waits for a second wave. At 30 the second prefetch starts (30-40) and (1,1) takes (1,0)'s slot,
    # its copy held. (1,0) computes 30-32 and opens it: raised above the third prefetch, it copies 40-50, not 50-60.
    # (1,1) computes 50-52. Stalls: 0-10, 14-30 and 32-50.
    assert (result.modeled_ms_per_token, result.stall_ms, result.waves) == (52.0, 44.0, 1)


# expertflow: step-to-step transitions pair a layer's routes of one forward step with those of the next step only
def test_expertflow_learns_step_to_step_transitions_only_between_consecutive_steps_of_a_layer():
    policy = make_policy("expertflow", 4, 2, 4)
    prior = policy.step_trans.copy()
    policy.on_route(0, 0, [[1]])
    policy.on_route(0, 1, [[2]])
    for step in range(1, 5):  # layer 0 does not route in steps 1 to 4 (as an encoder layer after the prefill)
        policy.on_route(step, 1, [[2]])
    policy.on_route(5, 0, [[3]])
    assert np.array_equal(policy.step_trans[0], prior[0])  # step 0 -> step 5 is no transition
    assert policy.step_trans[1][2, 2] == pytest.approx(prior[1][2, 2] + 4)  # layer 1: 0 -> 1 -> ... -> 4
    policy.on_route(5, 1, [[2]])
    policy.on_route(6, 0, [[0]])
    assert policy.step_trans[0][3, 0] == pytest.approx(prior[0][3, 0] + 1)  # step 5 -> step 6 is one


# expertflow: waits are truncated at wait_cap steps (E[min(wait, cap)])
def test_expertflow_truncates_every_expected_wait_at_wait_cap_steps():
    policy = make_policy("expertflow", 4, 2, 4, wait_cap=1)
    policy.on_step(0, _probs(2, 4, {}), _probs(2, 4, {(1, 3): 1.0})[:, None])
    enu = policy.expected_next_use()
    # before the first layer: the head is sure the next step's layer 1 needs expert 3, 2 + 2 = 4 requests from now,
    # beyond the cap of one step (2 requests): its wait counts as 2, as every other one
    assert enu[1, 3] == pytest.approx(2.0, abs=1e-3)
    assert enu.max() <= 2.0


# expertflow with one MoE layer: deferring to waves leaves the next step's speculative prefetch to the margin rule
def test_with_one_moe_layer_deferring_to_waves_leaves_the_speculative_prefetch_to_the_margin():
    policy = make_policy("expertflow", 1, 1, 4, ema=0.0, margin=1.0, waves=True, defer_to_waves=True)
    table = SlotTable(1, policy)
    policy.on_step(0, _probs(1, 4, {(0, 0): 1.0}), _probs(1, 4, {(0, 2): 0.9}))
    policy.on_route(0, 0, [[0]])
    decisions = []
    for _ in serve_request(table, 0, 0, [0], lambda key, slot, gone: table.mark_ready(key)):
        # the step's only request holds (0,0), which no later step is predicted to need: the request that needs it
        # is this one, so no wave can free it later, and the guess (0,2) takes its slot by hand-off
        assert policy.prefetches(1, 0) == [(0, 2)]
        enu = policy.expected_next_use()
        assert enu[0, 0] > enu[0, 2] + policy.margin
        decisions.append(table.allocate((0, 2), handoff=True))
    assert decisions == [(0, (0, 0), True)]  # slot 0, evicting (0,0) by hand-off
