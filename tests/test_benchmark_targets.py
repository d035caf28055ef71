"""benchmarks/ece_frontier.py's target rules and redraw, the results reader it shares with ece_sim.py, and
benchmarks/perfect_predictions.py's sources, rows and redraw, benchmarks/head_recall_needed.py's blends, rows,
summary and redraw, and benchmarks/late_next_guess.py's late truth, rows, states and redraw (no measuring; traces,
timings and rows are made by hand, but for a few tokens recorded from the built-in model)."""

from __future__ import annotations

import dataclasses
import importlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


BENCHMARK_MODULES = ("late_next_guess", "head_recall_needed", "perfect_predictions", "ece_frontier", "ece_sim",
                     "belady_waves", "lru_layer_waves")


def _imported(monkeypatch, name: str):
    """benchmarks/<name>.py imported for one test: the plug-in policies its import registers, sys.path and the
    benchmark modules it imported are restored afterwards, and the module itself is forgotten."""
    from expertflow.policy import base as policy_base

    monkeypatch.setattr(policy_base, "_REGISTRY", dict(policy_base._REGISTRY))
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    before = set(sys.modules)
    yield importlib.import_module(name)
    for module in set(sys.modules) - before:
        if module in BENCHMARK_MODULES:
            del sys.modules[module]
    sys.modules.pop(name, None)


@pytest.fixture
def frontier(monkeypatch):
    yield from _imported(monkeypatch, "ece_frontier")


def _row(batch, fraction, profile, margin, time, gain, on_demand, met):
    return {"benchmark": "ece_frontier", "batch": batch, "cache_fraction": fraction, "profile": profile,
            "policy_kwargs": {"margin": margin}, "time_vs_best_baseline": time, "hit_rate_gain": gain,
            "on_demand_share_of_needs": on_demand, "targets_met": met, "all_targets_met": False}


def test_targets_apply_by_batch_and_cache_and_bounds_are_inclusive(frontier):
    assert frontier.targets(1, 0.5) == {"time_vs_best_baseline": 0.9, "hit_rate_gain": 0.15,
                                        "on_demand_share_of_needs": 0.10}
    assert frontier.targets(16, 0.25) == {"time_vs_best_baseline": 0.75, "hit_rate_gain": 0.15}
    at_the_bounds = {"batch": 16, "cache_fraction": 0.5, "time_vs_best_baseline": 0.75, "hit_rate_gain": 0.15,
                     "on_demand_share_of_needs": 0.10}
    assert frontier.met(at_the_bounds) == ["time_vs_best_baseline", "hit_rate_gain", "on_demand_share_of_needs"]
    just_off = dict(at_the_bounds, time_vs_best_baseline=0.75001, hit_rate_gain=0.14999,
                    on_demand_share_of_needs=0.1001)
    assert frontier.met(just_off) == []
    assert frontier.met(dict(just_off, batch=1)) == ["time_vs_best_baseline"]  # 0.9 at batch 1


def test_margins_must_be_finite_and_not_negative(frontier):
    import argparse

    assert frontier._margins("0,4,8.5") == (0.0, 4.0, 8.5)
    for bad in ("-1", "inf", "nan", "4,x", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="prefetch margins of at least 0"):
            frontier._margins(bad)


def test_budgets_are_shares_and_run_after_the_margins(frontier):
    import argparse

    assert frontier._budgets("0.05,0.08") == (0.05, 0.08)
    for bad in ("0", "1", "-0.1", "nan", "8%", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="on-demand budgets as shares of needs between 0 and 1"):
            frontier._budgets(bad)
    runs = frontier.settings((0.0, 8.0), (0.08,))
    assert runs[:2] == [("pinned", {"margin": 0.0}), ("pinned", {"margin": 8.0})]
    assert runs[-1] == ("waves, budget", {"waves": True, "wave_gap": 2.0, "on_demand_target": 0.08})
    assert len(runs) == 2 * len(frontier.PROFILES) + 1
    from expertflow.policy import make_policy

    for _, options in runs:  # every setting is one the policy takes
        make_policy("expertflow", 4, 2, 4, **options)
    assert [frontier.label({"policy_kwargs": o}) for _, o in runs[-2:]] == ["8", "8%"]


