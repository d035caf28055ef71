"""The benchmarks behind the documented bounds and the what-would-be-needed figures: benchmarks/ece_frontier.py's
targets, rows (sweep_config) and summary; perfect_predictions.py's figures, sources, profiles and summary;
head_recall_needed.py's recall fields, summary and refusal of a trace without decode tokens; late_next_guess.py's
summary, route-mismatch limit, "all tokens" late truth and refusal of a recording without decode tokens; and
eviction_horizon.py's KnownSteps, flag checks and report. Traces are made by hand (for late_next_guess.py's states, a
few tokens recorded from the built-in model) and, where a figure decides a target, a stand-in for
expertflow.sim.simulate gives results just off the targets' bounds."""

from __future__ import annotations

import dataclasses
import json
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from test_benchmark_targets import _head_recall_run, _imported, _two_sequences

NEEDS = 100_000
# (ms per token, hits) of each baseline: lru-layer is the fastest, lfu has the most hits
BASELINE_RESULTS = {"lru": (10.0, 30_000), "lru-layer": (9.0, 25_000), "lfu": (12.0, 40_000),
                    "lookahead": (11.0, 20_000), "prev-step": (13.0, 10_000)}
BELADY_LOADS = 500
# the policy's results, by its margin: just off two bounds once rounded to 4 places / exactly at every bound /
# two targets met of three
OURS = {0.0: dict(ms=9.0 * 0.75 + 4.5e-6, hits=40_000 + 15_000 - 4, on_demand=10_000),
        8.0: dict(ms=6.75, hits=55_000, on_demand=10_000),
        16.0: dict(ms=6.0, hits=50_000, on_demand=9_000)}


def _result(ms, hits, on_demand=0, loads=1000):
    return SimpleNamespace(modeled_ms_per_token=ms, hit_rate=hits / NEEDS, hits=hits, needs=NEEDS, loads=loads,
                           on_demand_loads=on_demand, prefetches=loads - on_demand, waves=0)


class _Made:
    def __init__(self, options):
        self.options = options


def _stand_in(monkeypatch, module):
    """Replace expertflow.sim.simulate and `module.make_policy`; returns the (options, predictions) of each policy
    replay."""
    from expertflow import sim

    replays = []

    def make_policy(name, capacity, layers, experts, **options):
        assert name == "expertflow"
        return _Made(options)

    def simulate(workload, policy, capacity, timing=None, predictions=None):
        if policy == "belady":
            return SimpleNamespace(loads=BELADY_LOADS)
        if isinstance(policy, str):
            return _result(*BASELINE_RESULTS[policy])
        replays.append((policy.options, predictions))
        return _result(**OURS[policy.options.get("margin", 0.0)])

    monkeypatch.setattr(sim, "simulate", simulate)
    monkeypatch.setattr(module, "make_policy", make_policy)
    return replays


def _check_figures(row, margin, targets_met):
    assert (row["best_baseline_time"], row["best_baseline_ms_per_token"]) == ("lru-layer", 9.0)
    assert (row["best_baseline_hit_rate"], row["best_baseline_hits"]) == ("lfu", 40_000)
    ours = OURS[margin]
    assert row["time_vs_best_baseline"] == round(ours["ms"] / 9.0, 4)
    assert row["hit_rate_gain"] == round(ours["hits"] / NEEDS - 0.4, 4)
    assert row["on_demand_share_of_needs"] == round(ours["on_demand"] / NEEDS, 4)
    assert row["loads_vs_belady"] == round(1000 / BELADY_LOADS, 4)
    assert row["targets_met"] == targets_met, margin  # decided on the unrounded figures
    assert row["all_targets_met"] == (len(targets_met) == 3)


EXPECTED_MET = {0.0: ["on_demand_share_of_needs"],  # 0.7500005 > 0.75 and 0.14996 < 0.15, though both round onto them
                8.0: ["time_vs_best_baseline", "hit_rate_gain", "on_demand_share_of_needs"],  # inclusive bounds
                16.0: ["time_vs_best_baseline", "on_demand_share_of_needs"]}


