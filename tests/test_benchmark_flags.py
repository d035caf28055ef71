"""The benchmark scripts' flags: --from-results refuses every other flag given with it, naming them, before anything is
drawn; repeated values of --batches, --fractions (and the other comma-separated lists) run once; every flag of
gpu_bench.py, predictor_overhead.py, overhead.py and eviction_horizon.py has help text; the policy plug-ins answer
--help and say how to load them; late_next_guess.py lists no --trace or --split and shows its progress on stderr."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest

from test_benchmark_targets import BENCHMARKS, _imported

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"


@contextmanager
def imported(monkeypatch, name: str):
    """benchmarks/<name>.py for the block, forgotten afterwards (as test_benchmark_targets' fixtures do)."""
    made = _imported(monkeypatch, name)
    yield next(made)
    next(made, None)


def _exit(module, monkeypatch, capsys, *argv) -> tuple[int, str]:
    """(exit status, last line of stderr) of `module.main()` run with `argv`."""
    monkeypatch.setattr(sys, "argv", [f"{module.__name__}.py", *argv])
    with pytest.raises(SystemExit) as stopped:
        module.main()
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return stopped.value.code, err.strip().splitlines()[-1]


# --from-results: a redraw reads no other flag, so any other one given is refused


@pytest.mark.parametrize("name", ["ece_sim", "ece_frontier", "perfect_predictions", "head_recall_needed",
                                  "late_next_guess"])
def test_from_results_refuses_the_flags_it_would_ignore_before_drawing(name, monkeypatch, capsys, tmp_path):
    results = str(RESULTS / f"{name}.jsonl")  # the shipped output, which redraws
    plot = tmp_path / "p.png"
    with imported(monkeypatch, name) as module:
        code, last = _exit(module, monkeypatch, capsys, "--from-results", results, "--plot", str(plot),
                           "--batches", "16", "--fractions", "0.25", "--ratio", "3")
        assert code == 2 and not plot.exists()
        assert last == (f"{name}.py: error: --ratio, --fractions, --batches are not used with --from-results, which "
                        "only redraws the plot from that file: drop them, or drop --from-results to run")
        # one flag, given its default value: still given, still ignored
        code, last = _exit(module, monkeypatch, capsys, "--ratio=8", "--from-results", results, "--plot", str(plot))
        assert code == 2 and not plot.exists()
        assert last.endswith("error: --ratio is not used with --from-results, which only redraws the plot from that "
                             "file: drop it, or drop --from-results to run")


def test_ece_live_from_results_refuses_the_flags_it_would_ignore(monkeypatch, capsys, tmp_path):
    plot = tmp_path / "p.png"
    with imported(monkeypatch, "ece_live") as module:
        code, last = _exit(module, monkeypatch, capsys, "--from-results", str(RESULTS / "ece_live.json"), "--plot",
                           str(plot), "--fraction", "0.25", "--batch=16")
    assert code == 2 and not plot.exists()
    assert last == ("ece_live.py: error: --batch, --fraction are not used with --from-results, which only redraws "
                    "the plot from that file: drop them, or drop --from-results to run")


def test_from_results_names_a_missing_trace_as_ignored_not_as_missing(monkeypatch, capsys, tmp_path):
    with imported(monkeypatch, "perfect_predictions") as module:
        code, last = _exit(module, monkeypatch, capsys, "--from-results", str(RESULTS / "perfect_predictions.jsonl"),
                           "--plot", str(tmp_path / "p.png"), "--trace", str(tmp_path / "gone"))
    assert code == 2 and "--trace is not used with --from-results" in last


def test_given_flags_are_those_on_the_command_line_whatever_their_values(monkeypatch):
    with imported(monkeypatch, "ece_sim") as ece_sim:
        parser = argparse.ArgumentParser()
        ece_sim.add_source_arguments(parser)
        ece_sim.add_plot_arguments(parser, "it")
        argv = ["--plot", "p.png", "--batches", "1,16", "--from-results", "r.jsonl", "--trace", "t"]
        args = parser.parse_args(argv)
        assert ece_sim.given_flags(parser, args, argv) == ["--trace", "--batches", "--plot", "--from-results"]
        assert ece_sim.given_flags(parser, args, []) == []
        # the flags are parsed again, but args keeps its values
        assert args.batches == (1, 16) and args.ratio == 8.0


def test_a_plain_redraw_still_draws(monkeypatch, capsys, tmp_path):
    plot = tmp_path / "p.png"
    with imported(monkeypatch, "perfect_predictions") as module:
        monkeypatch.setattr(sys, "argv", ["perfect_predictions.py", "--from-results",
                                          str(RESULTS / "perfect_predictions.jsonl"), "--plot", str(plot)])
        module.main()
    assert plot.stat().st_size > 10_000


# repeated values in the configuration lists


def test_repeated_batches_and_fractions_are_kept_once_in_their_order(monkeypatch):
    from expertflow.commands import batch_sizes, comma_separated

    assert batch_sizes("16,1,16,1") == (16, 1)
    assert comma_separated("2,0,2", float, lambda v: v >= 0, "any") == (2.0, 0.0)
    with imported(monkeypatch, "ece_sim") as ece_sim:
        assert ece_sim._fractions("0.5,0.25,0.50") == (0.5, 0.25)
    with pytest.raises(argparse.ArgumentTypeError, match="give batch sizes of at least 1"):
        batch_sizes("1,0,1")


def test_a_repeated_configuration_runs_once(monkeypatch, capsys):
    """perfect_predictions.py --batches 4,4 --fractions 0.5,0.5: one configuration replayed, one summary entry,
    its sources listed once."""
    with imported(monkeypatch, "perfect_predictions") as module:
        runs = []

        def run_config(trace, given, batch, fraction, timing):
            runs.append((batch, fraction))
            return [{"batch": batch, "cache_fraction": fraction, "source": "true both", "profile": "tuned",
                     "all_targets_met": True, "targets_met": []}]

        monkeypatch.setattr(module, "check_head", lambda parser, args: None)
        monkeypatch.setattr(module, "prepare", lambda args, parser: (SimpleNamespace(num_tokens=8), None, None))
        monkeypatch.setattr(module, "sources", lambda trace, probs: {})
        monkeypatch.setattr(module, "timing_fields", lambda timing: {})
        monkeypatch.setattr(module, "run_config", run_config)
        monkeypatch.setattr(sys, "argv", ["perfect_predictions.py", "--batches", "4,4", "--fractions", "0.5,0.5"])
        module.main()
    assert runs == [(4, 0.5)]
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])["summary"]
    assert list(summary) == ["batch 4, 0.5 cached"]
    assert summary["batch 4, 0.5 cached"]["all_met_by"] == [["true both", "tuned"]]