def test_redraw_from_results_and_clear_errors(tmp_path):
    rows = [_row(b, f, p, m, 0.7 + m / 100, 0.12 + m / 200, m / 50, ["time_vs_best_baseline"])
            for b in (1, 16) for f in (0.5, 0.25) for p in ("pinned", "waves", "waves, deferring") for m in (0, 8)]
    rows += [dict(_row(b, f, "waves, budget", 0, 0.7, 0.14 + x, x, []),
                  policy_kwargs={"waves": True, "wave_gap": 2.0, "on_demand_target": x})
             for b in (1, 16) for f in (0.5, 0.25) for x in (0.05, 0.08)]
    good = tmp_path / "rows.jsonl"
    good.write_text("\n".join(json.dumps(r) for r in rows) + "\n" + json.dumps({"benchmark": "ece_frontier_summary"}))
    script = str(BENCHMARKS / "ece_frontier.py")

    def run(*args):
        return subprocess.run([sys.executable, script, *args], capture_output=True, text=True)

    done = run("--from-results", str(good), "--plot", str(tmp_path / "f.png"))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "f.png").stat().st_size > 10_000
    lacking = tmp_path / "lacking.jsonl"
    lacking.write_text(json.dumps({k: v for k, v in rows[0].items() if k != "targets_met"}) + "\n")
    for path, message in ((lacking, "line 1 lacks targets_met; give the output of benchmarks/ece_frontier.py"),
                          (tmp_path / "f.png", "line 1 is not JSON"),
                          (good, None)):
        args = ["--from-results", str(path)] + (["--plot", str(tmp_path / "g.png")] if message else [])
        failed = run(*args)
        assert failed.returncode == 2 and "Traceback" not in failed.stderr
        assert (message or "--from-results only draws a plot: add --plot FILE.png") in failed.stderr