@pytest.fixture
def frontier(monkeypatch):
    yield from _imported(monkeypatch, "ece_frontier")


@pytest.fixture
def perfect(monkeypatch):
    yield from _imported(monkeypatch, "perfect_predictions")


@pytest.fixture
def needed(monkeypatch):
    yield from _imported(monkeypatch, "head_recall_needed")


@pytest.fixture
def late(monkeypatch):
    yield from _imported(monkeypatch, "late_next_guess")


@pytest.fixture
def horizon(monkeypatch):
    yield from _imported(monkeypatch, "eviction_horizon")


def test_frontier_targets_time_bound_above_batch_1_and_on_demand_only_at_half_cached(frontier):
    for batch in (2, 4, 8, 32):
        assert frontier.targets(batch, 0.5)["time_vs_best_baseline"] == 0.75, batch
    for fraction in (0.75, 1.0, 0.25, 0.49):
        assert "on_demand_share_of_needs" not in frontier.targets(1, fraction), fraction


def test_frontier_rows_follow_from_the_policies_it_ran(frontier, monkeypatch, capsys):
    from expertflow import sim

    rng = np.random.default_rng(0)
    trace = _two_sequences(rng, tokens=8)
    predicted, head = rng.random((16, 2, 6)), rng.random((16, 2, 2, 6))
    timing = sim.Timing(transfer_ms=4.0, layer_ms=0.5, token_ms=0.05)
    workload = sim.Workload.from_trace(trace.rebatch(2))
    capacity = sim.capacity_from_fraction(0.5, 2, 6)
    bound = sim.lower_bound_ms_per_token(workload, capacity, timing, waves=True)
    replays = _stand_in(monkeypatch, frontier)
    rows = frontier.sweep_config(trace, (predicted, head), 2, 0.5, timing, (0.0, 8.0, 16.0), (0.08,))
    assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == json.loads(json.dumps(rows))
    settings = frontier.settings((0.0, 8.0, 16.0), (0.08,))
    assert [(r["profile"], r["policy_kwargs"]) for r in rows] == settings
    assert [options for options, _ in replays] == [options for _, options in settings], \
        "each setting reaches the policy"
    expected = sim.step_predictions(trace.rebatch(2), predicted, head)
    for _, given in replays:  # with the next-token head's guesses
        assert given.keys() == expected.keys()
        assert all(np.array_equal(given[s][0], expected[s][0]) and np.array_equal(given[s][1], expected[s][1])
                   for s in expected)
    for r in rows:
        assert r["lower_bound_waves_vs_best_baseline"] == round(bound / 9.0, 4)
        margin = r["policy_kwargs"].get("margin", 0.0)
        _check_figures(r, margin, EXPECTED_MET[margin])


def test_frontier_summary_names_the_fastest_the_largest_gain_and_those_meeting_all(frontier, monkeypatch, capsys):
    from expertflow import sim

    def row(kwargs, ms, hits, loads, everything):
        return {"batch": 1, "cache_fraction": 0.5, "policy_kwargs": kwargs, "modeled_ms_per_token": ms, "hits": hits,
                "loads": loads, "all_targets_met": everything, "lower_bound_waves_vs_best_baseline": 0.46}

    rows = [row({"margin": 0.0}, 5.0, 10, 90, False), row({"margin": 8.0}, 4.0, 30, 50, True),
            row({"margin": 16.0}, 6.0, 40, 40, False), row({"waves": True, "margin": 0.0}, 7.0, 20, 99, True)]
    trace = SimpleNamespace(num_tokens=3)
    monkeypatch.setattr(frontier, "prepare", lambda args, parser: (trace, None, sim.Timing(8.0, 1.0, 0.01)))
    monkeypatch.setattr(frontier, "sweep_config", lambda *args: rows)
    monkeypatch.setattr(sys, "argv", ["ece_frontier.py", "--batches", "1", "--fractions", "0.5"])
    frontier.main()
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])["summary"]["batch 1, 0.5 cached"]
    assert summary["fastest"] == {"margin": 8.0}
    assert summary["largest_gain"] == {"margin": 16.0}
    assert summary["all_met_by"] == [{"margin": 8.0}, {"waves": True, "margin": 0.0}]
    assert summary["lower_bound_waves_vs_best_baseline"] == 0.46


