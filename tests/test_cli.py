"""The command line refuses bad arguments at once: exit status 2, one line naming the flag and the fix, nothing
written, no traceback; before any model is loaded or any work is done."""

from __future__ import annotations

import json
import logging
import os


import numpy as np
import pytest

from expertflow import __version__
from expertflow.cli import main
from expertflow.trace import Trace


CASES = [
    (["trace", "record", "--model", "tiny-moe", "--prompts", "{d}/prompts.jsonl", "--limit", "0", "--out",
      "{d}/r.safetensors"], "trace record: error: --limit 0 must be at least 1"),
    (["trace", "record", "--model", "{d}/no-model", "--prompts", "{d}/prompts.jsonl", "--out", "{d}/r.safetensors"],
     "no such directory"),
    (["trace", "record", "--model", "tiny-moe", "--prompts", "{d}/prompts.jsonl", "--out", "{d}"], "is a directory"),
    (["trace", "record", "--model", "tiny-moe", "--prompts", "{d}/prompts.jsonl", "--top-p", "0.5", "--out",
      "{d}/r.safetensors"], "give --temperature too"),
    (["trace", "record", "--model", "tiny-moe", "--prompts", "{d}/t.safetensors", "--out", "{d}/r.safetensors"],
     "is not UTF-8 text"),
    (["trace", "import", "--input", "{d}/empty.jsonl", "--out", "{d}/r.safetensors"], "the file is empty"),
    (["trace", "import", "--input", "{d}/prompts.jsonl", "--top-k", "0", "--out", "{d}/r.safetensors"],
     "--top-k 0 must be at least 1"),
    (["trace", "stats", "{d}"], "is a directory; give a trace file"),
    (["simulate", "--trace", "/dev/null", "--policy", "lru", "--slots", "2"],
     "/dev/null is not a regular file; give a trace file (.safetensors)"),
    (["simulate", "--trace", "{d}/t.safetensors", "--policy", "lru", "--slots", "2", "--plot", "{d}/p.txt"],
     "extension matplotlib can write"),
    (["simulate", "--trace", "{d}/t.safetensors", "--policy", "lru", "--slots", "2", "--token-ms", "3"],
     "--token-ms applies to timed mode"),
    (["simulate", "--trace", "{d}/t.safetensors", "--policy", "lru", "--slots", "2", "--link-gbps", "0",
      "--expert-mb", "1", "--layer-ms", "1"], "--link-gbps 0.0 must be above 0"),
    (["simulate", "--trace", "{d}/t.safetensors", "--policy", "lru", "--slots", "2", "--rebatch", "0"],
     "--rebatch 0 must be at least 1"),
    (["predictor", "eval", "--predictor", "{d}", "--trace", "{d}/t.safetensors", "--threads", "-1"],
     "--threads -1 must be at least 1"),
    (["trace", "record", "--model", "tiny-moe", "--prompts", "{d}/prompts.jsonl", "--temperature", "0", "--out",
      "{d}/r.safetensors"], "--temperature 0.0 must be a finite number of at least 1e-06"),
    (["predictor", "train", "--trace", "{d}/t.safetensors", "--out", "{d}/prompts.jsonl"],
     "is a file; give a directory"),
    (["predictor", "train", "--trace", "{d}/t.safetensors", "--out", "{d}/p", "--epochs", "0"],
     "--epochs 0 must be at least 1"),
    (["demo", "--predictor", "{d}/none", "--policy", "expertflow"], "--predictor {d}/none: no such directory"),
    (["demo", "--transfer-ratio", "0"], "--transfer-ratio 0.0 must be above 0"),
    (["demo", "--transfer-ratio", "inf"], "--transfer-ratio inf must be a finite number above 0"),
    (["simulate", "--trace", "{d}/t.safetensors", "--policy", "lru", "--slots", "2", "--link-gbps", "inf",
      "--expert-mb", "1", "--layer-ms", "1"], "--link-gbps inf must be a finite number above 0"),
    (["simulate", "--trace", "{d}/t.safetensors", "--policy", "lru", "--slots", "2", "--link-gbps", "1",
      "--expert-mb", "1", "--layer-ms", "nan"], "--layer-ms nan must be a finite number of at least 0"),
    (["demo", "--policy", ","], "names no policy"),
    (["demo", "--transfer-ratio", "1e9"], "--transfer-ratio 1e+09 must be at most 1000"),
    # more threads than torch can start crashes inside the OpenMP runtime, with no message
    (["predictor", "train", "--trace", "{d}/t.safetensors", "--out", "{d}/p", "--threads", "100000"],
     "--threads 100000 is more than torch can be sure to start"),
    (["predictor", "eval", "--predictor", "{d}", "--trace", "{d}/t.safetensors", "--threads", "100000"],
     "--threads 100000 is more than torch can be sure to start"),
    (["predictor", "fit-next", "--predictor", "{d}", "--trace", "{d}/t.safetensors", "--threads", "100000"],
     "--threads 100000 is more than torch can be sure to start"),
    (["demo", "--policy", "full,lru", "--predictor", "{d}"], "--predictor {d} is read only by the expertflow policy, "
     "and --policy full,lru leaves it out"),
    (["demo", "--predictor", "{d}/t.safetensors"], "--predictor {d}/t.safetensors: is a file, not a directory"),
    # a name the file system refuses fails before the work, not after it
    (["simulate", "--trace", "{d}/t.safetensors", "--policy", "lru", "--slots", "2", "--plot", "{d}/" + "p" * 300 +
      ".png"], ".png: the name is too long for the file system (File name too long); give a shorter name"),
    (["trace", "import", "--input", "{d}/prompts.jsonl", "--out", "{d}/" + "t" * 300], "the name is too long"),
    # a name that fits, but not the file the save writes first (.NAME.partial)
    (["trace", "import", "--input", "{d}/prompts.jsonl", "--out", "{d}/" + "t" * 250], "the name is too long"),
    (["demo", "--model", "{d}", "--policy", "lru,expertflow"], "policy expertflow with --model needs a route "
     "predictor trained on that model: give --predictor DIR"),
]