def _assert_redraws(tmp_path, benchmark: str, rows: list[dict], refuses: str | None = None) -> str:
    """benchmarks/<benchmark>.py --from-results draws `rows` into a PNG; with `refuses`, the same rows labelled as
    that other benchmark's end in one line naming this one (status 2, no traceback). Returns the script's path."""
    good = tmp_path / "rows.jsonl"
    good.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    script = str(BENCHMARKS / f"{benchmark}.py")
    done = subprocess.run([sys.executable, script, "--from-results", str(good), "--plot", str(tmp_path / "p.png")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "p.png").stat().st_size > 10_000
    if refuses is not None:
        other = tmp_path / "other.jsonl"
        other.write_text(json.dumps(dict(rows[0], benchmark=refuses)) + "\n")
        failed = subprocess.run([sys.executable, script, "--from-results", str(other), "--plot",
                                 str(tmp_path / "q.png")], capture_output=True, text=True)
        assert failed.returncode == 2 and "Traceback" not in failed.stderr and benchmark in failed.stderr
    return script


@pytest.fixture
def perfect(monkeypatch):
    yield from _imported(monkeypatch, "perfect_predictions")


@pytest.fixture
def needed(monkeypatch):
    yield from _imported(monkeypatch, "head_recall_needed")


def test_perfect_prediction_sources_replace_exactly_their_part(perfect):
    import numpy as np

    from expertflow import sim
    from expertflow.trace import Trace

    rng = np.random.default_rng(0)
    routes = np.stack([rng.permutation(6)[:2] for _ in range(10 * 3)]).reshape(10, 3, 2).astype(np.int32)
    trace = Trace(experts=routes, num_experts=6, seq_ids=np.repeat([0, 1], 5), positions=np.tile(np.arange(5), 2))
    predicted, head = rng.random((10, 3, 6)), rng.random((10, 4, 3, 6))
    true_now, true_next = sim.true_predictions(trace, next_tokens=4)
    got = perfect.sources(trace, (predicted, head))
    assert list(got) == list(perfect.SOURCES)
    for name, (now, after) in [("predicted", (predicted, head)), ("true current", (true_now, head)),
                               ("true next tokens", (predicted, true_next)), ("true both", (true_now, true_next))]:
        assert np.array_equal(got[name][0], now) and np.array_equal(got[name][1], after), name
    now, after = got["true next token"]
    assert np.array_equal(now, predicted) and np.array_equal(after[:, 0], true_next[:, 0])
    assert np.allclose(after[:, 1:], head[:, 1:]) and not np.array_equal(after[:, 0], head[:, 0])
    assert np.array_equal(got["predicted"][1], head), "the predictor's own guesses are left as they were"
    with pytest.raises(ValueError, match="no next-token head"):
        perfect.sources(trace, predicted)


def test_perfect_predictions_rows_cover_every_source_and_profile(perfect, capsys):
    import numpy as np

    from expertflow import sim
    from expertflow.trace import Trace

    rng = np.random.default_rng(1)
    routes = np.stack([rng.permutation(4)[:2] for _ in range(12 * 2)]).reshape(12, 2, 2).astype(np.int32)
    trace = Trace(experts=routes, num_experts=4, seq_ids=np.repeat([0, 1], 6), positions=np.tile(np.arange(6), 2),
                  steps=np.tile(np.arange(6), 2))
    given = perfect.sources(trace, (rng.random((12, 2, 4)), rng.random((12, 2, 2, 4))))
    timing = sim.Timing(transfer_ms=4.0, layer_ms=0.5, token_ms=0.05)
    rows = perfect.run_config(trace, given, 2, 0.5, timing)
    assert [(r["source"], r["profile"]) for r in rows] == [(s, p) for s in perfect.SOURCES for p in perfect.PROFILES]
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert printed == json.loads(json.dumps(rows))
    for r in rows:
        assert 0 <= r["hits"] <= r["needs"] and r["needs"] > 0 and r["loads"] >= r["on_demand_loads"]
        assert set(r["targets_met"]) <= set(perfect.targets(2, 0.5))
        assert r["all_targets_met"] == (len(r["targets_met"]) == 3)
        assert r["hit_rate_gain"] == round(r["hits"] / r["needs"] - r["best_baseline_hits"] / r["needs"], 4)
        assert r["loads_lower_bound"] <= r["belady_loads"]
    workload = sim.Workload.from_trace(trace.rebatch(2))
    bound = sim.lower_bound_ms_per_token(workload, rows[0]["capacity_slots"], timing, waves=True)
    assert rows[0]["lower_bound_waves_vs_best_baseline"] == round(bound / rows[0]["best_baseline_ms_per_token"], 4)
    assert rows[0]["loads_lower_bound"] == sim.loads_lower_bound(workload, rows[0]["capacity_slots"])


def test_perfect_predictions_redraw_from_results(tmp_path):
    rows = [{"benchmark": "perfect_predictions", "batch": b, "cache_fraction": f, "profile": p, "source": s,
             "hit_rate_gain": 0.1 + i / 100, "on_demand_share_of_needs": i / 60,
             "targets_met": ["time_vs_best_baseline"] if i % 2 else [], "all_targets_met": i == 3}
            for b in (1, 16) for f in (0.5, 0.25)
            for i, (s, p) in enumerate((s, p) for s in ("predicted", "true both") for p in ("default", "tuned"))]
    _assert_redraws(tmp_path, "perfect_predictions", rows, refuses="ece_frontier")


def test_compute_from_reads_the_first_timing_of_a_previous_run(frontier, tmp_path):
    import ece_sim

    run = tmp_path / "run.jsonl"
    run.write_text("\n".join([json.dumps({"benchmark": "ece_sim", "batch": 1}), "not json",
                              json.dumps({"benchmark": "ece_sim", "timing": {"layer_ms": 0.92, "token_ms": 0.016,
                                                                            "transfer_ms": 7.5}}),
                              json.dumps({"benchmark": "ece_sim", "timing": {"layer_ms": 9.0, "token_ms": 1.0}})]))
    assert ece_sim.read_compute(str(run)) == (0.92, 0.016)
    summary = tmp_path / "summary.jsonl"  # ece_frontier.py and perfect_predictions.py keep it in their summary
    summary.write_text(json.dumps({"benchmark": "ece_frontier_summary", "timing": {"layer_ms": 1, "token_ms": 0}}))
    assert ece_sim.read_compute(str(summary)) == (1.0, 0.0)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"timing": {"layer_ms": 0, "token_ms": 0.1}}))
    none = tmp_path / "none.jsonl"
    none.write_text(json.dumps({"timing": "x"}) + "\n" + json.dumps({"benchmark": "ece_sim"}))
    for path, message in ((bad, "does not give layer_ms > 0"), (none, "holds no measured compute"),
                          (tmp_path / "missing.jsonl", "No such file")):
        with pytest.raises(ValueError, match=message):
            ece_sim.read_compute(str(path))
    script = str(BENCHMARKS / "perfect_predictions.py")
    refused = subprocess.run([sys.executable, script, "--compute-from", str(none)], capture_output=True, text=True)
    assert refused.returncode == 2 and "holds no measured compute" in refused.stderr and "Traceback" not in \
        refused.stderr