def test_perfect_predictions_figures_and_targets_from_unrounded_results(perfect, monkeypatch, capsys):
    from expertflow import sim

    rng = np.random.default_rng(1)
    trace = _two_sequences(rng, tokens=8)
    predicted, head = rng.random((16, 2, 6)), rng.random((16, 2, 2, 6))
    timing = sim.Timing(transfer_ms=4.0, layer_ms=0.5, token_ms=0.05)
    given = perfect.sources(trace, (predicted, head))
    replays = _stand_in(monkeypatch, perfect)
    base = perfect.baseline_config(trace, 2, 0.5, timing)
    profiles = {"a": {"margin": 0.0}, "b": {"margin": 8.0, "waves": True}, "c": {"margin": 16.0}}
    rows = perfect.policy_rows(trace, base, given, timing, profiles)
    capsys.readouterr()
    assert [(r["source"], r["profile"], r["policy_kwargs"]) for r in rows] == [
        (s, p, o) for s in perfect.SOURCES for p, o in profiles.items()]
    assert [options for options, _ in replays] == [o for _ in perfect.SOURCES for o in profiles.values()]
    for source, (options, steps) in zip([s for s in perfect.SOURCES for _ in profiles], replays):
        expected = sim.step_predictions(trace.rebatch(2), *given[source])  # each source's own predictions
        assert all(np.array_equal(steps[s][0], expected[s][0]) and np.array_equal(steps[s][1], expected[s][1])
                   for s in expected), source
    for r in rows:
        margin = r["policy_kwargs"]["margin"]
        _check_figures(r, margin, EXPECTED_MET[margin])
        assert r["belady_loads"] == BELADY_LOADS


def test_perfect_prediction_sources_leave_a_float32_head_as_it_was(perfect):
    """The shipped predictor's guesses are float32: `true next token` must copy them, not write into them."""
    from expertflow.trace import Trace

    rng = np.random.default_rng(0)
    routes = np.stack([rng.permutation(6)[:2] for _ in range(10 * 3)]).reshape(10, 3, 2).astype(np.int32)
    trace = Trace(experts=routes, num_experts=6, seq_ids=np.repeat([0, 1], 5), positions=np.tile(np.arange(5), 2))
    predicted = rng.random((10, 3, 6)).astype(np.float32)
    head = rng.random((10, 4, 3, 6)).astype(np.float32)
    kept = head.copy()
    got = perfect.sources(trace, (predicted, head))
    assert np.array_equal(head, kept) and np.array_equal(got["predicted"][1], kept)
    assert not np.array_equal(got["true next token"][1][:, 0], kept[:, 0])


def test_perfect_predictions_profiles_are_those_the_docs_name(perfect, late):
    expected = {"default": {}, "waves": {"waves": True, "wave_gap": 2.0},
                "tuned": {"waves": True, "wave_gap": 2.0, "margin": 8.0}}
    assert perfect.PROFILES == expected and late.SHOWN == expected


def test_perfect_predictions_summary_keys_every_source_and_profile(perfect, monkeypatch, capsys):
    from expertflow import sim

    rows = [{"batch": 1, "cache_fraction": 0.5, "source": s, "profile": p,
             "targets_met": ["hit_rate_gain"] * (i % 2) + ["time_vs_best_baseline"] * (s == "true both"),
             "all_targets_met": (s, p) == ("true both", "tuned")}
            for s in perfect.SOURCES for i, p in enumerate(perfect.PROFILES)]
    trace = SimpleNamespace(num_tokens=7)
    monkeypatch.setattr(perfect, "check_head", lambda parser, args: None)
    monkeypatch.setattr(perfect, "prepare", lambda args, parser: (trace, None, sim.Timing(8.0, 1.0, 0.01)))
    monkeypatch.setattr(perfect, "sources", lambda trace, probs: {})
    monkeypatch.setattr(perfect, "run_config", lambda *args: rows)
    monkeypatch.setattr(sys, "argv", ["perfect_predictions.py", "--batches", "1", "--fractions", "0.5"])
    perfect.main()
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert summary["benchmark"] == "perfect_predictions_summary" and summary["tokens"] == 7
    got = summary["summary"]["batch 1, 0.5 cached"]
    assert got["all_met_by"] == [["true both", "tuned"]]
    assert got["targets_met"] == {f"{r['source']}, {r['profile']}": r["targets_met"] for r in rows}
    assert len(got["targets_met"]) == len(perfect.SOURCES) * len(perfect.PROFILES)


