"""The predictive policy `expertflow`: named decision scenarios, the simulator with predictions, and the live runtime
with a predictor and prefetching on (outputs must stay exactly the unwrapped model's)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

import expertflow
from expertflow import sim
from expertflow.adapters import find_adapter
from expertflow.policy import make_policy
from expertflow.slots import SlotTable, serve_request
from expertflow.trace import Trace
from families import FAMILIES, batch, generate_wrapped, make_tiny, random_predictor

GEN = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False)


def _probs(layers: int, experts: int, hot: dict[tuple[int, int], float]) -> np.ndarray:
    p = np.zeros((1, layers, experts))
    for (layer, expert), value in hot.items():
        p[0, layer, expert] = value
    return p


def test_prefetch_offers_predicted_experts_in_layer_order_most_probable_first():
    policy = make_policy("expertflow", 8, 3, 4, theta=0.5, horizon=2, refine=0.0)
    policy.on_step(0, _probs(3, 4, {(1, 2): 0.9, (1, 3): 0.6, (1, 0): 0.4, (2, 1): 0.8, (0, 0): 0.99}))
    policy.on_route(0, 0, [[0]])
    assert policy.prefetches(0, 1) == [(1, 2), (1, 3), (2, 1)]  # layers 1..2, p >= theta, most probable first
    assert policy.prefetches(1, 0) == []  # the next step's tokens are not known yet


def test_eviction_keeps_experts_predicted_for_later_layers():
    policy = make_policy("expertflow", 2, 3, 4, ema=0.0)
    table = SlotTable(2, policy)
    policy.on_step(0, _probs(3, 4, {(0, 1): 1.0, (2, 3): 0.95}))
    for layer, expert in ((2, 3), (0, 1)):  # both resident (e.g. prefetched)
        table.allocate((layer, expert))
        table.mark_ready((layer, expert))
    policy.on_route(0, 0, [[1]])
    list(serve_request(table, 0, 0, [1], lambda *a: None))  # layer 0 used expert 1 and finished
    policy.on_route(0, 1, [[0]])
    loads = []
    list(serve_request(table, 0, 1, [0], lambda key, slot, evicted: loads.append(evicted)))
    assert loads == [(0, 1)], "the expert already used this step goes; the one layer 2 will need stays"


def test_step_transitions_keep_the_expert_the_next_token_will_want():
    def run(temporal: float):
        policy = make_policy("expertflow", 4, 1, 4, ema=0.0, beta=0.0, temporal=temporal)
        for step in range(20):  # one sequence: a token on expert 0 is followed by one on expert 3, and back
            policy.on_route(step, 0, [[0]] if step % 2 == 0 else [[3]])
        for step in range(100, 120):  # another: 1 and 2 alternate
            policy.on_route(step, 0, [[1]] if step % 2 == 0 else [[2]])
        policy.on_route(200, 0, [[0]])
        return policy

    policy = run(temporal=1.0)
    assert policy.next_guess[0, 3] > 0.9 and policy.next_guess[0, 2] < 0.1
    enu = policy.expected_next_use()
    assert enu[0, 3] < enu[0, 2], "expert 3 follows expert 0, so it is expected sooner than expert 2"
    enu = run(temporal=0.0).expected_next_use()
    assert enu[0, 3] == pytest.approx(enu[0, 2]), "without the transitions nothing tells them apart"


def test_next_token_guess_decides_between_experts_the_step_no_longer_needs():
    def victim(next_probs):
        policy = make_policy("expertflow", 2, 1, 4, ema=0.0)
        table = SlotTable(2, policy)
        policy.on_step(0, _probs(1, 4, {(0, 1): 1.0}), next_probs)
        for expert in (2, 3):  # resident from earlier steps
            table.allocate((0, expert))
            table.mark_ready((0, expert))
        policy.on_route(0, 0, [[1]])
        evicted = []
        list(serve_request(table, 0, 0, [1], lambda key, slot, gone: evicted.append(gone)))
        return evicted

    assert victim(_probs(1, 4, {(0, 3): 0.9})) == [(0, 2)], "the next token is expected on expert 3: keep it"
    assert victim(_probs(1, 4, {(0, 2): 0.9})) == [(0, 3)], "... or on expert 2"
    # guesses for the next two tokens [R=1, K=2, L, E]: a need two steps ahead still beats none at all, and a need
    # in the next step beats one two steps ahead
    two = lambda first, second: np.stack([_probs(1, 4, first), _probs(1, 4, second)], axis=1)  # noqa: E731
    assert victim(two({}, {(0, 3): 0.9})) == [(0, 2)]
    assert victim(two({(0, 2): 0.9}, {(0, 3): 0.9})) == [(0, 3)]


def test_wait_is_truncated_so_that_unlikely_far_uses_do_not_decide():
    def waits(cap):
        policy = make_policy("expertflow", 2, 1, 4, ema=0.0, wait_cap=cap)
        # the head: expert 2 for the next token at even odds, expert 1 at 0.05; beyond, 2 is almost never used and
        # 1 is used in one step of 20
        policy.on_step(0, _probs(1, 4, {}), _probs(1, 4, {(0, 2): 0.5, (0, 1): 0.05}))
        policy.freq[0] = [0.05, 0.05, 0.001, 0.05]
        policy.on_route(0, 0, [[0]])
        return policy.expected_next_use()[0]

    # untruncated, expert 2's rare far uses weigh most (≈ 500 steps against 20); within 16 steps, its even odds of
    # being needed next step make it the one to keep
    assert waits(None)[2] > waits(None)[1]
    assert waits(16)[2] < waits(16)[1]
    # a geometric wait with chance 0.05 per step from the next step: E[min(T, 16 steps)], T counted in requests
    assert waits(16)[1] == pytest.approx(sum(0.95 ** j * 0.05 * (1 + j) for j in range(16)) + 0.95 ** 16 * 16)
    assert waits(10 ** 4)[1] == pytest.approx(waits(None)[1], rel=1e-9)
    with pytest.raises(ValueError, match="wait_cap"):
        make_policy("expertflow", 2, 1, 4, wait_cap=0)
    # the expectation sums over each step up to the cap: a huge one is refused, not a [cap, L, E] array mid-run
    with pytest.raises(ValueError, match=r"wait_cap=1000000000000 must be a number of steps from 1 to 10,000"):
        make_policy("expertflow", 2, 1, 4, wait_cap=10 ** 12)


@pytest.mark.parametrize("options, message", [
    ({"margin": 10 ** 400}, r"margin=10000000000000000000…\(401 characters\) must be a finite number"),
    ({"theta": 10 ** 309}, "theta=1000.* must be a finite number"),
    ({"wait_cap": 10 ** 400}, "wait_cap=1000.* must be a number of steps from 1 to 10,000"),
])
def test_option_values_past_floats_range_are_named(options, message):
    # integers a JSON document may hold: an OverflowError (or a NumPy type error) before, naming nothing
    with pytest.raises(ValueError, match=message):
        make_policy("expertflow", 2, 1, 4, **options)
    from fractions import Fraction  # other real numbers are read as floats
    assert make_policy("expertflow", 2, 1, 4, margin=Fraction(1, 2), hot_fraction=Fraction(1, 4)).margin == 0.5


def test_next_steps_first_layer_is_prefetched_from_the_next_token_guess_only_when_sure():
    policy = make_policy("expertflow", 8, 2, 4, speculate=0.8)
    policy.on_step(0, _probs(2, 4, {(0, 0): 1.0}), _probs(2, 4, {(0, 1): 0.95, (0, 2): 0.5, (1, 3): 0.99}))
    policy.on_route(0, 0, [[0]])
    policy.on_route(0, 1, [[0]])
    assert policy.prefetches(1, 0) == [(0, 1)], "only layer 0's sure guess; layer 1 waits for the real predictions"
    assert policy.prefetches(1, 1) == [], "the next step's later layers wait for its real predictions"
    assert make_policy("expertflow", 8, 2, 4, speculate=0.0).prefetches(1, 0) == []


def test_step_predictions_pair_each_step_with_the_guess_at_each_sequences_last_token():
    # two sequences decoding together: prompts of 3 and 2 tokens (step 0), then one token each (steps 1, 2)
    seq_ids = np.array([0, 0, 0, 1, 1, 0, 1, 0, 1])
    positions = np.array([0, 1, 2, 0, 1, 3, 2, 4, 3])
    steps = np.array([0, 0, 0, 0, 0, 1, 1, 2, 2])
    trace = Trace(experts=np.zeros((9, 1, 1), np.int32), num_experts=2, seq_ids=seq_ids, positions=positions,
                  steps=steps, token_ids=np.arange(9), phase=(steps > 0).astype(np.uint8))
    probs = np.arange(9, dtype=float).reshape(9, 1, 1) * np.ones((1, 1, 2))
    after = probs + 100
    split = sim.step_predictions(trace, probs, after)
    assert sorted(split) == [0, 1, 2]
    tokens, guesses = split[0]
    assert tokens[:, 0, 0].tolist() == [0, 1, 2, 3, 4] and guesses[:, 0, 0].tolist() == [102, 104]
    assert split[1][1][:, 0, 0].tolist() == [105, 106] and split[2][1][:, 0, 0].tolist() == [107, 108]
    assert isinstance(sim.step_predictions(trace, probs)[0], np.ndarray)  # without a next-token guess: as before
    with pytest.raises(ValueError, match="next-token predictions"):
        sim.step_predictions(trace, probs, after[:3])
    with pytest.raises(ValueError, match=r"predictions of shape \(9, 1, 4\) do not match .* x 2 experts"):
        sim.step_predictions(trace, np.zeros((9, 1, 4)))  # twice the experts: not read as twice the tokens
    with pytest.raises(ValueError, match=r"no entry for step\(s\) \[1\] of the trace"):
        sim.simulate(trace, "expertflow", 2, predictions={s: split[s] for s in (0, 2)})


def test_true_predictions_are_the_trace_routes_and_each_tokens_successors_in_its_sequence():
    # two sequences whose rows are interleaved; sequence 1 skips position 2: its position 3 still follows position 1
    seq_ids = np.array([1, 0, 0, 1, 0, 1])
    positions = np.array([0, 0, 1, 1, 2, 3])
    routes = np.array([[[0, 1], [2, -1]], [[1, 2], [3, 0]], [[3, 0], [0, 1]],
                       [[2, 3], [1, -1]], [[0, 2], [2, 3]], [[1, 3], [0, 2]]], np.int32)  # -1: no expert
    trace = Trace(experts=routes, num_experts=4, seq_ids=seq_ids, positions=positions, steps=np.arange(6))
    now = sim.true_predictions(trace)
    assert now.shape == (6, 2, 4) and now.dtype == np.float32
    assert [np.flatnonzero(now[i, layer]).tolist() for i in (0, 3) for layer in (0, 1)] == [[0, 1], [2], [2, 3], [1]]
    assert now.sum() == 2 * 6 * 2 - 2  # one-hot per chosen expert; the two -1 entries choose nothing
    again, following = sim.true_predictions(trace, next_tokens=2)
    assert np.array_equal(again, now) and following.shape == (6, 2, 2, 4) and following.dtype == np.float32
    assert np.array_equal(following[1, 0], now[2]) and np.array_equal(following[1, 1], now[4])  # seq 0: 0 → 1, 2
    assert np.array_equal(following[2, 0], now[4]) and not following[2, 1].any()  # past the end of seq 0
    assert np.array_equal(following[0, 0], now[3]) and np.array_equal(following[0, 1], now[5])  # seq 1: 0 → 1, 3
    assert np.array_equal(following[3, 0], now[5]) and not following[3, 1].any()
    assert not following[4].any() and not following[5].any()  # last tokens
    _, far = sim.true_predictions(trace, next_tokens=9)  # further than any sequence (and the trace) reaches
    assert np.array_equal(far[:, :2], following) and not far[:, 2:].any()
    empty = Trace(experts=np.zeros((0, 2, 2), np.int32), num_experts=4)
    assert [a.shape for a in sim.true_predictions(empty, next_tokens=3)] == [(0, 2, 4), (0, 3, 2, 4)]
    with pytest.raises(ValueError, match="next_tokens=-1"):
        sim.true_predictions(trace, next_tokens=-1)
    for bad in (1.5, True):
        with pytest.raises(TypeError, match="next_tokens="):
            sim.true_predictions(trace, next_tokens=bad)
    # a position recorded twice (a later step re-reading it) is followed by its later copy, as the predictor reads them
    twice = Trace(experts=np.array([[[1]], [[2]], [[3]]], np.int32), num_experts=4, seq_ids=np.zeros(3, np.int32),
                  positions=np.array([0, 0, 1]), steps=np.array([1, 0, 2]))
    _, after = sim.true_predictions(twice, next_tokens=1)
    assert [np.flatnonzero(after[i, 0, 0]).tolist() for i in range(3)] == [[3], [1], []]


def test_live_correction_cancels_prefetches_the_router_did_not_choose():
    policy = make_policy("expertflow", 8, 2, 4, theta=0.5, refine=0.0)
    policy.on_step(0, _probs(2, 4, {(1, 0): 0.9, (1, 1): 0.8}))
    policy.on_route(0, 0, [[2]])
    assert set(policy.prefetches(0, 1)) == {(1, 0), (1, 1)}
    policy.on_route(0, 1, [[1]])
    assert policy.cancellations() == [(1, 0)]
    assert policy.cancellations() == []


@pytest.mark.parametrize("case", ["theta 0", "no prediction", "predicted 0"])
def test_live_correction_cancels_every_offered_prefetch_the_router_did_not_choose(case):
    if case == "theta 0":  # everything not resident is offered, the experts predicted 0 too
        policy = make_policy("expertflow", 8, 2, 4, theta=0.0, refine=0.0)
        policy.on_step(0, _probs(2, 4, {(1, 0): 0.9}))
        policy.on_route(0, 0, [[2]])
        assert policy.prefetches(0, 1) == [(1, 0), (1, 1), (1, 2), (1, 3)]
        policy.on_route(0, 1, [[0]])
        assert policy.cancellations() == [(1, 1), (1, 2), (1, 3)]
        return
    # the next-token head's guess for the next step's first layer, which then runs without a prediction, or with
    # one that rates the guess 0
    policy = make_policy("expertflow", 8, 1, 4, speculate=0.5)
    head = np.zeros((1, 1, 1, 4))
    head[0, 0, 0, 3] = 0.9
    policy.on_step(0, _probs(1, 4, {}), head)
    policy.on_route(0, 0, [[0]])
    assert policy.prefetches(1, 0) == [(0, 3)]
    if case == "predicted 0":
        policy.on_step(1, _probs(1, 4, {(0, 1): 0.9}))
    policy.on_route(1, 0, [[1]])
    assert policy.cancellations() == [(0, 3)]


def test_a_prediction_of_the_wrong_shape_is_refused():
    policy = make_policy("expertflow", 8, 2, 4)
    for wrong in (np.zeros((1, 4, 2)), np.zeros((1, 2, 2, 2)), np.zeros(8)):
        with pytest.raises(ValueError, match=r"probs of shape .*: expected \[T, L, E\] with L = 2 MoE layers and E"):
            policy.on_step(0, wrong)
    with pytest.raises(ValueError, match=r"next_probs of shape \(1, 1, 4, 2\): expected \[R, K, L, E\]"):
        policy.on_step(0, np.zeros((1, 2, 4)), np.zeros((1, 1, 4, 2)))
    policy.on_step(0, np.zeros((2, 4)), np.zeros((1, 2, 4)))  # one token's [L, E], and a head for K = 1: fine
    trace = Trace(experts=np.array([[[0], [1]]], np.int32), num_experts=4)
    with pytest.raises(ValueError, match="expected \\[T, L, E\\]"):  # a dict of step predictions, as given
        sim.simulate(trace, "expertflow", 2, predictions={0: np.zeros((1, 4, 2))})


def test_with_use_quota_the_shares_are_whole_slots_adding_up_to_the_cache_earliest_layers_first():
    policy = make_policy("expertflow", 4, 3, 4, theta=0.5, refine=0.0, use_quota=True)
    table = SlotTable(4, policy)
    policy.on_step(0, np.full((1, 3, 4), 0.9))  # equal demand: 4/3 slots each
    assert policy.quota.tolist() == [2, 1, 1]
    policy.on_route(0, 0, [[0]])
    offered = policy.prefetches(0, 1)
    assert offered == [(1, 0)]  # layer 1's one slot; the three free slots stay free
    assert table.allocate(offered[0], handoff=True) is not None and table.free_slots == 3
    policy = make_policy("expertflow", 5, 2, 4, use_quota=True)
    policy.on_step(0, _probs(2, 4, {(0, 0): 0.3, (1, 0): 0.9, (1, 1): 0.3}))  # shares 1.0 and 4.0: whole already
    assert policy.quota.tolist() == [1, 4]


def test_integer_shares_round_down_and_give_the_rest_to_the_earliest_layers_with_a_fraction():
    from expertflow.policy.expertflow import _integer_shares

    assert _integer_shares(2, np.array([2.0, 1.0, 1.0])).tolist() == [1, 1, 0]  # 1, 0.5, 0.5
    assert _integer_shares(5, np.array([1.0, 0.0, 4.0])).tolist() == [1, 0, 4]  # whole already: nothing moves
    assert _integer_shares(7, np.array([1.0, 1.0, 1.0])).tolist() == [3, 2, 2]
    assert _integer_shares(1, np.array([0.0, 1.0, 1.0])).tolist() == [0, 1, 0]


def test_hot_set_keeps_recency_among_equal_waits_and_at_least_one_expert():
    policy = make_policy("expertflow", 2, 1, 4, hot_fraction=1.0, ema=0.0)
    table = SlotTable(2, policy)
    for expert in (0, 1):
        table.allocate((0, expert))
        table.mark_ready((0, expert))
    policy.freq[0] = [0.5, 0.5, 0.1, 0.1]
    policy.on_route(0, 0, [[1], [0]])  # the hot set: experts 0 and 1, with equal waits
    policy.on_access((0, 1))
    policy.on_access((0, 0))  # 1 is now the least recently used of the two
    for _ in range(50):
        policy.on_access((0, 3))
    policy.expected_next_use()
    assert policy.hot[0, :2].all() and policy._wait[0, 0] == policy._wait[0, 1]
    assert policy.victim((0, 2), table.resident, 0) == (0, 1)
    policy = make_policy("expertflow", 8, 1, 8, hot_fraction=0.1, ema=0.5)  # 0.8 of a slot: one expert
    policy.on_route(0, 0, [[5]])
    assert policy.hot[0].tolist() == [e == 5 for e in range(8)]
    # that share of the slots: 0.29 of 100 is 29 (28.999… in floats gave 28)
    for fraction, slots, size in ((0.29, 100, 29), (0.57, 100, 57), (0.58, 50, 29)):
        policy = make_policy("expertflow", slots, 1, 128, hot_fraction=fraction, ema=0.5)
        policy.on_route(0, 0, [[0]])
        assert policy.hot.sum() == size


def test_a_hot_experts_prefetch_keeps_the_margin_to_what_it_would_evict():
    """A hot expert's wait is offset so that it stays resident; a prefetch of one must still leave an expert needed
    sooner (within the margin) alone: it evicted layer 1's certain experts for a guess of 0.7, and the cache thrashed."""
    steps = 6
    experts = np.full((steps, 2, 2), -1, np.int32)
    experts[:, 1] = [0, 1]  # layer 1 needs experts 0 and 1 every step
    trace = Trace(experts=experts, num_experts=4, steps=np.arange(steps))
    probs = np.zeros((steps, 2, 4))
    probs[:, 1, [0, 1]] = 1.0
    probs[:, 1, 3] = 0.7  # and (1, 3), the most used expert, maybe
    results = []
    for hot_fraction in (0.0, 0.5):  # hot set: (1, 3) alone
        policy = make_policy("expertflow", 2, 2, 4, ema=0.0, hot_fraction=hot_fraction, refine=0.0)
        policy.freq[:] = 0.01
        policy.freq[1, 3] = 0.9
        result = sim.simulate(trace, policy, 2, predictions=probs)
        results.append((result.hits, result.loads, result.wasted_prefetches))
    assert results[1] == results[0] == (12 - 2 + 2, 2, 0)  # the two first loads, then hits