def test_compute_model_is_read_not_measured_with_compute_from(frontier, tmp_path, monkeypatch):
    import argparse

    import ece_sim

    def no_measuring(*args):
        raise AssertionError("measured although --compute-from was given")

    run = tmp_path / "run.jsonl"
    run.write_text(json.dumps({"benchmark": "ece_sim", "timing": {"layer_ms": 0.5, "token_ms": 0.01}}))
    monkeypatch.setattr(ece_sim, "measure_compute", no_measuring)
    assert ece_sim.compute_model(argparse.Namespace(compute_from=str(run)), None, None, 6) == (0.5, 0.01)
    monkeypatch.setattr(ece_sim, "measure_compute", lambda model, tokenizer, layers: (1.0, 0.02))
    assert ece_sim.compute_model(argparse.Namespace(compute_from=None), None, None, 6) == (1.0, 0.02)
    for timing in ({"layer_ms": float("inf"), "token_ms": 0.1}, {"layer_ms": True, "token_ms": 0.1},
                   {"layer_ms": 0.5, "token_ms": -1}):
        odd = tmp_path / "odd.jsonl"  # the first timing object decides, even when a later one would do
        odd.write_text(json.dumps({"timing": timing}) + "\n" + json.dumps({"timing": {"layer_ms": 1, "token_ms": 0}}))
        with pytest.raises(ValueError, match="layer_ms > 0 and token_ms >= 0"):
            ece_sim.read_compute(str(odd))
    script = str(BENCHMARKS / "ece_sim.py")
    both = subprocess.run([sys.executable, script, "--from-results", str(run), "--plot", str(tmp_path / "p.png"),
                           "--compute-from", str(run)], capture_output=True, text=True)
    assert both.returncode == 2 and "--compute-from is not used with --from-results" in both.stderr


def test_perfect_predictions_refuses_a_predictor_without_the_head_before_measuring(perfect, monkeypatch, capsys):
    import argparse

    import expertflow.predictor as predictor_module

    class Headless:
        has_next_head = False

    monkeypatch.setattr(predictor_module, "load_predictor", lambda path: Headless())
    monkeypatch.setattr(perfect, "prepare", lambda *args: pytest.fail("measured and recorded before the head check"))
    monkeypatch.setattr(sys, "argv", ["perfect_predictions.py"])
    with pytest.raises(SystemExit):
        perfect.main()
    assert "the shipped predictor has no next-token head" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        perfect.check_head(argparse.ArgumentParser(), argparse.Namespace(predictor="some/dir"))
    assert "--predictor some/dir has no next-token head" in capsys.readouterr().err


def _two_sequences(rng, tokens=6, layers=2, experts=6, k=2):
    from expertflow.trace import Trace

    routes = np.stack([rng.permutation(experts)[:k] for _ in range(2 * tokens * layers)])
    return Trace(experts=routes.reshape(2 * tokens, layers, k).astype(np.int32), num_experts=experts,
                 seq_ids=np.repeat([0, 1], tokens), positions=np.tile(np.arange(tokens), 2),
                 steps=np.tile(np.arange(tokens), 2))


def test_blends_run_from_the_head_to_the_truth(needed):
    from expertflow import sim
    from expertflow.predictor.metrics import next_token_recall

    rng = np.random.default_rng(2)
    trace = _two_sequences(rng)
    head = rng.random((12, 3, 2, 6)).astype(np.float32)
    _, truth = sim.true_predictions(trace, next_tokens=3)
    got = list(needed.blended(trace, (rng.random((12, 2, 6)), head), (0.0, 0.25, 0.5, 1.0)))
    assert [a for a, _, _ in got] == [0.0, 0.25, 0.5, 1.0]
    assert np.array_equal(got[0][2], head) and np.array_equal(got[-1][2], truth)
    assert np.allclose(got[1][2], 0.75 * head + 0.25 * truth)
    assert got[0][1]["recall_one_ahead"] == next_token_recall(trace, head[:, 0])["next_token_head"] < 1
    assert got[2][1]["recall_one_ahead"] == 1.0, "from a weight of 0.5 on the truth ranks first"
    means = [np.mean([next_token_recall(trace, g[:, k], offset=k + 1)["next_token_head"] for k in range(3)])
             for _, _, g in got]
    assert [r["recall_mean"] for _, r, _ in got] == pytest.approx(means)
    with pytest.raises(ValueError, match="no next-token head"):
        list(needed.blended(trace, rng.random((12, 2, 6)), (0.0,)))