def test_head_recall_rows_carry_the_blends_recall_to_four_places(needed, monkeypatch, capsys):
    from expertflow import sim
    from expertflow.predictor.metrics import next_token_recall

    trace, probs, rows, _ = _head_recall_run(needed, monkeypatch, capsys, "--blends", "0,0.25", "--batches", "2")
    _, truth = sim.true_predictions(trace, next_tokens=3)
    for r in rows:
        guess = (1 - r["blend"]) * probs[1] + r["blend"] * truth
        recalls = [next_token_recall(trace, guess[:, k], offset=k + 1)["next_token_head"] for k in range(3)]
        assert r["recall_one_ahead"] == round(recalls[0], 4)
        assert r["recall_mean"] == round(float(np.mean(recalls)), 4)
    assert {r["recall_one_ahead"] for r in rows} != {round(r["recall_one_ahead"], 1) for r in rows}


def test_head_recall_summary_counts_only_blends_meeting_every_target(needed, monkeypatch, capsys):
    from expertflow import sim

    met = {0.0: [], 0.5: ["time_vs_best_baseline", "hit_rate_gain"],
           0.75: ["time_vs_best_baseline", "hit_rate_gain", "on_demand_share_of_needs"], 1.0: ["hit_rate_gain"]}

    def policy_rows(trace, base, given, timing, profiles, extra):
        return [dict(base["row"], profile=p, **extra, targets_met=met[extra["blend"]],
                     all_targets_met=len(met[extra["blend"]]) == 3) for p in profiles]

    trace = SimpleNamespace(num_tokens=4)
    monkeypatch.setattr(needed, "check_head", lambda parser, args: None)
    monkeypatch.setattr(needed, "prepare", lambda args, parser: (trace, (None, None), sim.Timing(4.0, 0.5, 0.05)))
    monkeypatch.setattr(needed, "baseline_config", lambda trace, batch, fraction, timing, name: {
        "row": {"batch": batch, "cache_fraction": fraction}})
    monkeypatch.setattr(needed, "blended", lambda trace, probs, weights: (
        (a, {"recall_one_ahead": 0.7 + a / 4, "recall_mean": 0.5}, None) for a in weights))
    monkeypatch.setattr(needed, "policy_rows", policy_rows)
    monkeypatch.setattr(sys, "argv", ["head_recall_needed.py", "--blends", "0,0.5,0.75,1", "--batches", "16"])
    needed.main()
    got = json.loads(capsys.readouterr().out.splitlines()[-1])["summary"]["batch 16, 0.5 cached, waves"]
    assert got["blends_meeting_all"] == [0.75]
    assert got["least_blend_meeting_all"] == {"blend": 0.75, "recall_one_ahead": 0.8875}
    assert got["least_blend_meeting"] == {"time_vs_best_baseline": {"blend": 0.5, "recall_one_ahead": 0.825},
                                          "hit_rate_gain": {"blend": 0.5, "recall_one_ahead": 0.825},
                                          "on_demand_share_of_needs": {"blend": 0.75, "recall_one_ahead": 0.8875}}