def test_hot_set_is_kept_with_hysteresis():
    policy = make_policy("expertflow", 4, 1, 8, hot_fraction=0.5, ema=0.5)
    for step in range(6):
        policy.on_route(step, 0, [[0], [1]])
    assert policy.hot[0, 0] and policy.hot[0, 1] and not policy.hot[0, 5]
    # a hot expert that falls just out of the top 2 stays (it leaves below rank ceil(1.25 x 2) = 3)
    policy = make_policy("expertflow", 4, 1, 8, hot_fraction=0.5, ema=0.0)
    policy.freq[0] = [0.9, 0.8, 0.7, 0.1, 0.1, 0.1, 0.1, 0.1]
    policy.on_route(0, 0, [[0]])
    assert policy.hot[0].tolist()[:3] == [True, True, False]
    policy.freq[0, :3] = [0.9, 0.7, 0.8]  # expert 1 now ranks third
    policy.on_route(1, 0, [[0]])
    assert policy.hot[0].tolist()[:3] == [True, True, True]
    policy.freq[0, :4] = [0.9, 0.6, 0.8, 0.7]  # and then fourth: out
    policy.on_route(2, 0, [[0]])
    assert policy.hot[0].tolist()[:4] == [True, False, True, False]



def test_nan_predictions_count_as_no_prediction():
    # a broken predictor (an fp16 overflow) must not make every expert look certain: NaN is read as 0
    policy = make_policy("expertflow", 8, 2, 4, theta=0.5, refine=0.0)
    probs = _probs(2, 4, {(0, 1): 0.9})
    probs[0, 0, 2:] = np.nan
    policy.on_step(0, probs, np.full((1, 2, 2, 4), np.nan))
    assert policy.prefetches(0, 0) == [(0, 1)]
    assert np.isfinite(policy.demand).all() and np.isfinite(policy.expected_next_use()).all()