@pytest.mark.parametrize("argv, message", CASES, ids=[" ".join(c[0][:2]) + f" {i}" for i, c in enumerate(CASES)])
def test_bad_arguments_fail_at_once_with_one_line(files, capsys, argv, message):
    before = sorted(files.iterdir())
    assert main([a.format(d=files) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message.format(d=files) in err and "Traceback" not in err and len(err.splitlines()) == 1
    assert sorted(files.iterdir()) == before  # nothing written


def test_version_and_verbose_after_the_command(files, capsys):
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.strip() == f"expertflow {__version__}"
    assert main(["trace", "stats", str(files / "t.safetensors"), "--json", "-v"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == 3


def test_missing_subcommand_names_the_choices(capsys):
    with pytest.raises(SystemExit):
        main(["trace"])
    assert "{import,stats,record}" in capsys.readouterr().err


def test_scoring_a_phase_the_trace_lacks_is_an_error():
    from expertflow.predictor.metrics import route_scores
    trace = Trace(experts=np.array([[[0, 1]], [[1, 2]]]), num_experts=4, phase=np.zeros(2, dtype=np.uint8))
    with pytest.raises(ValueError, match="no decode tokens to score"):
        route_scores(trace, np.zeros((2, 1, 4), dtype=bool), 1, "decode")


@pytest.mark.parametrize("phase", ["all", "decode"])
def test_scoring_a_trace_without_tokens_says_so_rather_than_name_another_phase(phase):
    from expertflow.predictor.metrics import route_scores
    trace = Trace(experts=np.zeros((0, 1, 2), dtype=np.int32), num_experts=4)
    with pytest.raises(ValueError, match="^the trace has no tokens: nothing to score; evaluate on a trace recorded "):
        route_scores(trace, np.zeros((0, 1, 4), dtype=bool), 1, phase)


def test_simulate_uses_the_shipped_predictor_for_traces_of_the_built_in_model(tmp_path, capsys):
    rng = np.random.default_rng(0)
    experts = np.stack([[rng.choice(32, 4, replace=False) for _ in range(6)] for _ in range(5)])
    # recorded on another machine: only the path's last parts name the built-in model
    trace = Trace(experts=experts, num_experts=32, token_ids=np.arange(5) + 10,
                  model="/srv/x/expertflow/assets/tiny-moe")
    trace.save(tmp_path / "t.safetensors")
    argv = ["simulate", "--trace", str(tmp_path / "t.safetensors"), "--policy", "expertflow", "--slots", "8", "--json"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["policies"]["expertflow"]["needs"] == 5 * 6 * 4
    # or by its short name, as the benchmarks record it (`--model tiny-moe`)
    Trace(experts=experts, num_experts=32, token_ids=np.arange(5) + 10, model="tiny-moe").save(
        tmp_path / "t.safetensors")
    assert main(argv) == 0 and json.loads(capsys.readouterr().out)["policies"]["expertflow"]["needs"] == 5 * 6 * 4
    Trace(experts=experts, num_experts=32, token_ids=np.arange(5), model="other").save(tmp_path / "t.safetensors")
    assert main(argv) == 2
    assert "needs a route predictor: pass --predictor DIR" in capsys.readouterr().err
    from expertflow.predictor import default_predictor_path  # given, it serves the one policy of a mixed list

    Trace(experts=experts, num_experts=32, token_ids=np.arange(5) + 10, model="tiny-moe").save(
        tmp_path / "t.safetensors")
    mixed = argv[:4] + ["lru,expertflow"] + argv[5:] + ["--predictor", str(default_predictor_path())]
    assert main(mixed) == 0
    assert json.loads(capsys.readouterr().out)["policies"]["expertflow"]["needs"] == 5 * 6 * 4


def test_ctrl_c_is_one_line_and_status_130(files, capsys, monkeypatch):
    from expertflow.commands import simulate

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(simulate, "_simulate", interrupted)
    assert main(["simulate", "--trace", str(files / "t.safetensors"), "--policy", "lru", "--slots", "2"]) == 130
    assert capsys.readouterr().err.strip() == "expertflow simulate: interrupted"


def test_a_reader_that_stops_early_ends_it_quietly(files):
    import subprocess
    import sys

    command = [sys.executable, "-m", "expertflow", "trace", "stats", str(files / "t.safetensors"), "--json"]
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.startswith("{"), done.stderr
    reader_gone = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    reader_gone.stdout.close()  # like `| head` that has already exited: every write fails with a broken pipe
    err = reader_gone.stderr.read()
    assert reader_gone.wait() == 141 and err == "", err


def test_record_keeps_one_split_of_the_prompts(files, capsys):
    rows = [{"id": str(i), "task": "chat", "prompt": "hi", "split": split} for i, split in enumerate(["train", "test"])]
    (files / "split.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["trace", "record", "--model", "tiny-moe", "--prompts", str(files / "split.jsonl"), "--out",
            str(files / "r.safetensors"), "--max-new-tokens", "2"]
    assert main(argv + ["--split", "dev"]) == 2
    assert "has no prompts of split 'dev'" in capsys.readouterr().err
    assert main(argv + ["--split", "test"]) == 0
    assert len(np.unique(Trace.load(files / "r.safetensors").seq_ids)) == 1


def test_demo_on_a_given_model_runs_the_baselines_without_a_predictor(tmp_path, capsys):
    """The default policies leave `expertflow` out when --model comes without --predictor (the built-in predictor
    belongs to the built-in model)."""
    from families import make_tiny

    make_tiny("qwen2_moe").save_pretrained(tmp_path)  # no tokenizer: random prompt ids
    assert main(["demo", "--model", str(tmp_path), "--max-new-tokens", "2", "--cache-fraction", "0.5", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [run["policy"] for run in report["runs"]] == ["full", "lru-layer", "lru"]
    assert all(run["matches_full"] for run in report["runs"])
    assert report["runs"][1]["slots"] == report["experts"] // 2


def test_demo_refuses_a_predictor_that_is_not_one_before_any_run(tmp_path, capsys):
    assert main(["demo", "--predictor", str(tmp_path), "--policy", "full,expertflow"]) == 2
    err = capsys.readouterr().err
    assert f"--predictor {tmp_path}: predictor='{tmp_path}' could not be loaded" in err and "Traceback" not in err


def test_record_uses_the_cache_when_the_generation_config_turns_it_off(files, capsys):
    """A checkpoint saved with use_cache false (common after fine-tuning) records the same routes."""
    from expertflow.models import tiny_moe_path

    model = files / "no-cache"
    model.mkdir()
    for f in tiny_moe_path().iterdir():
        if f.name != "generation_config.json":
            (model / f.name).symlink_to(f)
    config = json.loads((tiny_moe_path() / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**config, "use_cache": False}))
    for name, path in (("a", "tiny-moe"), ("b", str(model))):
        assert main(["trace", "record", "--model", path, "--prompts", str(files / "prompts.jsonl"), "--out",
                     str(files / f"{name}.safetensors"), "--max-new-tokens", "3"]) == 0, capsys.readouterr().err
    with_cache, without = (Trace.load(files / f"{name}.safetensors") for name in "ab")
    assert with_cache.num_tokens > 2 and np.array_equal(with_cache.experts, without.experts)


def test_integers_beyond_float_range_are_checked_without_overflow(files, capsys):
    big = "1" + "0" * 400
    assert main(["trace", "import", "--input", str(files / "prompts.jsonl"), "--top-k", "-" + big, "--out",
                 str(files / "r.safetensors")]) == 2
    assert f"--top-k -{big} must be at least 1" in capsys.readouterr().err
    assert main(["simulate", "--trace", str(files / "t.safetensors"), "--policy", "lru", "--slots", big,
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["capacity_slots"] >= 4


def test_simulate_prints_its_report_even_when_the_plot_cannot_be_written(files, capsys, monkeypatch):
    from matplotlib.figure import Figure

    def full(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", full)
    plot = files / "p.png"
    argv = ["simulate", "--trace", str(files / "t.safetensors"), "--policy", "lru", "--slots", "2", "--plot", str(plot)]
    assert main(argv + ["--json"]) == 2
    out, err = capsys.readouterr()
    assert json.loads(out)["policies"]["lru"]["needs"] == 6  # the results computed are not lost
    assert err.strip() == (f"expertflow simulate: error: --plot {plot}: cannot write it (No space left on device); "
                           "give a writable place with enough space")
    assert main(argv) == 2
    assert capsys.readouterr().out.startswith("toy: 3 tokens") and not plot.exists()


def test_a_plot_file_that_is_a_broken_link_fails_before_the_work(files, capsys):
    plot = files / "p.png"
    plot.symlink_to(files / "no-such-folder" / "p.png")
    argv = ["simulate", "--trace", str(files / "t.safetensors"), "--policy", "lru", "--slots", "2", "--plot", str(plot)]
    assert main(argv + ["--json"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.strip() == (f"expertflow simulate: error: --plot {plot}: it links to "
                                         f"{files / 'no-such-folder' / 'p.png'}, in a folder that does not exist; "
                                         "give a writable file")


def test_the_output_checks_never_touch_the_name_they_check(files, monkeypatch):
    """The name itself is neither created nor removed: another run's finished file under it could be removed, and a
    folder watcher would see an empty file."""
    import builtins

    from expertflow.commands import check_output_file, check_plot_file

    out, plot = files / "new.safetensors", files / "new.png"
    opened, removed = [], []
    real_open, real_remove = builtins.open, os.remove
    monkeypatch.setattr(builtins, "open", lambda f, *a, **k: opened.append(str(f)) or real_open(f, *a, **k))
    monkeypatch.setattr(os, "remove", lambda f, *a, **k: removed.append(str(f)) or real_remove(f, *a, **k))
    check_output_file(str(out))
    check_plot_file(str(plot))
    assert not {str(out), str(plot)} & set(opened + removed) and not out.exists() and not plot.exists()


def test_the_plot_check_keeps_an_existing_plot_as_it_is(files):
    from expertflow.commands import check_plot_file

    plot = files / "p.png"
    plot.write_bytes(b"x" * 5000)
    os.utime(plot, (1_000_000, 1_000_000))
    check_plot_file(str(plot))
    assert plot.read_bytes() == b"x" * 5000 and plot.stat().st_mtime == 1_000_000  # a failed run loses nothing


def test_a_plot_file_that_is_a_pipe_is_not_opened_by_the_check(files):
    """Opening a named pipe would end its reader's input before the plot is drawn (or block with no reader)."""
    import threading

    from expertflow.commands import check_plot_file

    pipe = files / "p.svg"
    os.mkfifo(pipe)
    checked = threading.Thread(target=check_plot_file, args=(str(pipe),), daemon=True)
    checked.start()
    checked.join(5)
    if checked.is_alive():  # blocked in open(): give it a reader so that the thread ends
        with open(pipe, "rb"):
            pass
    assert not checked.is_alive(), "the check opened the pipe"


def test_simulate_joins_policies_given_twice_and_refuses_a_second_trace(files, capsys):
    """argparse keeps the last of a repeated flag: `--policy lru --policy belady` ran belady alone, and a second
    --trace replaced the first (where `predictor` commands read every --trace)."""
    trace = str(files / "t.safetensors")
    assert main(["simulate", "--trace", trace, "--policy", "lru", "--policy", "belady,lru", "--slots", "2",
                 "--json"]) == 0
    assert list(json.loads(capsys.readouterr().out)["policies"]) == ["lru", "belady"]
    with pytest.raises(SystemExit) as exit_:
        main(["simulate", "--trace", str(files / "other.safetensors"), "--trace", trace, "--policy", "lru", "--slots",
              "2"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"expertflow simulate: error: --trace given twice ({files / 'other.safetensors'} and {trace}): simulate "
        "replays one trace; run it once per trace")


def test_a_pgf_plot_without_tex_is_refused_before_the_work(files, capsys, monkeypatch):
    import shutil

    from matplotlib import rcParams

    real_which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None if name == rcParams["pgf.texsystem"] else
                        real_which(name, *a, **k))
    plot = files / "p.pgf"
    argv = ["simulate", "--trace", str(files / "t.safetensors"), "--policy", "lru", "--slots", "2", "--plot", str(plot)]
    assert main(argv) == 2  # matplotlib ran the TeX system after the work: a traceback, exit 1
    out, err = capsys.readouterr()
    assert out == "" and err.strip() == (f"expertflow simulate: error: --plot {plot}: .pgf is written with "
                                         f"{rcParams['pgf.texsystem']} (TeX), which is not installed; give a .png, "
                                         ".svg or .pdf file")


def test_simulate_table_columns_stay_under_their_heads_for_a_long_policy_name(files, capsys, registry):
    from expertflow.policy import register_policy
    from expertflow.policy.lru import LRUPolicy

    @register_policy
    class Long(LRUPolicy):
        name = "lru-with-a-long-name"

    assert main(["simulate", "--trace", str(files / "t.safetensors"), "--policy", "lru,lru-with-a-long-name",
                 "--slots", "2"]) == 0
    head, *rows = capsys.readouterr().out.splitlines()[1:]
    assert len(rows) == 2 and all(len(row) == len(head) for row in rows)  # every column ends under its head


def test_a_long_model_name_keeps_its_end_in_the_plot_title(tmp_path, capsys, monkeypatch):
    from matplotlib.figure import Figure

    titles = []
    monkeypatch.setattr(Figure, "suptitle", lambda self, text, **kwargs: titles.append(text))
    monkeypatch.setattr(Figure, "savefig", lambda self, *args, **kwargs: None)
    model = "/home/someone/" + "models/" * 12 + "Qwen3-30B-A3B-Instruct-2507"
    Trace(experts=np.array([[[0, 1]], [[1, 2]]]), num_experts=4, model=model).save(tmp_path / "t.safetensors")
    assert main(["simulate", "--trace", str(tmp_path / "t.safetensors"), "--policy", "lru", "--slots", "2",
                 "--plot", str(tmp_path / "p.png")]) == 0
    first, second = titles[-1].split("\n")
    assert len(first) == 72 and first.startswith("…") and model.endswith(first[1:])
    assert second == "2 tokens, counting mode"


def test_simulate_names_the_batching_in_its_report_and_plot_title(tmp_path, capsys, monkeypatch):
    """A replay of several sequences at a time is another workload: the report's first line and the plot's title say
    so, with the number of steps (a batch larger than the trace's sequences replays them all at once); a replay as
    recorded says nothing of it."""
    from matplotlib.figure import Figure

    titles = []
    monkeypatch.setattr(Figure, "suptitle", lambda self, text, **kwargs: titles.append(text))
    monkeypatch.setattr(Figure, "savefig", lambda self, *args, **kwargs: None)
    experts = np.array([[[0, 1]], [[1, 2]], [[2, 3]], [[3, 0]], [[0, 2]], [[1, 3]]])  # 3 sequences of 2 tokens
    Trace(experts=experts, num_experts=4, model="toy", seq_ids=np.repeat(np.arange(3), 2),
          positions=np.tile(np.arange(2), 3), steps=np.arange(6)).save(tmp_path / "t.safetensors")
    argv = ["simulate", "--trace", str(tmp_path / "t.safetensors"), "--policy", "lru", "--slots", "2", "--plot",
            str(tmp_path / "p.png")]
    assert main(argv + ["--rebatch", "2"]) == 0  # sequences 0 and 1 together (2 steps), then 2 alone (2 steps)
    assert capsys.readouterr().out.startswith(
        "toy: 6 tokens in 4 steps (2 sequences at a time, --rebatch 2), capacity 2 of 4 expert slots")
    assert titles[-1] == "toy\n6 tokens in 4 steps (2 sequences at a time, --rebatch 2), counting mode"
    assert main(argv + ["--rebatch", "1"]) == 0
    assert "in 6 steps (one sequence at a time, --rebatch 1)," in capsys.readouterr().out
    assert main(argv + ["--rebatch", "5"]) == 0
    assert capsys.readouterr().out.startswith("toy: 6 tokens in 2 steps (all 3 sequences at once, --rebatch 5),")
    assert titles[-1] == "toy\n6 tokens in 2 steps (all 3 sequences at once, --rebatch 5), counting mode"
    assert main(argv) == 0
    assert capsys.readouterr().out.startswith("toy: 6 tokens, capacity 2 of 4 expert slots")
    assert titles[-1] == "toy\n6 tokens, counting mode"
    Trace(experts=experts, num_experts=4, model="toy").save(tmp_path / "one.safetensors")  # one sequence
    argv[2] = str(tmp_path / "one.safetensors")
    assert main(argv + ["--rebatch", "4"]) == 0
    assert capsys.readouterr().out.startswith("toy: 6 tokens in 6 steps (its one sequence, --rebatch 4),")


@pytest.mark.parametrize("asks", [{"num_beams": 3, "num_return_sequences": 2}, {"penalty_alpha": 0.6, "top_k": 4},
                                  {"prompt_lookup_num_tokens": 2}, {"return_dict_in_generate": True,
                                                                    "output_scores": True},
                                  {"guidance_scale": 1.5}, {"prefill_chunk_size": 2}, {"stop_strings": ["."]}],
                         ids=["beams", "contrastive", "prompt-lookup", "dict", "guidance", "chunked", "stop-strings"])
def test_record_decodes_one_sequence_per_prompt_whatever_the_generation_config_asks(files, capsys, asks):
    """Beams, several sequences, contrastive search, candidate tokens, a prompt in chunks or guidance's second
    forward in a checkpoint's generation config would compute other rows than one per sequence and token, and stop
    strings end sequences the recorder cannot see: the recording is greedy (or sampled) as documented."""
    from expertflow.models import tiny_moe_path

    model = files / "asks"
    model.mkdir()
    for f in tiny_moe_path().iterdir():
        if f.name != "generation_config.json":
            (model / f.name).symlink_to(f)
    config = json.loads((tiny_moe_path() / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**config, **asks}))
    rows = [{"prompt": p} for p in ("hi", "a longer prompt than that")]
    (files / "two.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for name, path in (("a", "tiny-moe"), ("b", str(model))):
        assert main(["trace", "record", "--model", path, "--prompts", str(files / "two.jsonl"), "--out",
                     str(files / f"{name}.safetensors"), "--max-new-tokens", "4", "--batch-size", "2"]) == 0, \
            capsys.readouterr().err
    plain, asked = (Trace.load(files / f"{name}.safetensors") for name in "ab")
    assert plain.num_tokens > 4 and np.array_equal(plain.experts, asked.experts)
    assert np.array_equal(plain.token_ids, asked.token_ids)


def test_demo_takes_the_built_in_model_by_name_or_directory_with_its_predictor(tmp_path, capsys, monkeypatch):
    """`--model tiny-moe`, the built-in model's directory or a link to it are the built-in model: `expertflow` runs
    with the shipped predictor, as with no --model (the demo itself is not run here)."""
    import expertflow.demo as demo
    from expertflow.models import tiny_moe_path

    (tmp_path / "link").symlink_to(tiny_moe_path())
    given = []

    def run_demo(model_path, policies, *args, **kwargs):
        given.append((model_path, policies))
        return {"runs": []}

    class Checked(Exception):
        pass

    def check_policies(policies, model_path, predictor):
        raise Checked(policies, model_path)

    for model in ("tiny-moe", str(tiny_moe_path()), str(tmp_path / "link")):
        demo.check_policies(("lru", "expertflow"), model, None)  # no refusal: the shipped predictor fits
        with monkeypatch.context() as m:
            m.setattr(demo, "run_demo", run_demo)
            assert main(["demo", "--model", model, "--policy", "full,expertflow", "--json"]) == 0, \
                capsys.readouterr().err
        assert given.pop() == (None, ("full", "expertflow"))
        with monkeypatch.context() as m:
            m.setattr(demo, "check_policies", check_policies)
            with pytest.raises(Checked) as checked:  # run_demo from Python: the built-in model, expertflow kept
                demo.run_demo(model)
            assert checked.value.args == (demo.default_policies(), None) and "expertflow" in checked.value.args[0]
    with pytest.raises(ValueError, match="with --model needs a route predictor trained on that model"):
        demo.check_policies(("expertflow",), str(tmp_path), None)


# -- the top-level command -------------------------------------------------------------------------------------------

def test_no_command_prints_the_usage_and_exits_2(capsys):
    assert main([]) == 2
    assert "usage: expertflow" in capsys.readouterr().out


def test_a_missing_model_directory_is_one_line_and_status_2(tmp_path, capsys):
    """A command's OSError (the demo's missing --model directory) is a user error like a ValueError."""
    assert main(["demo", "--model", str(tmp_path / "none"), "--policy", "lru"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"expertflow demo: error: --model {tmp_path / 'none'}: no such directory")
    assert len(err.splitlines()) == 1 and "Traceback" not in err


def test_verbose_before_the_command_is_kept(files, monkeypatch, capsys):
    levels = []
    monkeypatch.setattr(logging, "basicConfig", lambda **kw: levels.append(kw["level"]))
    assert main(["-v", "trace", "stats", str(files / "t.safetensors"), "--json"]) == 0
    assert main(["trace", "stats", str(files / "t.safetensors"), "--json"]) == 0
    assert levels == [logging.INFO, logging.WARNING]


def _commands(parser) -> set[str]:
    return {name for action in parser._actions if hasattr(action, "choices") and isinstance(action.choices, dict)
            for name in action.choices}


def test_a_command_whose_own_import_fails_is_an_error_not_a_missing_command(monkeypatch):
    import expertflow.cli as cli

    real = cli.importlib.import_module

    def failing(missing):
        def import_module(name, *args):
            if name == "expertflow.commands.simulate":
                raise ModuleNotFoundError(f"No module named {missing!r}", name=missing)
            return real(name, *args)
        return import_module

    monkeypatch.setattr(cli.importlib, "import_module", failing("expertflow.commands.simulate"))
    assert "simulate" not in _commands(cli.build_parser())  # a command this build does not ship: left out
    monkeypatch.setattr(cli.importlib, "import_module", failing("matplotlib"))
    with pytest.raises(ModuleNotFoundError, match="matplotlib"):  # a broken install: said, not hidden
        cli.build_parser()


def test_an_output_file_in_a_missing_directory_says_to_create_it(files, capsys):
    out = files / "no" / "t.safetensors"
    assert main(["trace", "import", "--input", str(files / "prompts.jsonl"), "--out", str(out)]) == 2
    assert f"--out {out}: the directory {files / 'no'} does not exist; create it first" in capsys.readouterr().err


# -- trace record and import -----------------------------------------------------------------------------------------

_TOO_SMALL = ("must be a finite number of at least 1e-06 (a smaller one divides the logits past float32's range); "
              "leave it out to decode greedily")


@pytest.mark.parametrize("flags, message", [
    (["--max-prompt-tokens", "0"], "--max-prompt-tokens 0 must be at least 1"),
    (["--batch-size", "0"], "--batch-size 0 must be at least 1"),
    (["--temperature", "1", "--top-p", "0"], "--top-p 0.0 must be in (0, 1]"),
    # torch maps a negative seed onto another one (-1 sampled as 2**64-1 does) and overflows past 64 bits, late
    (["--temperature", "1", "--seed", "-1"], "--seed -1 must be in [0, 2**64) (torch's seed range)"),
    (["--temperature", "1", "--seed", str(2**64)],
     "--seed 18446744073709551616 must be in [0, 2**64) (torch's seed range)"),
    (["--seed", "3"], "--seed 3 applies to sampling: give --temperature too (greedy by default)"),
    # float32 logits divided by it overflow: sampling failed on infinite scores after the model had loaded
    (["--temperature", "1e-40"], f"--temperature 1e-40 {_TOO_SMALL}"),
    (["--temperature", "inf"], f"--temperature inf {_TOO_SMALL}"),
])
def test_record_refuses_bad_flags_at_once(files, capsys, flags, message):
    before = sorted(files.iterdir())
    assert main(["trace", "record", "--model", "tiny-moe", "--prompts", str(files / "prompts.jsonl"), "--out",
                 str(files / "r.safetensors"), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"expertflow trace record: error: {message}"
    assert sorted(files.iterdir()) == before


def test_record_stores_a_relative_model_directory_as_an_absolute_path(files, capsys, monkeypatch):
    import expertflow.recorder as recorder
    from expertflow.models import tiny_moe_path

    (files / "m").symlink_to(tiny_moe_path())
    names = []

    class Stop(Exception):
        pass

    def record(model, prompts, **kwargs):
        names.append(kwargs["model_name"])
        raise Stop

    monkeypatch.setattr(recorder, "record", record)
    monkeypatch.chdir(files)
    with pytest.raises(Stop):
        main(["trace", "record", "--model", "m", "--prompts", "prompts.jsonl", "--out", "r.safetensors"])
    assert names == [str(files / "m")]


def test_record_says_an_encoder_decoder_model_is_not_recorded(files, capsys):
    """A saved Switch model cannot load as a causal LM; the error says why, not to give a MoE model directory."""
    from transformers import AutoTokenizer

    from expertflow.models import tiny_moe_path
    from families import make_tiny

    model = files / "switch"
    make_tiny("switch_transformers").save_pretrained(model)
    AutoTokenizer.from_pretrained(tiny_moe_path()).save_pretrained(model)
    capsys.readouterr()  # the save's progress bar
    assert main(["trace", "record", "--model", str(model), "--prompts", str(files / "prompts.jsonl"), "--out",
                 str(files / "r.safetensors")]) == 2
    err = capsys.readouterr().err
    assert err == (f"expertflow trace record: error: --model {model}: trace recording supports decoder-only models; "
                   "encoder-decoder models (Switch) are not recorded yet (its config describes an encoder-decoder "
                   "model); give a decoder-only MoE model directory or 'tiny-moe'\n")
    assert not (files / "r.safetensors").exists()


def test_import_refuses_num_experts_0_naming_the_flag(files, capsys):
    assert main(["trace", "import", "--input", str(files / "prompts.jsonl"), "--num-experts", "0", "--out",
                 str(files / "r.safetensors")]) == 2
    assert "expertflow trace import: error: --num-experts 0 must be at least 1" in capsys.readouterr().err


# -- demo (run_demo replaced, as in test_demo_takes_the_built_in_model_by_name_or_directory_with_its_predictor) -------

def _demo_report(matches: bool = True) -> dict:
    run = {"policy": "lru", "cache_fraction": 0.5, "slots": 96, "device_bytes": 2_000_000, "full_bytes": 8_000_000,
           "hit_rate": 0.25, "loads_per_token": 1.5, "tokens_per_s": 10.0, "new_tokens": 8, "matches_full": matches,
           "on_demand_rate": 0.125, "prefetch_precision": None, "device_fraction": 0.25}
    return {"model": "m", "moe_layers": 6, "experts": 192, "batch_size": 4, "max_new_tokens": 2,
            "transfer_over_compute": 8.0, "layer_compute_ms": 1.0, "emulated_link_bytes_per_s": 1e6, "runs": [run]}


@pytest.fixture
def fake_demo(monkeypatch):
    """run_demo replaced: records its arguments and returns `fake_demo.report`."""
    import expertflow.demo as demo

    class Fake:
        calls: list = []
        report = _demo_report()

    def run_demo(model_path, policies, fractions, max_new_tokens, transfer_ratio, **kwargs):
        Fake.calls.append(dict(policies=policies, fractions=fractions, max_new_tokens=max_new_tokens, **kwargs))
        return Fake.report

    monkeypatch.setattr(demo, "run_demo", run_demo)
    Fake.calls = []
    return Fake


@pytest.mark.parametrize("argv, message", [
    (["--policy", "full,fifo"], "unknown policy fifo; choose from full, lru"),
    (["--cache-fraction", "0"], "--cache-fraction values must be in (0, 1], got 0"),
    (["--cache-fraction", "a,b"], "--cache-fraction 'a,b' must be numbers such as 0.25,0.5"),
    (["--max-new-tokens", "0"], "--max-new-tokens 0 must be at least 1"),
])
def test_demo_refuses_bad_flags_before_any_run(fake_demo, capsys, argv, message):
    assert main(["demo", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"expertflow demo: error: {message}") and "\n" not in err and fake_demo.calls == []


def test_demo_takes_cache_fraction_1_and_every_live_policy(fake_demo, capsys):
    from expertflow.config import POLICIES
    from expertflow.policy.base import policy_class, policy_names

    live = [n for n in policy_names(include_oracles=False)  # the built-in ones: a plug-in a test imported is not
            if policy_class(n).__module__.startswith("expertflow.policy.")]
    assert sorted(live) == sorted(POLICIES)
    assert main(["demo", "--cache-fraction", "1", "--policy", ",".join(("full",) + tuple(live)), "--json"]) == 0
    assert fake_demo.calls[-1]["fractions"] == (1.0,) and fake_demo.calls[-1]["policies"] == ("full", *live)


def test_demo_runs_a_repeated_policy_or_fraction_once(fake_demo, capsys):
    assert main(["demo", "--cache-fraction", "0.5,0.25,0.50,.5", "--policy", "full,lru, full,lru ", "--json"]) == 0
    assert fake_demo.calls[-1]["fractions"] == (0.5, 0.25) and fake_demo.calls[-1]["policies"] == ("full", "lru")


def test_demo_lists_given_twice_join(fake_demo, capsys):
    """argparse keeps the last of a repeated flag: `--policy lru --policy lfu` ran lfu alone."""
    assert main(["demo", "--policy", "full,lru", "--policy", "lfu", "--cache-fraction", "0.5", "--cache-fraction",
                 "0.25", "--json"]) == 0
    assert fake_demo.calls[-1]["policies"] == ("full", "lru", "lfu") and fake_demo.calls[-1]["fractions"] == (0.5, 0.25)
    assert main(["demo", "--json"]) == 0
    assert fake_demo.calls[-1]["policies"] is None and fake_demo.calls[-1]["fractions"] == (0.25, 0.5)


def test_demo_takes_a_namespace_of_strings_and_leaves_it_as_it_was(fake_demo, capsys):
    """A caller's own Namespace holds the lists as strings (argparse gives lists of them now): not read letter by
    letter, nor changed, so that it can be run again."""
    import argparse

    from expertflow.commands.demo import _demo

    args = argparse.Namespace(model=None, policy="full,lru", cache_fraction="0.25", predictor=None, max_new_tokens=2,
                              transfer_ratio=8.0, json=True)
    before = dict(vars(args))
    assert _demo(args) == 0 and _demo(args) == 0 and vars(args) == before
    assert fake_demo.calls[-1]["policies"] == ("full", "lru") and fake_demo.calls[-1]["fractions"] == (0.25,)


def test_demo_exits_1_and_says_no_when_a_run_changed_the_tokens(fake_demo, capsys):
    assert main(["demo"]) == 0
    row = capsys.readouterr().out.splitlines()[-1].split()
    assert row[-1] == "yes" and "12.5%" in row  # the on-demand column
    fake_demo.report = _demo_report(matches=False)
    assert main(["demo"]) == 1
    assert capsys.readouterr().out.splitlines()[-1].split()[-1] == "NO"


def test_demo_json_runs_quietly(fake_demo, capsys):
    assert main(["demo", "--json"]) == 0 and main(["demo"]) == 0
    assert [c["quiet"] for c in fake_demo.calls] == [True, False]


@pytest.mark.parametrize("given, problem", [
    ("t.safetensors", "is a file, not a directory"),
    ("empty", "has no config.json"),
    ("broken", "cannot load it as a Hugging Face model"),
], ids=["file", "no-config", "bad-config"])
def test_demo_model_that_is_not_a_saved_model_names_the_flag_and_the_fix(files, capsys, given, problem):
    (files / "empty").mkdir()
    (files / "broken").mkdir()
    (files / "broken" / "config.json").write_text("{not json")
    model = files / given
    assert main(["demo", "--model", str(model), "--policy", "full,lru"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"expertflow demo: error: --model {model}: {problem}")
    assert "give a saved Hugging Face MoE model directory" in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize("field, value, problem", [
    # a value of the wrong type: huggingface_hub's validation raises an error of its own (a traceback, exit 1)
    ("num_local_experts", "8", "(Validation error for field 'num_local_experts': TypeError: Field 'num_local_experts' "
                               "expected int, got str"),
    ("intermediate_size", -24, "causal LM (Trying to create tensor with negative dimension"),  # a RuntimeError
])
def test_a_saved_model_whose_config_holds_a_bad_value_is_refused_in_one_line(tmp_path, capsys, field, value, problem):
    from families import make_tiny
    from transformers import AutoTokenizer

    from expertflow.models import tiny_moe_path

    make_tiny("mixtral").save_pretrained(tmp_path / "m")
    AutoTokenizer.from_pretrained(tiny_moe_path()).save_pretrained(tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, field: value}))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    capsys.readouterr()  # the save's progress bar
    for argv in (["demo", "--policy", "full,lru"], ["trace", "record", "--prompts", str(prompts), "--out",
                                                   str(tmp_path / "t.safetensors")]):
        assert main([*argv, "--model", str(tmp_path / "m")]) == 2
        err = capsys.readouterr().err.strip()
        assert f"error: --model {tmp_path / 'm'}: cannot load it as a Hugging Face " in err and problem in err
        assert len(err.splitlines()) == 1 and "Traceback" not in err


def test_memory_running_out_while_loading_a_model_is_not_called_a_bad_model(tmp_path, monkeypatch):
    """Only errors that say the directory is not a model's are refused as such (exit 2, 'give a saved model'): the
    allocator failing on a valid one is raised as it is."""
    from families import make_tiny
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from expertflow.models import tiny_moe_path

    make_tiny("mixtral").save_pretrained(tmp_path / "m")
    AutoTokenizer.from_pretrained(tiny_moe_path()).save_pretrained(tmp_path / "m")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("unable to mmap 117994160 bytes: Cannot allocate memory (12)")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", out_of_memory)
    for argv in (["demo", "--policy", "full,lru"], ["trace", "record", "--prompts", str(prompts), "--out",
                                                   str(tmp_path / "t.safetensors")]):
        with pytest.raises(RuntimeError, match="Cannot allocate memory"):
            main([*argv, "--model", str(tmp_path / "m")])


@pytest.mark.parametrize("argv", [
    ["trace", "record", "--model", "tiny-moe", "--prompts", "none.jsonl", "--out", "t.st"],
    ["demo", "--model", "tiny-moe", "--cache-fraction", "2"]])
def test_a_directory_named_tiny_moe_in_the_working_directory_is_said_not_to_be_used(argv, tmp_path, monkeypatch,
                                                                                    capsys):
    """`--model tiny-moe` is the built-in model's name: where a directory of that name is at hand, a note says it is
    not used and how to give it; with no such directory, or the built-in model's own, no note."""
    monkeypatch.chdir(tmp_path)
    main(argv)
    assert "note: --model tiny-moe names the built-in model" not in capsys.readouterr().err
    (tmp_path / "tiny-moe").mkdir()
    main(argv)
    err = capsys.readouterr().err
    assert (f"expertflow {' '.join(argv[:2]) if argv[0] == 'trace' else 'demo'}: note: --model tiny-moe names the "
            "built-in model; the directory tiny-moe here is not used (give ./tiny-moe for it)") in err