def test_blend_weights_are_checked(needed):
    import argparse

    assert needed._blends("0,0.5,1") == (0.0, 0.5, 1.0)
    for bad in ("0.5,0.2", "0,0", "-0.1", "1.5", "x", "nan"):
        with pytest.raises(argparse.ArgumentTypeError, match="give comma-separated weights|must lie in"):
            needed._blends(bad)


def test_head_recall_rows_carry_their_blend_and_the_least_blend_is_found(needed, capsys):
    from expertflow import sim

    rng = np.random.default_rng(3)
    trace = _two_sequences(rng)
    predicted, head = rng.random((12, 2, 6)), rng.random((12, 2, 2, 6))
    (a, recall, guess), = needed.blended(trace, (predicted, head), (0.3,))
    timing = sim.Timing(transfer_ms=4.0, layer_ms=0.5, token_ms=0.05)
    base = needed.baseline_config(trace, 2, 0.5, timing, needed.BENCHMARK)
    rows = needed.policy_rows(trace, base, {"blend 0.3": (predicted, guess)}, timing, needed.SHOWN,
                              extra=dict(blend=a, **recall))
    assert [(r["profile"], r["blend"], r["benchmark"]) for r in rows] == [(p, 0.3, "head_recall_needed")
                                                                          for p in needed.SHOWN]
    assert all(r["recall_one_ahead"] == recall["recall_one_ahead"] for r in rows)
    assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == json.loads(json.dumps(rows))
    made = [{"blend": b, "recall_one_ahead": b, "targets_met": met, "all_targets_met": everything}
            for b, met, everything in ((0.6, ["hit_rate_gain"], True), (0.0, [], False),
                                       (0.4, ["hit_rate_gain"], False), (1.0, [], False))]
    assert needed.least(made, "hit_rate_gain") == {"blend": 0.4, "recall_one_ahead": 0.4}
    assert needed.least(made, None) == {"blend": 0.6, "recall_one_ahead": 0.6}
    assert needed.least(made, "time_vs_best_baseline") is None


def test_head_recall_redraw_from_results(tmp_path):
    rows = [{"benchmark": "head_recall_needed", "batch": b, "cache_fraction": 0.5, "profile": p, "blend": a,
             "recall_one_ahead": min(1.0, 0.7 + a), "hit_rate_gain": 0.13 + a / 20, "on_demand_share_of_needs": 0.05,
             "all_targets_met": a >= 0.5}
            for b in (1, 16) for p in ("default", "waves") for a in (0.0, 0.2, 0.5, 1.0)]
    _assert_redraws(tmp_path, "head_recall_needed", rows, refuses="perfect_predictions")


def _head_recall_run(needed, monkeypatch, capsys, *flags: str) -> tuple:
    """head_recall_needed's main with `flags` on two random 8-token sequences and random guesses of 3 tokens; returns
    the trace, the guesses, its rows and its summary."""
    from expertflow import sim

    rng = np.random.default_rng(4)
    trace = _two_sequences(rng, tokens=8)
    probs = (rng.random((16, 2, 6)), rng.random((16, 3, 2, 6)))
    timing = sim.Timing(transfer_ms=4.0, layer_ms=0.5, token_ms=0.05)
    monkeypatch.setattr(needed, "check_head", lambda parser, args: None)
    monkeypatch.setattr(needed, "prepare", lambda args, parser: (trace, probs, timing))
    monkeypatch.setattr(sys, "argv", ["head_recall_needed.py", *flags])
    needed.main()
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    return trace, probs, lines[:-1], lines[-1]