@pytest.mark.parametrize("head", [np.zeros((0, 2, 2, 4)), np.zeros((1, 0, 2, 4))])
def test_an_empty_next_token_head_is_no_guess(head):
    policy = make_policy("expertflow", 8, 2, 4, theta=0.5)
    policy.on_step(0, np.zeros((0, 2, 4)), head)
    assert policy.next_demand is None and policy.prefetches(1, 0) == []


def test_the_next_token_guess_is_dropped_after_a_step_without_prediction():
    policy = make_policy("expertflow", 8, 1, 4, speculate=0.5)
    head = np.zeros((1, 1, 1, 4))
    head[0, 0, 0, 3] = 0.9
    policy.on_step(0, _probs(1, 4, {}), head)
    assert policy.prefetches(1, 0) == [(0, 3)]  # after step 0: the head's guess for step 1
    policy.on_route(1, 0, [[0]])  # step 1 ran without a prediction (e.g. a forward fed embeddings)
    assert policy.prefetches(2, 0) == []  # the guess was about step 1, not step 2


def test_with_use_quota_a_prefetch_never_takes_a_layer_above_its_share():
    policy = make_policy("expertflow", 8, 2, 8, theta=0.5, refine=0.0, use_quota=True)
    table = SlotTable(8, policy)
    policy.on_step(0, np.full((1, 2, 8), 0.9))  # equal demand: 4 slots each
    issued = [key for key in policy.prefetches(0, 0) if table.allocate(key, handoff=True) is not None]
    assert len(issued) == 4 and table.free_slots == 4  # the other 4 free slots stay free