def test_head_recall_refuses_a_trace_without_decode_tokens_in_one_line(needed, monkeypatch, capsys):
    from expertflow import sim
    from expertflow.trace import PREFILL, Trace

    rng = np.random.default_rng(5)
    routes = np.stack([rng.permutation(6)[:2] for _ in range(8 * 2)]).reshape(8, 2, 2).astype(np.int32)
    trace = Trace(experts=routes, num_experts=6, seq_ids=np.repeat([0, 1], 4), positions=np.tile(np.arange(4), 2),
                  steps=np.tile(np.arange(4), 2), phase=np.full(8, PREFILL))
    probs = (rng.random((8, 2, 6)), rng.random((8, 2, 2, 6)))
    monkeypatch.setattr(needed, "check_head", lambda parser, args: None)
    monkeypatch.setattr(needed, "prepare", lambda args, parser: (trace, probs, sim.Timing(4.0, 0.5, 0.05)))
    monkeypatch.setattr(sys, "argv", ["head_recall_needed.py", "--blends", "0,1", "--batches", "2"])
    with pytest.raises(SystemExit) as stopped:
        needed.main()
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and "holds no decode token with a following token" in err


def test_late_next_guess_summary_and_the_temperature_of_its_training_prompts(late, monkeypatch, capsys):
    import transformers

    import expertflow.models
    from expertflow import sim

    def row(truth_for, at, gain, everything, profile="default"):
        return {"part": "late truth", "batch": 1, "cache_fraction": 0.5, "profile": profile, "truth_for": truth_for,
                "at_layer": at, "hit_rate_gain": gain, "targets_met": ["time_vs_best_baseline"],
                "all_targets_met": everything}

    rows = [row(None, None, 0.13, False), row("next token", -1, 0.14, False), row("next token", 0, 0.135, False),
            row("all tokens", -1, 0.17, True), row("all tokens", 0, 0.16, True), row("all tokens", 1, 0.12, False)]
    rows += [dict(r, profile=p) for p in ("waves", "tuned") for r in rows]
    states = [{"part": "model states", "state": s, "probe_recall_one_ahead": 0.5 + i / 10, "logit_lens_top1": i / 10,
               "shipped_head_recall_one_ahead": 0.73} for i, s in enumerate((0, 1, "final"))]
    temperatures = []
    rng = np.random.default_rng(7)
    trace = _two_sequences(rng)
    probs = (rng.random((12, 2, 6)), rng.random((12, 2, 2, 6)))
    monkeypatch.setattr(late, "check_head", lambda parser, args: None)
    monkeypatch.setattr(late, "prepare", lambda args, parser: (trace, probs, sim.Timing(8.0, 1.0, 0.01)))
    monkeypatch.setattr(late, "late_rows", lambda *args: [dict(r) for r in rows])
    monkeypatch.setattr(late, "state_rows", lambda model, tok, test, head, temperature=None:
                        temperatures.append(temperature) or states)
    monkeypatch.setattr(expertflow.models, "tiny_moe", lambda dtype: SimpleNamespace(eval=lambda: SimpleNamespace(
        name_or_path="tiny")))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda path: None)
    monkeypatch.setattr(sys, "argv", ["late_next_guess.py", "--batches", "1", "--temperature", "0.7"])
    late.main()
    assert temperatures == [0.7], "the training prompts are recorded as the held-out ones were"
    printed = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert printed["benchmark"] == "late_next_guess_summary" and printed["tokens"] == 12
    summary = printed["summary"]
    got = summary["batch 1, 0.5 cached, default"]
    assert got["head_gain"] == 0.13
    assert got["next token: gain_by_layer"] == {"-1": 0.14, "0": 0.135}
    assert got["all tokens: gain_by_layer"] == {"-1": 0.17, "0": 0.16, "1": 0.12}
    assert got["meeting_all"] == ["all tokens from layer -1", "all tokens from layer 0"]
    assert summary["probe_recall_by_state"] == {"0": 0.5, "1": 0.6, "final": 0.7}
    assert summary["shipped_head_recall_one_ahead"] == 0.73