# help text


class _Parsed(Exception):
    """Raised in place of parsing: carries the parser a script built."""


@pytest.mark.parametrize("name", ["gpu_bench", "predictor_overhead", "overhead", "eviction_horizon", "ece_live"])
def test_every_flag_has_help(name, monkeypatch):
    def parse(self, *args, **kwargs):
        raise _Parsed(self)

    with imported(monkeypatch, name) as module:
        monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse)
        with pytest.raises(_Parsed) as parsed:
            module.main()
    parser = parsed.value.args[0]
    flags = [action for action in parser._actions if action.option_strings]
    assert len(flags) > 1
    assert [a.option_strings for a in flags if not a.help] == []
    if name == "gpu_bench":
        policies = next(a for a in flags if "--policies" in a.option_strings)
        assert "not expertflow" in policies.help


@pytest.mark.parametrize("name, policy", [("belady_waves", "belady-waves"), ("lru_layer_waves", "lru-layer-waves")])
def test_a_policy_plug_in_run_as_a_script_says_what_it_is(name, policy):
    script = str(BENCHMARKS / f"{name}.py")
    shown = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True)
    assert shown.returncode == 0 and shown.stderr == ""
    text = " ".join(shown.stdout.split())  # as one line, however wrapped
    assert f"`{policy}`" in text and f"--plugin benchmarks/{name}.py --policy" in text
    run = subprocess.run([sys.executable, script], capture_output=True, text=True)
    assert run.returncode == 2 and run.stdout == "" and "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines()[-1].startswith(
        f"{name}.py: error: a policy plug-in, not a script; load it with: expertflow simulate --plugin "
        f"benchmarks/{name}.py --policy ")


# late_next_guess.py: the held-out prompts are always recorded, with progress shown


def test_late_next_guess_lists_no_trace_or_split(monkeypatch, capsys):
    with imported(monkeypatch, "late_next_guess") as late:
        monkeypatch.setattr(sys, "argv", ["late_next_guess.py", "--help"])
        with pytest.raises(SystemExit) as stopped:
            late.main()
        shown = capsys.readouterr().out
        assert stopped.value.code == 0 and "--split" not in shown and "--trace" not in shown
        code, last = _exit(late, monkeypatch, capsys, "--split", "test")
        assert code == 2 and last == "late_next_guess.py: error: unrecognized arguments: --split test"
        code, last = _exit(late, monkeypatch, capsys, "--trace", "/no/such/trace")
        assert code == 2 and last.startswith("late_next_guess.py: error: argument --trace: the second part reads")
        assert last.endswith("drop --trace")


def test_late_next_guess_shows_its_progress_on_stderr(monkeypatch, capsys):
    """Both recordings (held-out and training) and the passes over them show a progress bar on stderr; stdout holds
    only the JSON rows."""
    import torch
    from transformers import AutoTokenizer

    import expertflow.models
    import expertflow.recorder
    from expertflow.models import tiny_moe
    from expertflow.recorder import record

    model = tiny_moe(dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model.name_or_path)
    trace = record(model, ["A short prompt", "Another, rather longer prompt"], tokenizer, batch_size=2,
                   max_new_tokens=2, progress=False)
    capsys.readouterr()
    recorded = []

    class Stop(Exception):
        pass

    def spy(*args, **kwargs):
        recorded.append(kwargs.get("progress", True))
        raise Stop

    with imported(monkeypatch, "late_next_guess") as late:
        late.hidden_states(model, trace)
        captured = capsys.readouterr()
        assert captured.out == "" and "states" in captured.err and "sequence" in captured.err
        monkeypatch.setattr(expertflow.recorder, "record", spy)
        monkeypatch.setattr(expertflow.models, "load_prompts", lambda split: [{"prompt": "A prompt"}])
        with pytest.raises(Stop):
            late.state_rows(model, tokenizer, trace, None)
        ece_sim = sys.modules["ece_sim"]
        with pytest.raises(Stop):
            ece_sim.record_heldout(model, tokenizer, 2)
    assert recorded == [True, True]