def test_with_one_moe_layer_the_next_steps_prefetches_keep_the_margin():
    # the last request's experts must not count as demand once it has ended (with one layer they are layer 0's)
    policy = make_policy("expertflow", 1, 1, 4, theta=0.5, refine=0.0, margin=1e6)
    table = SlotTable(1, policy)
    load = lambda key, slot, evicted, *busy: table.mark_ready(key)  # noqa: E731
    policy.on_step(0, _probs(1, 4, {}))
    policy.on_route(0, 0, [[1, 2]])
    assert sum(1 for _ in serve_request(table, 0, 0, [1, 2], load)) == 2  # one slot: expert 1, then expert 2
    policy.on_step(1, _probs(1, 4, {(0, 1): 0.9}))
    assert policy.prefetches(1, 0) == [(0, 1)]
    assert table.allocate((0, 1), handoff=True) is None  # (0, 2) may be needed sooner than the margin allows

def test_with_one_moe_layer_a_prefetch_of_the_running_requests_expert_keeps_the_margin():
    """With one MoE layer, the next step's first prefetch may name an expert of the request still running that its
    next wave took the slot of: it is still a prefetch, and may evict only an expert needed more than `margin`
    requests after it, as for an expert the request does not read."""
    decisions = {}
    for request in ([0, 1], [1, 2]):  # expert 0 read by the running request, or not
        policy = make_policy("expertflow", 1, 1, 4, ema=0.0, speculate=0.8, margin=4.0)
        table = SlotTable(1, policy)
        policy.on_step(0, _probs(1, 4, {(0, e): 1.0 for e in request}), _probs(1, 4, {(0, 0): 0.9, (0, request[1]): 0.9}))
        policy.on_route(0, 0, [[e] for e in request])
        for wave in serve_request(table, 0, 0, request, lambda key, slot, gone, *busy: table.mark_ready(key)):
            if wave.more:
                wave.start_next()
                continue
            assert policy.prefetches(1, 0) == [(0, 0)]  # the last wave's expert is as likely next: within the margin
            decisions[request[0]] = table.allocate((0, 0), handoff=True)
    assert decisions == {0: None, 1: None}