def test_late_next_guess_refuses_replayed_states_with_over_a_thousandth_of_routes_changed(late):
    import torch
    from transformers import AutoTokenizer

    from expertflow.models import tiny_moe
    from expertflow.recorder import record

    model = tiny_moe(dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model.name_or_path)
    prompts = ["A short prompt about the weather", "Another, rather longer prompt than that one is"]
    trace = record(model, prompts, tokenizer, batch_size=2, max_new_tokens=3, progress=False)
    cells = trace.num_tokens * trace.num_layers
    assert 100 < cells < 1000  # one changed cell is more than 0.1% and less than 1%
    _, mismatches = late.hidden_states(model, trace)
    assert mismatches == 0
    experts = trace.experts.copy()
    experts[0, 0] = (experts[0, 0] + 1) % trace.num_experts
    assert set(experts[0, 0]) != set(trace.experts[0, 0])
    with pytest.raises(RuntimeError, match="recorded routes"):
        late.hidden_states(model, dataclasses.replace(trace, experts=experts))


def test_late_next_guess_refuses_a_recording_without_decode_tokens_before_simulating(late, monkeypatch, capsys,
                                                                                    tmp_path):
    """One new token per prompt comes from the prefill pass and is never fed back: the recording holds no decode
    token, so there is no next token's recall to measure. The run ends in one line naming the cause and the fix,
    right after recording, before any simulation."""
    import expertflow.models

    prompts = ["A short prompt about the weather", "Another, rather longer prompt than that one is"]
    monkeypatch.setattr(expertflow.models, "load_prompts", lambda split: [{"prompt": p} for p in prompts])
    compute = tmp_path / "run.jsonl"
    compute.write_text(json.dumps({"benchmark": "ece_sim", "timing": {"layer_ms": 0.92, "token_ms": 0.016}}))
    monkeypatch.setattr(late, "late_rows", lambda *args: pytest.fail("simulated a recording without decode tokens"))
    monkeypatch.setattr(late, "state_rows", lambda *args: pytest.fail("read the states of a recording without "
                                                                      "decode tokens"))
    monkeypatch.setattr(sys, "argv", ["late_next_guess.py", "--max-new-tokens", "1", "--batches", "1",
                                      "--compute-from", str(compute)])
    with pytest.raises(SystemExit) as stopped:
        late.main()
    captured = capsys.readouterr()
    last = captured.err.strip().splitlines()[-1]
    assert stopped.value.code == 2 and "usage: " in captured.err and "Traceback" not in captured.err
    assert last.startswith("late_next_guess.py: error: the recording holds no decode token with a following token")
    assert "--max-new-tokens" in last
    assert captured.out == ""


def test_late_truth_for_all_tokens_replaces_every_token_of_the_head(late, capsys):
    from expertflow import sim

    rng = np.random.default_rng(6)
    trace = _two_sequences(rng, tokens=8, layers=3)
    predicted, head = rng.random((16, 3, 6)), rng.random((16, 2, 3, 6))
    timing = sim.Timing(transfer_ms=4.0, layer_ms=0.5, token_ms=0.05)
    replay = trace.rebatch(2)
    workload = sim.Workload.from_trace(replay)
    steps = sim.step_predictions(replay, predicted, head)
    rows = late.late_rows(trace, (predicted, head), 2, 0.5, timing)
    capsys.readouterr()
    row = {(r["truth_for"], r["at_layer"], r["profile"]): r for r in rows}
    _, true_next = sim.true_predictions(trace, next_tokens=2)
    truth = {s: p[1] for s, p in sim.step_predictions(replay, predicted, true_next).items()}  # both tokens
    for layer in range(3):
        direct = sim.simulate(workload, late.LateTruth(9, 3, 6, truth=truth, at=layer), 9, timing, predictions=steps)
        assert (direct.hits, direct.loads, direct.modeled_ms_per_token) == tuple(
            row["all tokens", layer, "default"][k] for k in ("hits", "loads", "modeled_ms_per_token")), layer


def _one_layer_trace(experts):
    from expertflow.trace import Trace

    n = len(experts)
    return Trace(experts=np.array(experts, dtype=np.int32).reshape(n, 1, 1), num_experts=4,
                 seq_ids=np.zeros(n, dtype=np.int32), positions=np.arange(n), steps=np.arange(n))