def test_head_recall_summary_names_the_least_blend_meeting_each_target(needed, monkeypatch, capsys):
    _, _, rows, summary = _head_recall_run(needed, monkeypatch, capsys, "--blends", "0,0.5,1", "--batches", "1,2")
    assert summary["benchmark"] == "head_recall_needed_summary" and summary["config"]["blends"] == [0.0, 0.5, 1.0]
    assert [(r["batch"], r["blend"], r["profile"]) for r in rows] == [
        (b, a, p) for b in (1, 2) for a in (0.0, 0.5, 1.0) for p in needed.SHOWN]
    assert {r["cache_fraction"] for r in rows} == {0.5}, "half cached unless told otherwise"
    for batch in (1, 2):
        for profile in needed.SHOWN:
            mine = [r for r in rows if (r["batch"], r["profile"]) == (batch, profile)]
            got = summary["summary"][f"batch {batch}, 0.5 cached, {profile}"]
            assert got["blends_meeting_all"] == [r["blend"] for r in mine if r["all_targets_met"]]
            for name in got["targets"]:
                first = next((r for r in mine if name in r["targets_met"]), None)
                assert got["least_blend_meeting"][name] == (None if first is None else {
                    "blend": first["blend"], "recall_one_ahead": first["recall_one_ahead"]})


@pytest.fixture
def late(monkeypatch):
    yield from _imported(monkeypatch, "late_next_guess")


def test_late_truth_replaces_the_guess_at_its_layer_and_not_before(late):
    rng = np.random.default_rng(5)
    head = rng.random((3, 2, 4, 6))  # 3 rows, 2 next tokens, 4 layers, 6 experts
    truth = np.zeros((3, 1, 4, 6))
    truth[0, 0, :, [1, 2]] = truth[1, 0, :, [2, 5]] = 1.0
    policy = late.LateTruth(8, 4, 6, truth={7: truth}, at=2)
    policy.on_step(7, rng.random((3, 4, 6)), head)
    guess = 1.0 - np.prod(1.0 - head, axis=0)
    for layer in range(4):
        policy.on_route(7, layer, [[0, 1]] * 3)
        expected = guess.copy()
        if layer >= 2:
            expected[0] = 1.0 - np.prod(1.0 - truth[:, 0], axis=0)
        assert np.allclose(policy.next_demand, expected), layer
    assert set(np.flatnonzero(policy.next_demand[0, 0])) == {1, 2, 5}
    policy.on_step(8, rng.random((3, 4, 6)), head)  # a step without truth keeps the head's guess
    for layer in range(4):
        policy.on_route(8, layer, [[0, 1]] * 3)
    assert np.allclose(policy.next_demand, guess)


def test_late_truth_that_is_the_head_changes_nothing_and_the_rows_cover_every_layer(late, perfect, capsys):
    from expertflow import sim
    from expertflow.policy import make_policy

    rng = np.random.default_rng(6)
    trace = _two_sequences(rng, tokens=8, layers=3)
    predicted, head = rng.random((16, 3, 6)), rng.random((16, 2, 3, 6))
    timing = sim.Timing(transfer_ms=4.0, layer_ms=0.5, token_ms=0.05)
    workload = sim.Workload.from_trace(trace.rebatch(2))
    steps = sim.step_predictions(trace.rebatch(2), predicted, head)
    plain = sim.simulate(workload, make_policy("expertflow", 9, 3, 6), 9, timing, predictions=steps)
    same = late.LateTruth(9, 3, 6, truth={s: p[1] for s, p in steps.items()}, at=1)
    again = sim.simulate(workload, same, 9, timing, predictions=steps)
    assert (again.hits, again.loads, again.modeled_ms_per_token) == (plain.hits, plain.loads,
                                                                       plain.modeled_ms_per_token)
    rows = late.late_rows(trace, (predicted, head), 2, 0.5, timing)
    profiles = list(late.SHOWN)
    assert [(r["truth_for"], r["at_layer"], r["profile"]) for r in rows] == [(None, None, p) for p in profiles] + [
        (which, m, p) for which in ("next token", "all tokens") for m in (-1, 0, 1, 2) for p in profiles]
    assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == json.loads(json.dumps(rows))
    assert all(r["benchmark"] == "late_next_guess" for r in rows)
    row = {(r["truth_for"], r["at_layer"], r["profile"]): r for r in rows}
    assert (row[None, None, "default"]["hits"], row[None, None, "default"]["loads"]) == (plain.hits, plain.loads)
    # from the start, the truth is perfect_predictions.py's sources; from layer 0 on it is applied, and changes things
    given = perfect.sources(trace, (predicted, head))
    base = perfect.baseline_config(trace, 2, 0.5, timing)
    capsys.readouterr()
    for which, source in (("next token", "true next token"), ("all tokens", "true next tokens")):
        for r in perfect.policy_rows(trace, base, {source: given[source]}, timing):
            assert (r["hits"], r["loads"], r["modeled_ms_per_token"]) == tuple(
                row[which, -1, r["profile"]][k] for k in ("hits", "loads", "modeled_ms_per_token"))
        assert any(row[which, 0, p]["modeled_ms_per_token"] != row[None, None, p]["modeled_ms_per_token"]
                   for p in profiles), which
    # each later row is the policy with the truth arriving at that very layer
    _, true_next = sim.true_predictions(trace, next_tokens=2)
    first_true = head.copy()
    first_true[:, 0] = true_next[:, 0]
    truth = {s: p[1][:, :1] for s, p in sim.step_predictions(trace.rebatch(2), predicted, first_true).items()}
    for layer in range(3):
        direct = sim.simulate(workload, late.LateTruth(9, 3, 6, truth=truth, at=layer), 9, timing, predictions=steps)
        assert (direct.hits, direct.loads, direct.modeled_ms_per_token) == tuple(
            row["next token", layer, "default"][k] for k in ("hits", "loads", "modeled_ms_per_token")), layer
    assert len({row["next token", m, "default"]["modeled_ms_per_token"] for m in range(3)}) > 1


