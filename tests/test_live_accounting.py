"""Live accounting checked against scripted scenarios: a prefetch whose copy has landed is a hit, a prefetched expert
counts as used once however often it is used, a policy's cancellations stop queued copies, the next wave's first copy
is issued before the first wave computes, a live run whose copies land at once counts as the simulator does, the
predictor's output reaches the policy for the right layers and real tokens only, and the derived ratios of `Stats`
by hand."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest
import torch

import expertflow
from expertflow import runtime, sim
from expertflow.counters import Stats
from expertflow.policy import register_policy
from expertflow.policy.expertflow import ExpertFlowPolicy
from expertflow.policy.lru import LRUPolicy
from expertflow.predictor import load_predictor
from expertflow.transfer import LOW, CpuTransferEngine, Gate
from families import batch, make_tiny, random_predictor, record_wrapped
from test_faults import N, _cache, _interrupt_first_wait, _read

PROMPTS = ["The quick brown fox", "def add(a, b):\n    return"]


def _recorded(cache) -> list:
    """Every copy the cache submits from now on, in order (their tickets)."""
    tickets, submit = [], cache.engine.submit

    def recording(*args, **kwargs):
        tickets.append(submit(*args, **kwargs))
        return tickets[-1]

    cache.engine.submit = recording
    return tickets


def test_a_prefetch_whose_copy_has_landed_is_a_hit():
    cache = _cache(4)
    tickets = _recorded(cache)
    try:
        assert cache.prefetch([(1, 0), (1, 2)]) == 2
        for ticket in tickets:
            ticket.wait()
        assert _read(cache, 0, 1, [0, 2]) == {0: (100.0, 100.0), 2: (102.0, 102.0)}
        s = cache.stats
        assert (s.needs, s.hits, s.misses, s.prefetch_hits, s.loads) == (2, 2, 0, 2, 2)
    finally:
        cache.engine.close()


def test_a_prefetched_expert_counts_as_used_once_however_often_it_is_used():
    cache = _cache(2)
    tickets = _recorded(cache)
    try:
        assert cache.prefetch([(1, 0)]) == 1
        tickets[0].wait()
        _read(cache, 0, 1, [0])  # uses the prefetch: a hit
        _read(cache, 1, 1, [0])  # uses it again: a hit, not a second prefetch hit
        _read(cache, 2, 0, [0, 1])  # (0, 0) takes the free slot, (0, 1) evicts the used (1, 0): not wasted
        s = cache.stats
        assert (s.prefetches, s.prefetch_hits, s.wasted_prefetches) == (1, 1, 0)
        assert (s.needs, s.hits, s.loads, s.on_demand_loads, s.evictions) == (4, 2, 3, 2, 1)
        assert (s.prefetch_precision, s.on_demand_rate, s.async_load_fraction) == (1.0, 0.5, 1 / 3)
    finally:
        cache.engine.close()


def _failing_prefetch(cache, key) -> None:
    """Prefetch `key` from a source of the wrong size: its copy fails on the copy thread."""
    good = cache.store.expert_bytes
    cache.store.expert_bytes = lambda layer, expert: torch.zeros(3, dtype=torch.uint8)
    try:
        assert cache.prefetch([key]) == 1
    finally:
        cache.store.expert_bytes = good


def test_a_prefetch_whose_copy_failed_is_no_hit_moves_no_bytes_and_is_logged(caplog):
    cache = _cache(4)
    tickets = _recorded(cache)
    try:
        _failing_prefetch(cache, (1, 0))
        with pytest.raises(RuntimeError, match=r"copy of \(1, 0\) failed"):
            tickets[0].wait()
        with caplog.at_level("WARNING", logger="expertflow.cache"):
            assert _read(cache, 0, 1, [0]) == {0: (100.0, 100.0)}  # loaded again on demand
        s, slot_bytes = cache.stats, cache.store.slot_bytes
        assert (s.prefetches, s.prefetch_hits, s.wasted_prefetches, s.misses, s.on_demand_loads) == (1, 0, 0, 1, 1)
        assert s.bytes_to_device == cache.engine.bytes_copied == slot_bytes
        assert "the prefetch of expert (1, 0) failed" in caplog.text
    finally:
        cache.engine.close()


def test_a_prefetch_whose_copy_fails_while_a_layer_waits_for_it_is_no_hit():
    cache = _cache(4)
    gate = Gate()
    try:  # a held copy at the head of the prefetch queue keeps the prefetch queued until the layer promotes it
        cache.engine.submit(torch.zeros(1, dtype=torch.uint8), torch.zeros(1, dtype=torch.uint8), LOW, gate=gate)
        _failing_prefetch(cache, (1, 0))
        with pytest.raises(RuntimeError, match=r"copy of \(1, 0\) failed"):
            _read(cache, 0, 1, [0])
        assert cache.stats.prefetch_hits == 0
        assert _read(cache, 1, 1, [0]) == {0: (100.0, 100.0)}
        s = cache.stats
        assert (s.prefetches, s.prefetch_hits, s.wasted_prefetches, s.on_demand_loads) == (1, 0, 0, 1)
        assert s.bytes_to_device == cache.store.slot_bytes
    finally:
        cache.engine.open_gate(gate)
        cache.engine.close()


def test_demand_loads_left_queued_by_an_interrupted_request_are_no_cancelled_prefetches():
    cache = _cache(4, bytes_per_s=N * 4 / 0.2)  # one copy takes 200 ms
    engine = cache.engine
    wait = _interrupt_first_wait(engine)  # Ctrl-C while the layer waits for its first expert
    try:
        with pytest.raises(KeyboardInterrupt):
            _read(cache, 0, 0, [0, 1, 2, 3])  # (0, 1) .. (0, 3) stay queued
        engine.wait = wait
        assert _read(cache, 1, 1, [0, 1, 2, 3]) == {e: (100.0 + e, 100.0 + e) for e in range(4)}  # evicts them
        s = cache.stats
        assert (s.prefetches, s.cancelled_prefetches, s.wasted_prefetches, s.on_demand_loads) == (0, 0, 0, 8)
        assert s.bytes_to_device == engine.bytes_copied, "the cancelled loads' bytes were counted as moved"
    finally:
        engine.close()


def test_wasted_prefetch_bytes_count_only_prefetches_that_were_copied():
    cache = _cache(4, bytes_per_s=N * 4 / 0.2)  # one copy takes 200 ms
    tickets = _recorded(cache)
    try:
        assert cache.prefetch([(1, 0), (1, 1)]) == 2
        deadline = time.monotonic() + 5
        while tickets[0].state == "queued" and time.monotonic() < deadline:
            time.sleep(0.001)
        # (1, 0) is copying (a started copy runs to the end) and (1, 1) still queued: both wasted, one slot copied
        cache.cancel([(1, 0), (1, 1)])
        tickets[0].wait()
        s, slot_bytes = cache.stats, cache.store.slot_bytes
        assert (s.prefetches, s.wasted_prefetches, s.cancelled_prefetches) == (2, 2, 1)
        assert s.wasted_prefetch_bytes == s.bytes_to_device == cache.engine.bytes_copied == slot_bytes
    finally:
        cache.engine.close()


def test_derived_ratios_by_hand():
    s = Stats(needs=20, hits=12, misses=8, loads=10, on_demand_loads=6, prefetches=4, prefetch_hits=3)
    expected = {"hit_rate": 0.6, "on_demand_rate": 0.3, "prefetch_precision": 0.75, "async_load_fraction": 0.4}
    assert {name: getattr(s, name) for name in expected} == expected
    assert {name: s.as_dict()[name] for name in expected} == expected
    assert all(getattr(Stats(), name) == 0.0 for name in expected), "nothing counted: ratios of 0, no division"


def test_the_next_waves_first_copy_is_issued_before_the_first_wave_computes():
    # One layer, 2 slots, a cold cache; the request needs 0..3. Wave 1 loads 0 and 1; once they are in place, 2 takes
    # the slot of 0 (the LRU victim) with its copy held until 0 has computed; so 0 computes first and alone.
    cache = _cache(2, layers=1)
    tickets = _recorded(cache)
    parts, at_first = [], None
    try:
        for part in cache.request(0, 0, [0, 1, 2, 3]):
            parts.append({expert: (float(views["w"].min()), float(views["w"].max())) for expert, views in part})
            if at_first is None:
                at_first = [(ticket.tag, ticket.state) for ticket in tickets]
        s = cache.stats
    finally:
        cache.engine.close()
    assert at_first == [((0, 0), "done"), ((0, 1), "done"), ((0, 2), "queued")]
    assert parts == [{0: (0.0, 0.0)}, {1: (1.0, 1.0)}, {2: (2.0, 2.0), 3: (3.0, 3.0)}]
    assert (s.misses, s.on_demand_loads, s.evictions, s.waves) == (4, 4, 2, 1)


def test_a_policy_cancellation_stops_a_queued_prefetch_live(registry):
    """Mixtral tiny (2 MoE layers x 8 experts, top-2), one token, all 16 experts fit. The policy prefetches all 8
    experts of layer 1 while layer 0 runs, then cancels the 6 that layer 1's router did not choose. A held copy at the
    head of the prefetch queue keeps the prefetches queued until then, so the 6 are cancelled before they copy."""

    @register_policy
    class CancelsUnrouted(LRUPolicy):
        name = "cancels-unrouted"

        def __init__(self, *args) -> None:
            super().__init__(*args)
            self.offered, self.unwanted = [], []

        def prefetches(self, step, layer):
            if (step, layer) != (0, 1):
                return []
            self.offered = [(1, e) for e in range(self.num_experts)]
            return self.offered

        def on_route(self, step, layer, routes):
            if layer == 1:
                chosen = {e for route in routes for e in route}
                self.unwanted = [key for key in self.offered if key[1] not in chosen]

        def cancellations(self):
            unwanted, self.unwanted = self.unwanted, []
            return unwanted

    model = make_tiny("mixtral")
    ids = torch.tensor([[5]])
    with torch.no_grad():
        reference = model(input_ids=ids).logits
    expertflow.wrap(model, cache_slots=16, policy="cancels-unrouted", device="cpu")
    cache, gate = runtime.runtime_of(model).cache, Gate()
    try:
        held = cache.engine.submit(torch.zeros(1, dtype=torch.uint8), torch.zeros(1, dtype=torch.uint8), LOW,
                                   gate=gate)
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        residents = len(cache.table.residents())
        cache.engine.open_gate(gate)
        held.wait()
        copied, slot_bytes = cache.engine.bytes_copied, cache.store.slot_bytes
        s = expertflow.stats(model).copy()
    finally:
        cache.engine.open_gate(gate)
        expertflow.unwrap(model)
    assert torch.equal(logits, reference)
    assert (s.prefetches, s.cancelled_prefetches, s.wasted_prefetches, s.prefetch_hits) == (8, 6, 6, 2)
    assert (s.loads, s.on_demand_loads, s.evictions) == (10, 2, 6)
    assert residents == 4, "2 experts per layer stay; the cancelled ones leave their slots"
    assert s.bytes_to_device == 4 * slot_bytes
    assert copied == 4 * slot_bytes + 1, "a cancelled prefetch moved its bytes"


class _Landing(CpuTransferEngine):
    """A link without latency, as the cache sees it: asked whether a copy has finished, it waits for the copy first
    (unless a shut gate holds it)."""

    def is_done(self, ticket) -> bool:
        if ticket.gate is None or ticket.gate.opened:
            ticket.done_event.wait()
        return super().is_done(ticket)


def test_live_prefetch_counts_equal_the_simulator_when_copies_land_at_once(monkeypatch):
    """Every copy issued before a request has landed when the request starts, as in the simulator's counting mode:
    the live counts equal the simulated ones on the recorded routing."""
    from transformers import AutoTokenizer

    from expertflow.models import tiny_moe

    model = tiny_moe(dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model.name_or_path)
    monkeypatch.setattr(runtime, "make_engine", lambda device, bytes_per_s=None: _Landing(bytes_per_s))
    trace, live = record_wrapped(model, PROMPTS, tokenizer, dict(cache_slots=64, policy="lookahead", device="cpu"),
                                 batch_size=1, max_new_tokens=6)
    simulated = sim.simulate(trace, "lookahead", 64)
    assert live.prefetch_hits > 20 and live.needs > 100
    counted = ("needs", "hits", "loads", "prefetches", "prefetch_hits", "wasted_prefetches")
    assert {name: getattr(live, name) for name in counted} == {name: getattr(simulated, name) for name in counted}
    assert live.prefetch_hits + live.wasted_prefetches <= live.prefetches


@pytest.mark.parametrize("slots", [64, 8])
def test_the_expertflow_policy_counts_alike_live_and_simulated_when_copies_land_at_once(monkeypatch, slots):
    """The simulator replays the predictions the live policy was given: the same requests, hits, prefetches, waves
    and wasted prefetches, apart from prefetches issued after the last layer of the last step (live, for a next step
    that never comes; the simulator has no request there). 8 slots: waves and evictions of predicted experts."""
    from transformers import AutoTokenizer

    from expertflow.models import tiny_moe

    model = tiny_moe(dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model.name_or_path)
    monkeypatch.setattr(runtime, "make_engine", lambda device, bytes_per_s=None: _Landing(bytes_per_s))
    given = {}
    step_of = runtime.OffloadRuntime.plan_step

    def plan_step(self, probs, next_probs=None):  # the predictions the live policy gets, by step
        given[self.step + 1] = (np.array(probs), None if next_probs is None else np.array(next_probs))
        return step_of(self, probs, next_probs)

    monkeypatch.setattr(runtime.OffloadRuntime, "plan_step", plan_step)
    trace, live = record_wrapped(model, PROMPTS, tokenizer, dict(cache_slots=slots, policy="expertflow", device="cpu"),
                                 batch_size=1, max_new_tokens=8)
    simulated = sim.simulate(trace, "expertflow", slots, predictions=given)
    counted = ("needs", "hits", "prefetch_hits", "wasted_prefetches", "on_demand_loads", "waves")
    assert {name: getattr(live, name) for name in counted} == {name: getattr(simulated, name) for name in counted}
    tail = live.prefetches - simulated.prefetches
    assert live.loads - simulated.loads == tail and 0 <= tail <= model.config.num_local_experts
    assert live.prefetch_hits > 100 and live.cancelled_prefetches == 0
    assert live.waves > 0 or slots == 64


def test_a_plugin_prefetching_for_the_first_request_counts_alike_live_and_simulated(monkeypatch, registry):
    """The simulator asks for prefetches before its first request; live, without a predictor, the first step's first
    layer is asked for when that step starts (later ones after the step before's last layer)."""
    from transformers import AutoTokenizer

    from expertflow.models import tiny_moe

    @register_policy
    class UpcomingFirstFour(LRUPolicy):
        name = "upcoming-first-four-test"

        def prefetches(self, step, layer):
            return [(layer, e) for e in range(4)]

        def victim(self, key, evictable, free_slots):
            return None if free_slots else self._oldest(evictable)

    model = tiny_moe(dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model.name_or_path)
    monkeypatch.setattr(runtime, "make_engine", lambda device, bytes_per_s=None: _Landing(bytes_per_s))
    trace, live = record_wrapped(model, PROMPTS[:1], tokenizer,
                                 dict(cache_slots=96, policy=UpcomingFirstFour.name, device="cpu"),
                                 batch_size=1, max_new_tokens=3)
    simulated = sim.simulate(trace, UpcomingFirstFour.name, 96)
    counted = ("needs", "hits", "loads", "prefetches", "prefetch_hits", "wasted_prefetches")
    assert {name: getattr(live, name) for name in counted} == {name: getattr(simulated, name) for name in counted}
    assert live.prefetch_hits >= 4  # layer 0's first four, issued before the first step's first layer


def test_live_prefetches_are_used_or_wasted_at_most_once():
    from transformers import AutoTokenizer

    from expertflow.models import tiny_moe

    model = tiny_moe(dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model.name_or_path)
    tokenizer.padding_side = "left"
    inputs = dict(tokenizer(PROMPTS, return_tensors="pt", padding=True))
    expertflow.wrap(model, cache_slots=48, policy="expertflow", device="cpu")
    try:
        model.generate(**inputs, max_new_tokens=8, min_new_tokens=8, do_sample=False)
        s = expertflow.stats(model).copy()
    finally:
        expertflow.unwrap(model)
    assert s.prefetches > 0 and s.prefetch_hits > 0
    assert s.prefetch_hits + s.wasted_prefetches <= s.prefetches
    assert s.cancelled_prefetches <= s.wasted_prefetches and s.loads == s.on_demand_loads + s.prefetches
    assert 0.0 < s.prefetch_precision <= 1.0


def test_the_policy_gets_the_predictors_output_per_layer_for_real_tokens_only(registry, tmp_path):
    @register_policy
    class Recording(ExpertFlowPolicy):
        name = "expertflow-recording"

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.seen = []

        def on_step(self, step, probs, next_probs=None) -> None:
            self.seen.append(np.array(probs, copy=True))
            super().on_step(step, probs, next_probs)

    model = make_tiny("mixtral")
    inputs = batch("mixtral")  # 2 x 7 ids, the first row with 3 left pads: 11 real tokens
    path = random_predictor(model, tmp_path)
    expertflow.wrap(model, cache_slots=8, policy="expertflow-recording", predictor=path, device="cpu")
    try:
        out = model.generate(**inputs, max_new_tokens=3, min_new_tokens=3, do_sample=False)
        seen = runtime.runtime_of(model).cache.policy.seen
    finally:
        expertflow.unwrap(model)
    predictor = load_predictor(path)
    # The prompt step: each sequence's real tokens predicted alone, without padding, in batch order.
    alone = [predictor.new_session().prefill(ids[mask.bool()][None])[0]
             for ids, mask in zip(inputs["input_ids"], inputs["attention_mask"])]
    prompt = torch.cat(alone).float().numpy()  # [11, L, E]
    assert len(seen) == 3 and seen[0].shape == prompt.shape == (11, 2, 8)
    for layer in range(2):
        np.testing.assert_allclose(seen[0][:, layer], prompt[:, layer], rtol=0, atol=1e-5, err_msg=f"layer {layer}")
    # The decode steps: the batch's session fed each generated token.
    session = predictor.new_session()
    session.prefill(inputs["input_ids"], inputs["attention_mask"])
    for step, column in ((1, 7), (2, 8)):
        expected = session.decode(out[:, column:column + 1]).float().numpy()[:, 0]  # [2, L, E]
        assert seen[step].shape == expected.shape == (2, 2, 8)
        np.testing.assert_allclose(seen[step], expected, rtol=0, atol=1e-5, err_msg=f"step {step}")


def test_a_failed_prefetch_evicted_before_anyone_polls_it_is_not_wasted_and_moves_no_bytes(caplog):
    from expertflow.policy.lru import LRUPolicy

    class InsertLRU(LRUPolicy):  # plain lru never evicts an expert nobody accessed
        name = "insert-lru"

        def on_insert(self, key):
            self.on_access(key)

    cache = _cache(1, policy=InsertLRU(1, 2, 4))  # one slot: the next load evicts the failed prefetch
    tickets = _recorded(cache)
    try:
        _failing_prefetch(cache, (1, 0))
        with pytest.raises(RuntimeError):
            tickets[0].wait()
        with caplog.at_level("WARNING", logger="expertflow.cache"):
            assert _read(cache, 0, 0, [0]) == {0: (0.0, 0.0)}  # evicts (1, 0) whose copy failed
        s = cache.stats
        assert (s.prefetches, s.prefetch_hits, s.wasted_prefetches, s.wasted_prefetch_bytes) == (1, 0, 0, 0)
        assert s.bytes_to_device == cache.engine.bytes_copied
        assert "the prefetch of expert (1, 0) failed" in caplog.text
    finally:
        cache.engine.close()


def test_a_copy_issued_before_a_reset_that_fails_after_it_takes_no_bytes_off_the_new_count():
    cache = _cache(4)
    tickets = _recorded(cache)
    try:
        _failing_prefetch(cache, (1, 0))
        with pytest.raises(RuntimeError):
            tickets[0].wait()
        cache.stats.reset()
        assert _read(cache, 0, 1, [0]) == {0: (100.0, 100.0)}
        assert cache.stats.bytes_to_device == cache.store.slot_bytes  # only the demand load after the reset
    finally:
        cache.engine.close()


def test_failed_prefetches_warn_once_then_log_at_debug(caplog):
    cache = _cache(4)
    tickets = _recorded(cache)
    try:
        _failing_prefetch(cache, (1, 0))
        _failing_prefetch(cache, (1, 1))
        for t in tickets:
            with pytest.raises(RuntimeError):
                t.wait()
        with caplog.at_level("WARNING", logger="expertflow.cache"):
            _read(cache, 0, 1, [0, 1])
        assert sum("failed" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING) == 1
    finally:
        cache.engine.close()


def test_cancelling_a_prefetch_whose_copy_has_landed_keeps_it():
    cache = _cache(4)
    tickets = _recorded(cache)
    try:
        assert cache.prefetch([(1, 0)]) == 1
        tickets[0].wait()
        cache.cancel([(1, 0)])  # "if their copy has not finished": it has
        assert _read(cache, 0, 1, [0]) == {0: (100.0, 100.0)}
        s = cache.stats
        assert (s.hits, s.prefetch_hits, s.wasted_prefetches, s.evictions, s.loads) == (1, 1, 0, 0, 1)
    finally:
        cache.engine.close()


def test_a_layer_waiting_for_a_slow_copy_counts_the_stall():
    cache = _cache(4, bytes_per_s=N * 4 / 0.1)  # 100 ms a copy
    try:
        _read(cache, 0, 0, [0])
        assert cache.stats.stall_s >= 0.05
    finally:
        cache.engine.close()


@pytest.mark.parametrize("policy", ["lru", "lru-layer"])
def test_a_prefetched_expert_not_needed_yet_can_be_evicted_by_the_recency_policies(policy):
    """An expert that entered by a prefetch and was not needed since is in the recency order too (as most recent):
    with one slot, a demand load must be able to take its place (a plug-in building on `lru` may prefetch)."""
    from expertflow.policy import make_policy

    cache = _cache(1, policy=make_policy(policy, 1, 2, 4))
    try:
        assert cache.prefetch([(1, 0)]) == 1
        assert _read(cache, 0, 0, [0]) == {0: (0.0, 0.0)}
        assert (cache.stats.evictions, cache.stats.wasted_prefetches) == (1, 1)
    finally:
        cache.engine.close()