def test_known_steps_evicts_by_next_need_within_the_horizon_and_by_frequency_beyond(horizon):
    """One layer, 2 slots, one expert a step: A A A B C B. At C both residents (A: 3 uses, never again; B: 1 use,
    needed next step) must make way for one: knowing one step ahead, A goes (3 loads, Belady's); knowing only the
    current step, neither is known and the less used B goes (4 loads, as lfu)."""
    from expertflow import sim

    workload = sim.Workload.from_trace(_one_layer_trace([0, 0, 0, 1, 2, 1]))
    loads = {h: sim.simulate(workload, horizon.KnownSteps(2, workload, h), 2).loads for h in (0, 1, 2, 8)}
    assert loads == {0: 4, 1: 3, 2: 3, 8: 3}
    assert sim.simulate(workload, "belady", 2).loads == 3 and sim.simulate(workload, "lfu", 2).loads == 4


def test_known_steps_with_a_long_horizon_is_belady(horizon):
    from expertflow import sim

    rng = np.random.default_rng(8)
    trace = _two_sequences(rng, tokens=10, layers=2, experts=6, k=2)
    workload = sim.Workload.from_trace(trace.rebatch(2))
    for capacity in (4, 6, 8):
        belady = sim.simulate(workload, "belady", capacity).loads
        known = [sim.simulate(workload, horizon.KnownSteps(capacity, workload, h), capacity).loads for h in (0, 2, 50)]
        assert known[-1] == belady and known[0] >= known[1] >= known[2], capacity


def _script_error(monkeypatch, capsys, module, *argv):
    monkeypatch.setattr(sys, "argv", ["eviction_horizon.py", *argv])
    with pytest.raises(SystemExit) as stopped:
        module.main()
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.startswith("usage: ") and "Traceback" not in err
    return err.strip().splitlines()[-1]


def test_eviction_horizon_checks_batch_and_fraction_first(horizon, monkeypatch, capsys, tmp_path):
    from expertflow.trace import Trace

    Trace(experts=np.array([[[0, 1], [2, 3]]] * 3), num_experts=4).save(tmp_path / "small.safetensors")
    small = ("--trace", str(tmp_path / "small.safetensors"))
    for flag, value in (("--batch", "0"), ("--batch", "-2"), ("--fraction", "0"), ("--fraction", "1.5")):
        assert flag in _script_error(monkeypatch, capsys, horizon, *small, flag, value), (flag, value)


def test_eviction_horizon_report(horizon, monkeypatch, capsys, tmp_path):
    from expertflow.trace import Trace

    rng = np.random.default_rng(0)
    n = 24  # the shipped predictor's shape: 6 layers x 32 experts, top-4
    experts = np.stack([rng.permutation(32)[:4] for _ in range(n * 6)]).reshape(n, 6, 4).astype(np.int32)
    Trace(experts=experts, num_experts=32, token_ids=rng.integers(0, 200, n).astype(np.int32),
          seq_ids=np.repeat([0, 1], 12), positions=np.tile(np.arange(12), 2),
          steps=np.tile(np.arange(12), 2)).save(tmp_path / "t.safetensors")
    made = []
    real = horizon.make_policy
    monkeypatch.setattr(horizon, "make_policy", lambda *args, **kwargs: made.append(kwargs) or real(*args, **kwargs))
    monkeypatch.setattr(sys, "argv", ["eviction_horizon.py", "--trace", str(tmp_path / "t.safetensors"),
                                      "--batch", "2"])
    horizon.main()
    report = json.loads(capsys.readouterr().out)
    assert made == [{"theta": 1.01, "speculate": 0.0}, {}] * 2, "demand-only: no prefetch at all"
    assert list(report["loads"]) == [f"known_steps_{h}" for h in horizon.HORIZONS] + ["lfu"] + [
        f"expertflow_{p}_{m}" for p in ("next_token_head", "step_transitions") for m in ("demand_only", "prefetching")]
    assert report["loads_vs_belady"] == {k: round(v / report["belady_loads"], 4) for k, v in report["loads"].items()}
    assert report["loads"]["known_steps_8"] >= report["belady_loads"]
    assert [r["offset"] for r in report["next_token_recall"]] == list(range(1, 9))