def test_late_next_guess_pairs_each_token_with_the_next_of_its_sequence(late):
    from expertflow.trace import Trace

    routes = np.zeros((7, 1, 1), dtype=np.int32)
    trace = Trace(experts=routes, num_experts=2, seq_ids=np.array([1, 0, 1, 0, 1, 0, 2]),
                  positions=np.array([2, 0, 0, 1, 1, 2, 0]))
    assert [list(rows) for rows in late.sequence_orders(trace)] == [[1, 3, 5], [2, 4, 0], [6]]
    first, second = late.next_targets(trace)
    assert list(zip(first, second)) == [(1, 3), (3, 5), (2, 4), (4, 0)]


def test_late_next_guess_reads_the_states_the_recording_saw(late, monkeypatch):
    import torch
    from transformers import AutoTokenizer

    import expertflow.models
    import expertflow.recorder
    from expertflow.models import tiny_moe
    from expertflow.predictor.metrics import next_token_recall
    from expertflow.recorder import record

    model = tiny_moe(dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model.name_or_path)
    prompts = ["A short prompt", "Another, rather longer prompt than that"]
    trace = record(model, prompts, tokenizer, batch_size=2, max_new_tokens=3, progress=False)
    states, mismatches = late.hidden_states(model, trace)
    assert states.shape == (trace.num_tokens, trace.num_layers + 1, model.config.hidden_size)
    assert mismatches <= 0.001 * trace.num_tokens * trace.num_layers
    rows = late.sequence_orders(trace)[1]
    ids = torch.as_tensor(trace.token_ids[rows], dtype=torch.long)
    with torch.no_grad():  # the first state is the embeddings, the last gives the logits: nothing normed twice
        assert torch.allclose(states[rows, 0], model.model.embed_tokens(ids))
        logits = model(input_ids=ids[None]).logits[0]
        assert torch.allclose(late.logit_lens(model, states[rows, -1], final=True), logits, atol=1e-5)
        assert not torch.allclose(late.logit_lens(model, states[rows, -1], final=False), logits, atol=1e-3)
    probe = late.fit_probe(states[:, 2], trace)
    assert probe(states[:3, 2]).shape == (3, trace.num_layers * trace.num_experts)
    with pytest.raises(RuntimeError, match="recorded routes"):
        late.hidden_states(model, dataclasses.replace(trace, experts=np.roll(trace.experts, 1, axis=-2)))
    # the second part on two prompts: greedy decoding, so the final state's first choice is always the next token
    monkeypatch.setattr(expertflow.models, "load_prompts", lambda split: [{"prompt": p} for p in prompts])
    recorded, fitted, lensed = [], [], []
    real_record, real_fit, real_lens = expertflow.recorder.record, late.fit_probe, late.logit_lens

    def spy_record(*args, **kwargs):
        recorded.append((kwargs, real_record(*args, **kwargs)))
        return recorded[-1][1]

    monkeypatch.setattr(expertflow.recorder, "record", spy_record)
    monkeypatch.setattr(late, "fit_probe", lambda states, trace: fitted.append(states) or real_fit(states, trace))
    monkeypatch.setattr(late, "logit_lens", lambda model, states, final: lensed.append(final) or real_lens(
        model, states, final))
    head = np.random.default_rng(7).random((trace.num_tokens, 2, trace.num_layers, trace.num_experts))
    got = late.state_rows(model, tokenizer, trace, head)
    (kwargs, train), = recorded
    assert kwargs["temperature"] is None and kwargs["max_new_tokens"] == 64
    train_states, _ = late.hidden_states(model, train)
    assert len(fitted) == trace.num_layers + 1 and all(torch.equal(f, train_states[:, m]) for m, f in enumerate(fitted))
    assert lensed == [False] * trace.num_layers + [True]
    assert all(r["train_pairs"] == len(late.next_targets(train)[0]) for r in got)
    assert [r["state"] for r in got] == list(range(trace.num_layers)) + ["final"]
    assert got[-1]["logit_lens_top1"] == got[-1]["logit_lens_top5"] == 1.0 and got[0]["logit_lens_top1"] < 1.0
    shipped = next_token_recall(trace, head[:, 0])
    assert all(r["shipped_head_recall_one_ahead"] == round(shipped["next_token_head"], 4) for r in got)
    assert all(r["decode_tokens"] == shipped["tokens"] > 0 and 0 <= r["probe_recall_one_ahead"] <= 1 for r in got)

    class Stop(Exception):
        pass

    def stop(*args, **kwargs):
        recorded.append((kwargs, None))
        raise Stop

    monkeypatch.setattr(expertflow.recorder, "record", stop)
    with pytest.raises(Stop):
        late.state_rows(model, tokenizer, trace, head, temperature=0.7)
    assert recorded[-1][0]["temperature"] == 0.7, "the training prompts are recorded as the held-out ones were"