def _oracle(trace: Trace, noise: float, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n, layers, k = trace.experts.shape
    probs = rng.uniform(0, noise, (n, layers, trace.num_experts))
    for j in range(k):
        rows, cols = np.nonzero(trace.experts[:, :, j] >= 0)
        probs[rows, cols, trace.experts[rows, cols, j]] = rng.uniform(0.6, 1.0, len(rows))
    return probs


def _random_trace(seed: int, tokens: int = 300, layers: int = 4, experts: int = 16, k: int = 2) -> Trace:
    rng = np.random.default_rng(seed)
    popular = rng.dirichlet(np.ones(experts) * 0.5, size=layers)
    picks = np.stack([[rng.choice(experts, k, replace=False, p=popular[l]) for l in range(layers)]
                      for _ in range(tokens)])
    return Trace(experts=picks.astype(np.int32), num_experts=experts)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_simulated_expertflow_with_good_predictions_beats_lru_in_time(seed):
    trace = _random_trace(seed)
    timing = sim.Timing(transfer_ms=8.0, layer_ms=1.0)
    capacity = 24
    lru = sim.simulate(trace, "lru", capacity, timing)
    ours = sim.simulate(trace, "expertflow", capacity, timing, predictions=_oracle(trace, 0.2, seed))
    belady = sim.simulate(trace, "belady", capacity)
    assert ours.needs == lru.needs and ours.hits + (ours.needs - ours.hits) == ours.needs
    assert ours.modeled_ms_per_token < lru.modeled_ms_per_token
    assert ours.loads <= 2 * belady.loads


def test_expertflow_depends_on_the_order_of_steps_not_their_numbers():
    # Trace.subset keeps the original step numbers: a replay with gaps between steps must count exactly as one
    # without (the policy's "next step" is the next one in order, not step + 1).
    rng = np.random.default_rng(0)
    trace = _random_trace(0, tokens=40)
    probs = rng.random((trace.num_tokens, trace.num_layers, trace.num_experts)) * 0.3
    for t in range(trace.num_tokens):
        for layer in range(trace.num_layers):
            probs[t, layer, trace.experts[t, layer]] = 0.9
    nxt = np.stack([np.roll(probs, -1, 0), np.roll(probs, -2, 0)], 1)  # [N, 2, L, E]: the next two tokens' guess
    timing = sim.Timing(transfer_ms=10.0, layer_ms=2.0)
    rows = []
    for stride in (1, 3):
        gapped = replace(trace, steps=(stride * np.arange(trace.num_tokens)).astype(np.int32))
        rows.append(sim.simulate_policies(gapped, ["expertflow"], 10, timing, predictions=(probs, nxt)))
    assert rows[0] == rows[1]
    assert rows[0]["policies"]["expertflow"]["prefetches"] > 0


def test_simulator_requires_predictions_for_expertflow():
    with pytest.raises(ValueError, match="driven by route predictions: pass predictions="):
        sim.simulate(_random_trace(0, tokens=10), "expertflow", 8)


@pytest.mark.parametrize("options", [None, {"waves": True}, {"waves": True, "margin": 8.0, "wave_gap": 2.0},
                                     {"waves": True, "margin": 8.0, "wave_gap": 2.0, "defer_to_waves": True},
                                     {"waves": True, "wave_gap": 2.0, "on_demand_target": 0.08}],
                         ids=["pinned", "waves", "waves-tuned", "waves-defer", "waves-budget"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_live_expertflow_policy_keeps_outputs_exact(family, options, tmp_path):
    model = make_tiny(family)
    inputs = batch(family)
    reference = model.generate(**inputs, **GEN)
    predictor = random_predictor(model, tmp_path)
    total = sum(layer.num_experts for layer in find_adapter(model)[1])
    if family == "switch_transformers":  # encoder-decoder: the predictor is not run (see the test below)
        predictor = None
    for slots in (1, max(1, total // 4), total):
        out, s = generate_wrapped(model, inputs, GEN, cache_slots=slots, policy="expertflow", predictor=predictor,
                                  device="cpu", policy_options=options)
        assert torch.equal(out, reference), f"{family} at {slots} slots"
        assert s.hits + s.misses == s.needs
        assert s.loads == s.on_demand_loads + s.prefetches
        if family != "switch_transformers" and slots > 1:
            assert s.predictor_s > 0


def test_encoder_decoder_expertflow_plans_from_observed_routes_without_a_predictor():
    model = make_tiny("switch_transformers")
    inputs = batch("switch_transformers")
    reference = model.generate(**inputs, **GEN)
    out, stats = generate_wrapped(model, inputs, GEN, cache_slots=3, policy="expertflow", device="cpu")
    assert torch.equal(out, reference) and stats.needs > 0 and stats.predictor_s == 0


def test_expertflow_policy_without_predictor_is_a_clear_error():
    model = make_tiny("mixtral")
    with pytest.raises(expertflow.WrapError, match="predictor=DIR"):
        expertflow.wrap(model, cache_slots=4, policy="expertflow", device="cpu")
    with pytest.raises(expertflow.WrapError, match="not wrapped"):
        expertflow.stats(model)


def test_live_step_is_planned_and_first_layer_prefetched_before_the_embedding_runs():
    """The predictor's output is used at once: layer 0's prefetches are issued before the model embeds the step's
    tokens, so the copies overlap the embedding and the first attention."""
    from transformers import AutoTokenizer

    from expertflow.models import tiny_moe

    model = tiny_moe(dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model.name_or_path)
    tokenizer.padding_side = "left"
    inputs = dict(tokenizer(["Translate to French: the cat sleeps.", "def add(a, b):"], return_tensors="pt",
                            padding=True))
    expertflow.wrap(model, cache_slots=48, policy="expertflow", device="cpu")
    try:
        stats = expertflow.stats(model)
        at_embedding, at_end = [], []
        hooks = [model.get_input_embeddings().register_forward_pre_hook(
                     lambda *_: at_embedding.append(stats.prefetches)),
                 model.register_forward_hook(lambda *_: at_end.append(stats.prefetches))]
        model.generate(**inputs, max_new_tokens=8, min_new_tokens=8, do_sample=False)
        for hook in hooks:
            hook.remove()
        policy = expertflow.runtime.runtime_of(model).cache.policy
        assert policy.next_demand is not None and policy.next_demand.shape == (8, 6, 32), \
            "the shipped predictor's next-token guess did not reach the policy"
    finally:
        expertflow.unwrap(model)
    assert at_embedding[0] > 0, "the prefill step's first layer was not prefetched before the embedding"
    early = sum(embed > end for embed, end in zip(at_embedding[1:], at_end))
    assert early >= len(at_end) // 2, (at_embedding, at_end)


def test_predictor_follows_embeddings_prompts_other_batches_and_a_static_cache(tmp_path):
    """The predictor hook must never break generate: a prompt fed as embeddings (no ids to predict from), then a
    batch of another size continuing from there, and a static cache (whose prepared attention mask is 4-D)."""
    model = make_tiny("mixtral")
    inputs = batch("mixtral")
    embeds = {"inputs_embeds": model.get_input_embeddings()(inputs["input_ids"]).detach(),
              "attention_mask": inputs["attention_mask"]}
    three = {k: torch.cat([v, v[:1]]) for k, v in embeds.items()}
    static = dict(GEN, cache_implementation="static")
    runs = [(embeds, GEN), (three, GEN), (inputs, static), (inputs, GEN)]
    references = [model.generate(**given, **gen) for given, gen in runs]
    expertflow.wrap(model, cache_slots=8, policy="expertflow", predictor=random_predictor(model, tmp_path),
                    device="cpu")
    try:
        for (given, gen), reference in zip(runs, references):
            assert torch.equal(model.generate(**given, **gen), reference)
        assert expertflow.stats(model).predictor_s > 0
    finally:
        expertflow.unwrap(model)


def test_encoder_decoder_counts_every_decoder_pass_as_a_step():
    model = make_tiny("switch_transformers")
    inputs = batch("switch_transformers")  # 2 x 7 encoder tokens
    expertflow.wrap(model, cache_slots=3, policy="lru", device="cpu")
    try:
        model.generate(**inputs, max_new_tokens=6, min_new_tokens=6, do_sample=False)
        s = expertflow.stats(model)
        snapshot = s.copy()
        model.generate(**inputs, max_new_tokens=2, min_new_tokens=2, do_sample=False)
    finally:
        expertflow.unwrap(model)
    # the encoder's pass, then one decoder pass per generated token (the first comes from the start token)
    assert (snapshot.steps, snapshot.tokens) == (1 + 6, 2 * 7 + 6 * 2)
    assert len(snapshot.slots_per_layer) == snapshot.steps, "a snapshot must not follow the live counters"


def test_waves_let_a_request_give_up_its_own_experts_before_those_needed_next():
    """L = 2, E = 4, 3 slots, one token a step. Step 0: layer 0 needs {0}, layer 1 {0, 1}. Step 1: layer 0 needs
    {1, 2}, layer 1 {0, 1} again, all predicted with certainty. The second miss of step 1's layer-0 request finds only
    layer 1's experts evictable, both needed by the very next request; its own expert 1 is next needed in a later step
    at the earliest. Pinned, the request must evict one of layer 1's (6 loads); with `waves` it computes expert 1
    first and evicts it (5 loads)."""
    from expertflow.policy import make_policy

    experts = np.array([[[0, -1], [0, 1]], [[1, 2], [0, 1]]])
    trace = Trace(experts=experts, num_experts=4, token_ids=[1, 2])
    probs = np.zeros((2, 2, 4), dtype=np.float32)
    for token, layers in enumerate(experts):
        for layer, ids in enumerate(layers):
            probs[token, layer, ids[ids >= 0]] = 1.0
    loads = {}
    for waves, gap in ((False, 0.0), (True, 0.0), (True, 100.0)):
        policy = make_policy("expertflow", 3, 2, 4, waves=waves, wave_gap=gap)
        result = sim.simulate(trace, policy, 3, predictions=probs)
        assert result.hits + result.misses == result.needs == 7
        assert result.waves == (1 if waves and not gap else 0)  # step 1's layer-0 request split in two, or not
        loads[waves, gap] = result.loads
    # a `wave_gap` longer than any wait: no expert of the request is expected later by that much, so no wave
    assert loads == {(False, 0.0): 6, (True, 0.0): 5, (True, 100.0): 6}


def test_with_waves_a_demand_miss_may_wave_but_a_prefetch_takes_its_victim():
    """L = 2, E = 4, 3 slots. Layer 0's request needs {0, 1, 2} and holds 0 and 1; the only evictable resident is
    layer 1's expert 3, which the next-token head says the next step needs, while 0 and 1 it says no step needs. The
    demand miss of expert 2 answers WAVE (its own experts are the better victims); a prefetch of layer 1's expert 2
    is not the running request's and must never get WAVE (the serving loop would drop it): it takes expert 3."""
    from expertflow.policy import WAVE
    from expertflow.policy.expertflow import ExpertFlowPolicy

    policy = ExpertFlowPolicy(3, 2, 4, waves=True, margin=0.0)
    probs = np.zeros((1, 2, 4))
    probs[0, 0, [0, 1, 2]] = probs[0, 1, 2] = 1.0
    after = np.zeros((1, 2, 2, 4))
    after[0, :, 1, 3] = 1.0  # layer 1's expert 3 in each of the next two steps; layer 0's experts in neither
    policy.on_step(0, probs, after)
    for key in ((0, 0), (0, 1), (1, 3)):
        policy.on_insert(key)
    policy.on_route(0, 0, [[0, 1], [2, -1]])
    policy.on_request(0, 0, [0, 1, 2])
    for e in (0, 1, 2):
        policy.on_access((0, e))
    # the serving loop's `evictable` for this state (the request's own experts pinned), written out by hand
    only_three = lambda key: key == (1, 3)  # noqa: E731
    assert policy.victim((0, 2), only_three, 0) is WAVE
    assert policy.prefetches(0, 1) == [(1, 2)]
    assert policy.victim((1, 2), only_three, 0) == (1, 3)


def _deferring_state(defer: bool, wave_gap: float = 0.0, holds_one: bool = True, one_chance: float = 1.0):
    """L = 2, E = 4, 3 slots holding layer 0's expert 0 and layer 1's experts 1 (unless not `holds_one`) and 3. This
    step layer 0 needs {0} and layer 1 {1, 2} (expert 1 predicted with `one_chance`); the next-token head says the
    next two steps need layer 0's 0 and layer 1's 3, never layer 1's 1 or 2, nor layer 0's 2 in the step after next.
    Returned after layer 0's request has started, with layer 1's prefetch of expert 2 offered."""
    from expertflow.policy.expertflow import ExpertFlowPolicy

    probs = np.zeros((1, 2, 4))
    probs[0, 0, 0] = probs[0, 1, 2] = 1.0
    probs[0, 1, 1] = one_chance
    after = np.zeros((1, 2, 2, 4))
    after[0, :, 0, 0] = after[0, :, 1, 3] = 1.0
    policy = ExpertFlowPolicy(3, 2, 4, waves=True, margin=0.0, refine=0.0, defer_to_waves=defer, wave_gap=wave_gap)
    policy.on_step(0, probs, after)
    for key in ((0, 0), (1, 1), (1, 3)) if holds_one else ((0, 0), (1, 3)):
        policy.on_insert(key)
    policy.on_route(0, 0, [[0, -1]])
    policy.on_request(0, 0, [0])
    policy.on_access((0, 0))
    assert (1, 2) in policy.prefetches(0, 1)
    return policy


def test_deferring_to_waves_keeps_a_prefetch_from_a_victim_needed_before_what_the_wave_frees():
    """The prefetch of layer 1's expert 2 finds its best victim in expert 3 (next needed three requests on), which a
    margin of 0 allows. Expert 1, which layer 1's request holds and then no step needs, is the better one: with
    `defer_to_waves` the prefetch is dropped, and the demand miss answers WAVE, so the request computes 1 and loads 2
    into its slot."""
    from expertflow.policy import WAVE

    held = {(0, 0), (1, 1), (1, 3)}
    decisions = {}
    for defer in (False, True):
        policy = _deferring_state(defer)
        prefetch_victim = policy.victim((1, 2), held.__contains__, 0)
        policy.on_route(0, 1, [[1, 2]])
        policy.on_request(0, 1, [1, 2])
        policy.on_access((1, 1))
        demand_victim = policy.victim((1, 2), {(0, 0), (1, 3)}.__contains__, 0)  # 1 is pinned
        decisions[defer] = (prefetch_victim, demand_victim)
    assert decisions == {False: ((1, 3), WAVE), True: (None, WAVE)}
    # no deferring when expert 3 is within `wave_gap` of expert 1 (a wave would not split), when expert 1 is not
    # resident (no wave could free it) or the request is not predicted to need it (d below θ = 0.6)
    assert _deferring_state(True, wave_gap=100.0).victim((1, 2), held.__contains__, 0) == (1, 3)
    assert _deferring_state(True, holds_one=False).victim((1, 2), {(0, 0), (1, 3)}.__contains__, 0) == (1, 3)
    assert _deferring_state(True, one_chance=0.5).victim((1, 2), held.__contains__, 0) is not None
    hot = _deferring_state(True)  # nor when expert 1 is in the hot set, which a wave does not evict either
    hot.hot[1, 1] = True
    assert hot.victim((1, 2), held.__contains__, 0) == (1, 3)


def test_deferring_to_waves_leaves_the_next_steps_first_layer_to_the_margin():
    """After the step's last layer, layer 0's expert 2 is prefetched for the next step on the head's guess. Layer 0's
    expert 0, which no later step needs, is the victim: the layer that is predicted to need it has already run, so no
    wave of this step can free it and deferring must not apply (it would compare expert 0 with itself)."""
    policy = _deferring_state(True)
    policy.next_demand[0, 0, 2], policy.next_demand[:, 0, 0] = 1.0, 0.0
    policy._wait = None
    policy.on_route(0, 1, [[1, 2]])
    policy.on_request(0, 1, [1, 2])
    assert policy.prefetches(1, 0) == [(0, 2)]
    assert policy.victim((0, 2), {(0, 0)}.__contains__, 0) == (0, 0)


def test_on_demand_target_steers_the_margin_by_the_share_of_needs_loaded_on_demand():
    """Each request's share of experts that are not resident enters a running average (each need weighing 1%); the
    margin moves by 0.2 request per need times (target − average), within [0, wait_cap steps of requests]."""
    from expertflow.policy.expertflow import ExpertFlowPolicy

    policy = ExpertFlowPolicy(4, 2, 4, margin=4.0, wait_cap=3, on_demand_target=0.1)
    assert policy.margin_cap == 6.0
    for key in ((0, 0), (0, 1), (1, 0)):
        policy.on_insert(key)
    policy.on_request(0, 0, [0, 1])  # both resident: none on demand
    weight = 1 - 0.99 ** 2
    share = 0.1 + weight * (0.0 - 0.1)
    assert policy.on_demand_share == pytest.approx(share)
    assert policy.margin == pytest.approx(4.0 + 0.2 * 2 * (0.1 - share))
    policy.on_request(0, 1, [0, 2, 3])  # two of three on demand: above the target, the margin falls
    share += (1 - 0.99 ** 3) * (2 / 3 - share)
    assert policy.on_demand_share == pytest.approx(share)
    assert policy.margin < 4.0
    for _ in range(300):
        policy.on_request(1, 1, [2, 3])
    assert policy.margin == 0.0 and policy.on_demand_share > 0.9
    for _ in range(3000):
        policy.on_request(2, 0, [0, 1])
    assert policy.margin == 6.0 and policy.on_demand_share < 0.01
    fixed = ExpertFlowPolicy(4, 2, 4, margin=4.0)  # without a target the margin stays as given
    fixed.on_request(0, 0, [0, 1])
    assert fixed.margin == 4.0 and fixed.on_demand_share is None
    assert ExpertFlowPolicy(4, 2, 4, margin=50.0, wait_cap=None, on_demand_target=0.1).margin == 32.0  # 16 steps


def test_a_larger_on_demand_target_puts_more_needs_on_demand_in_the_simulator():
    """The steering works through `victim`: a smaller target keeps the margin small (more prefetches, fewer loads on
    demand), a larger one lets it grow."""
    from expertflow.policy.expertflow import ExpertFlowPolicy

    trace = _random_trace(3, tokens=400)
    probs = np.zeros((trace.num_tokens, trace.num_layers, trace.num_experts))
    for t, l, j in np.ndindex(trace.experts.shape):
        probs[t, l, trace.experts[t, l, j]] = 0.9
    timing = sim.Timing(transfer_ms=10.0, layer_ms=2.0)
    shares, margins = [], []
    for target in (0.02, 0.6):
        policy = ExpertFlowPolicy(10, trace.num_layers, trace.num_experts, waves=True, on_demand_target=target)
        run = sim.simulate(trace, policy, 10, timing, predictions=probs)
        shares.append(run.on_demand_loads / run.needs)
        margins.append(policy.margin)
    assert shares[0] < shares[1]
    assert margins[0] < margins[1]


def test_policy_options_are_checked_and_a_refused_one_leaves_the_model_as_it_was(tmp_path):
    from expertflow.config import Config

    with pytest.raises(ValueError, match="policy_options: 'waves' is not an option of policy 'lru'; its options are "
                                         "none"):
        Config(policy="lru", policy_options={"waves": True})
    with pytest.raises(ValueError, match="'wave' is not an option of policy 'expertflow'; its options are theta, "):
        Config(policy="expertflow", policy_options={"wave": True})
    with pytest.raises(ValueError, match="must be a dict of option names to values"):
        Config(policy="expertflow", policy_options=[("waves", True)])
    for options, message in (({"waves": "no"}, "waves='no' must be True or False"),
                             ({"hot_fraction": "0.3"}, "hot_fraction='0.3' must be a finite number"),
                             ({"horizon": 0}, "horizon=0 must be a number of layers of at least 1"),
                             ({"wave_gap": -1.0}, "wave_gap=-1.0 must be a number of requests of at least 0"),
                             ({"wave_gap": 2.0}, "wave_gap=2.0 only applies when serving in waves: add waves=True"),
                             ({"defer_to_waves": True}, "defer_to_waves=True only applies when serving in waves"),
                             ({"waves": True, "defer_to_waves": 1}, "defer_to_waves=1 must be True or False"),
                             ({"on_demand_target": 0.0}, "on_demand_target=0.0 must be a share of needs between 0 "
                                                         "and 1"),
                             ({"on_demand_target": 8}, "on_demand_target=8 must be a share of needs between 0 and 1"),
                             ({"on_demand_target": 1.0}, "on_demand_target=1.0 must be a share of needs"),
                             ({"on_demand_target": -0.1}, "on_demand_target=-0.1 must be a share of needs"),
                             ({"on_demand_target": float("nan")}, "on_demand_target=nan must be a share of needs"),
                             ({"on_demand_target": True}, "on_demand_target=True must be a share of needs"),
                             ({"on_demand_target": "0.1"}, "on_demand_target='0.1' must be a share of needs"),
                             ({"ema": 2.0}, r"ema=2.0 is a weight or share: give a number from 0 to 1"),
                             ({"refine": -0.1}, r"refine=-0.1 is a weight or share"),
                             ({"hot_fraction": 3}, r"hot_fraction=3 is a weight or share"),
                             ({"theta": -0.5}, r"theta=-0.5 must be a probability threshold \(above 1: no "
                                               r"prefetches for this step's layers; `speculate` governs the next "
                                               r"step's\) of at least 0"),
                             ({"margin": -1}, "margin=-1 must be a number of requests of at least 0"),
                             ({"wait_cap": 2.5}, "wait_cap=2.5 must be a number of steps from 1 to 10,000"),
                             ({"wait_cap": True}, "wait_cap=True must be a number of steps"),
                             ({"wait_cap": "16"}, "wait_cap='16' must be a number of steps"),
                             ({"horizon": np.float64(2.0)}, "horizon=.* must be a number of layers")):
        with pytest.raises(ValueError, match=message):
            make_policy("expertflow", 4, 2, 4, **options)
    numpy_numbers = make_policy("expertflow", 4, 2, 4, theta=np.float32(0.5), horizon=np.int64(2),
                                wait_cap=np.int64(8), on_demand_target=np.float64(0.1))
    assert (numpy_numbers.horizon, numpy_numbers.wait_cap) == (2, 8) and type(numpy_numbers.wait_cap) is int
    model = make_tiny("mixtral")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="wait_cap=0 must be a number of steps from 1 to 10,000"):
        expertflow.wrap(model, cache_slots=4, policy="expertflow", predictor=random_predictor(model, tmp_path),
                        device="cpu", policy_options={"wait_cap": 0})
    assert not hasattr(model, "_expertflow_runtime")
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
