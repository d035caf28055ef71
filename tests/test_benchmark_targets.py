"""benchmarks/ece_frontier.py's target rules and redraw, and the results reader it shares with ece_sim.py (no
measuring or recording: rows are written by hand)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def frontier(monkeypatch):
    """benchmarks/ece_frontier.py imported for one test: the plug-in policies its import registers, sys.path and
    the imported modules are restored afterwards."""
    from expertflow.policy import base as policy_base

    monkeypatch.setattr(policy_base, "_REGISTRY", dict(policy_base._REGISTRY))
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    before = set(sys.modules)
    import ece_frontier

    yield ece_frontier
    for name in set(sys.modules) - before:
        if name in ("ece_frontier", "ece_sim", "belady_waves", "lru_layer_waves"):
            del sys.modules[name]


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


def test_redraw_from_results_and_clear_errors(tmp_path):
    rows = [_row(b, f, p, m, 0.7 + m / 100, 0.12 + m / 200, m / 50, ["time_vs_best_baseline"])
            for b in (1, 16) for f in (0.5, 0.25) for p in ("pinned", "waves", "waves, deferring") for m in (0, 8)]
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