def test_late_next_guess_redraw_and_refuses_a_trace(tmp_path):
    rows = [{"benchmark": "late_next_guess", "part": "late truth", "batch": b, "cache_fraction": 0.5, "profile": p,
             "truth_for": w, "at_layer": m, "hit_rate_gain": 0.13 + (m or 0) / 100}
            for b in (1, 16) for w, ms in ((None, (None,)), ("next token", (-1, 0, 1)), ("all tokens", (-1, 0, 1)))
            for m in ms for p in ("default", "waves") if (b, w) != (16, None)]  # a configuration without its head
    rows += [{"benchmark": "late_next_guess", "part": "model states", "state": s, "probe_recall_one_ahead": 0.6,
              "logit_lens_top1": 0.3, "logit_lens_top5": 0.5, "shipped_head_recall_one_ahead": 0.73}
             for s in (0, 1, "final")]
    script = _assert_redraws(tmp_path, "late_next_guess", rows)
    failed = subprocess.run([sys.executable, script, "--trace", str(tmp_path)], capture_output=True, text=True)
    assert failed.returncode == 2 and "Traceback" not in failed.stderr and "drop --trace" in failed.stderr


@pytest.mark.parametrize("field, value", [("timing", None), ("timing", {"transfer_over_layer_compute": "eight"})])
def test_ece_sim_redraw_of_a_damaged_row_names_the_file_in_one_line(tmp_path, field, value):
    shipped = BENCHMARKS.parent / "docs" / "results" / "ece_sim.jsonl"
    rows = [json.loads(line) for line in shipped.read_text().splitlines()]
    rows[0][field] = value
    damaged = tmp_path / "damaged.jsonl"
    damaged.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    failed = subprocess.run([sys.executable, str(BENCHMARKS / "ece_sim.py"), "--from-results", str(damaged), "--plot",
                             str(tmp_path / "p.png")], capture_output=True, text=True)
    assert failed.returncode == 2 and "Traceback" not in failed.stderr, failed.stderr
    assert f"error: --from-results {damaged}: cannot draw it (" in failed.stderr


def test_ece_sim_names_the_flag_of_a_trace_or_predictor_it_cannot_read(tmp_path):
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a trace")
    (tmp_path / "empty").mkdir()
    script = str(BENCHMARKS / "ece_sim.py")
    for args, start in ((["--trace", str(garbage)], f"--trace {garbage}: "),
                        (["--predictor", str(tmp_path / "empty")], f"--predictor {tmp_path / 'empty'}: ")):
        failed = subprocess.run([sys.executable, script, *args], capture_output=True, text=True)
        assert failed.returncode == 2 and "Traceback" not in failed.stderr, failed.stderr
        assert f"ece_sim.py: error: {start}" in failed.stderr, failed.stderr

