"""Bad input on the trace and predictor paths: one clear error naming the file (or flag) and the fix, status 2 from
the command line, and nothing half-written left behind; and the `predictor` commands' flags, defaults and summaries."""

from __future__ import annotations

import dataclasses
import json
import os
import re

import numpy as np
import pytest
from safetensors.numpy import save_file

import expertflow.trace as trace_module
from expertflow.cli import main
from expertflow.predictor.train import TrainConfig, train
from expertflow.trace import FORMAT, Trace, TraceFormatError
from test_predictor import TINY_TRAINING, synthetic_trace


def _trace(model: str = "toy", layers: int = 1, experts: int = 4, sequences: int = 2, tokens: int = 3) -> Trace:
    n = sequences * tokens
    ids = (np.arange(n * layers * 2).reshape(n, layers, 2) % experts).astype(np.int32)
    return Trace(experts=ids, num_experts=experts, token_ids=np.arange(n) % 7 + 1,
                 seq_ids=np.repeat(np.arange(sequences), tokens), positions=np.tile(np.arange(tokens), sequences),
                 steps=np.arange(n), phase=np.tile([0] + [1] * (tokens - 1), sequences), model=model)


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


# -- trace files ---------------------------------------------------------------------------------------------------

def _rewrite(path, **meta) -> None:
    from safetensors import safe_open

    with safe_open(str(path), framework="np") as f:
        tensors, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    save_file(tensors, str(path), metadata={**metadata, **meta})


@pytest.mark.parametrize("meta, message", [
    ({"format": "expertflow.trace/2"}, "comes from another version of expertflow; this one reads "
                                       "'expertflow.trace/1': record or import the trace again"),
    ({"layer_ids": '{"a": 1}'}, "layer_ids='{\"a\": 1}' must be a JSON list of the model's layer indices"),
    ({"layer_ids": "[0, 1]"}, "t.safetensors: layer_ids has 2 entries for 1 MoE layers"),
    # lists nested past Python's recursion limit: named, and shown cut short
    ({"layer_ids": "[" * 10**5 + "]" * 10**5}, "layer_ids='" + "[" * 77 + "…' must be a JSON list"),
    ({"num_experts": "2"}, "t.safetensors: expert ids must lie in [-1, 2)"),
])
def test_trace_file_errors_name_the_file_and_the_fix(tmp_path, capsys, meta, message):
    path = tmp_path / "t.safetensors"
    _trace().save(path)
    _rewrite(path, **meta)
    with pytest.raises(TraceFormatError) as err:
        Trace.load(path)
    assert message in str(err.value)
    code, out, err_text = _cli(capsys, "trace", "stats", path, "--json")
    assert code == 2 and out == "" and message in err_text and len(err_text.strip().splitlines()) == 1


def test_failed_save_leaves_the_old_file_and_no_partial_one(tmp_path, monkeypatch):
    import safetensors.numpy

    path = tmp_path / "t.safetensors"
    _trace().save(path)
    before = path.read_bytes()

    def torn(tensors, filename, metadata=None):
        open(filename, "wb").write(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.numpy, "save_file", torn)
    with pytest.raises(OSError, match="disk full"):
        _trace(tokens=5).save(path)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["t.safetensors"]


def test_rebatch_and_per_sequence_load_with_scattered_sequence_ids():
    # rows out of order; sequences 4, 7 and 9 in ascending id; seq 9 has a two-token prefill step
    trace = Trace(experts=np.array([[[0]], [[1]], [[2]], [[3]], [[0]], [[0]]]), num_experts=4,
                  seq_ids=[9, 4, 9, 4, 9, 7], steps=[5, 2, 5, 3, 6, 0], positions=[0, 0, 1, 1, 2, 0])
    assert trace.rebatch(2).steps.tolist() == [2, 0, 2, 1, 3, 0]  # sequences 4 and 7, then 9
    assert trace.rebatch(1).steps.tolist() == [3, 0, 3, 1, 4, 2]
    # within seq 4: experts 1, 3 -> max/mean 1 / 0.5 = 2; seq 9: 0, 2, 0 -> 2 / 0.75; seq 7: 1 / 0.25 = 4
    assert trace.stats()["load_max_over_mean"]["per_sequence"] == round((2 * 2 + 3 * 2.6667 + 4) / 6, 4)
    assert trace_module.Trace.stats(Trace(experts=np.zeros((0, 1, 1)), num_experts=2))["tokens"] == 0


def test_format_name_is_unchanged():
    assert FORMAT == "expertflow.trace/1" and json.loads(_trace().metadata()["layer_ids"]) == [0]


# -- trace import --------------------------------------------------------------------------------------------------

def _log(path, layers: int, k: int, tokens: int = 2) -> str:
    rows = [{"seq": 0, "token_idx": t, "layer": layer, "experts": list(range(k))}
            for t in range(tokens) for layer in range(layers)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_import_refuses_logs_of_different_models(tmp_path, capsys):
    a, b = _log(tmp_path / "a.jsonl", 2, 2), _log(tmp_path / "b.jsonl", 2, 4)
    code, out, err = _cli(capsys, "trace", "import", "--input", a, b, "--out", tmp_path / "t.safetensors", "--json")
    assert code == 2 and out == "" and not (tmp_path / "t.safetensors").exists()
    assert err.strip().endswith("come from different models (experts per token 2 vs 4). Fix: import each model's "
                                "logs into a trace of its own")
    c = _log(tmp_path / "c.jsonl", 3, 2)
    code, _, err = _cli(capsys, "trace", "import", "--input", a, c, "--out", tmp_path / "t.safetensors")
    assert code == 2 and "(MoE layers 0..1 vs 0..2)" in err


def test_import_json_is_quiet_and_bad_files_are_named(tmp_path, capsys):
    a = _log(tmp_path / "a.jsonl", 2, 2)
    code, out, err = _cli(capsys, "trace", "import", "--input", a, "--out", tmp_path / "t.safetensors", "--json")
    assert code == 0 and err == "" and json.loads(out)["sequences"] == 1
    code, _, err = _cli(capsys, "trace", "import", "--input", tmp_path / "none.jsonl", "--out", tmp_path / "u")
    assert code == 2 and err == f"expertflow trace import: error: {tmp_path / 'none.jsonl'}: no such file. Fix: " \
                                "give an existing JSONL routing log\n"
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'\xef\xbb\xbf{"layer": 0, "experts": [1]}\n\n{"layer": 0, "experts": [\xff]}\n')
    code, _, err = _cli(capsys, "trace", "import", "--input", bad, "--out", tmp_path / "u")
    assert code == 2 and f"{bad}:3: not UTF-8 text" in err and not (tmp_path / "u").exists()


def test_out_is_checked_before_the_work(tmp_path, capsys, monkeypatch):
    import tempfile

    a = tmp_path / "a.jsonl"
    _log(a, 2, 2)
    before = a.read_bytes()
    code, _, err = _cli(capsys, "trace", "import", "--input", a, "--out", a)
    assert code == 2 and f"--out {a} is the input {a}; write the result to another file" in err
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hello"}\n')
    code, _, err = _cli(capsys, "trace", "record", "--model", "tiny-moe", "--prompts", prompts, "--out", prompts)
    assert code == 2 and f"--out {prompts} is the input {prompts}" in err
    assert a.read_bytes() == before and prompts.read_text() == '{"prompt": "hello"}\n'

    def refused(*args, **kwargs):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(tempfile, "NamedTemporaryFile", refused)  # as in a read-only or immutable directory
    code, _, err = _cli(capsys, "trace", "import", "--input", a, "--out", tmp_path / "t.safetensors")
    assert code == 2 and f"cannot write in {tmp_path} (Operation not permitted); give a writable place" in err


def test_a_save_the_writer_refuses_is_an_os_error_naming_the_file(tmp_path, monkeypatch):
    import pathlib

    import safetensors.numpy
    from safetensors import SafetensorError

    def refused(tensors, filename, metadata=None):
        raise SafetensorError("Error while serializing: permission denied")

    def read_only(self, missing_ok=False):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(safetensors.numpy, "save_file", refused)
    monkeypatch.setattr(pathlib.Path, "unlink", read_only)  # cleaning up must not hide the reason
    with pytest.raises(OSError, match=r"cannot write .*t\.safetensors \(Error while serializing: permission denied\)"):
        _trace().save(tmp_path / "t.safetensors")


# -- predictor train / eval ----------------------------------------------------------------------------------------

_SMALL = ("--epochs", "1", "--d-model", "8", "--d-ff", "8", "--decoder-layers", "1", "--next-hidden", "0",
          "--val-fraction", "0")


@pytest.fixture
def traces(tmp_path):
    b = _trace(model="/elsewhere/toy")
    b.experts[:] = b.experts[::-1].copy()  # routes of its own: a copy of a's would be refused
    for name, trace in {"a": _trace(), "b": b, "other": _trace(model="other"),
                        "wide": _trace(experts=8), "one": _trace(sequences=1, tokens=1),
                        "unnamed": _trace(model="unknown")}.items():
        trace.save(tmp_path / f"{name}.safetensors")
    return tmp_path


@pytest.mark.parametrize("names, extra, message", [
    (["a", "other"], (), "other.safetensors of 'other'; give traces of one model"),
    (["unnamed", "a", "other"], (), "other.safetensors of 'other'; give traces of one model"),  # not joined by it
    (["a", "wide"], (), "wide.safetensors has (1, 8, 2); give traces of one model"),
    (["one"], ("--next-hidden", "4"), "every sequence of the traces has one token: the next-token head has nothing "
                                      "to learn from; record longer sequences or train without it (--next-hidden 0)"),
])
def test_train_refuses_traces_it_cannot_learn_from_and_writes_nothing(traces, capsys, names, extra, message):
    argv = ["predictor", "train", *[a for n in names for a in ("--trace", traces / f"{n}.safetensors")],
            "--out", traces / "p", "--json", *_SMALL, *extra]
    code, out, err = _cli(capsys, *argv)
    assert code == 2 and out == "" and message in err and len(err.strip().splitlines()) == 1
    assert not (traces / "p").exists()


def test_train_never_writes_into_a_directory_of_other_files(traces, capsys):
    model = traces / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "mixtral"}')
    code, _, err = _cli(capsys, "predictor", "train", "--trace", traces / "a.safetensors", "--out", model, *_SMALL)
    assert code == 2 and "holds other files (config.json) and no predictor; give a new or empty directory" in err
    assert [p.name for p in model.iterdir()] == ["config.json"]
    (traces / "empty").mkdir()
    code, _, err = _cli(capsys, "predictor", "train", "--trace", traces / "empty", "--out", traces / "p", *_SMALL)
    assert code == 2 and "empty is a directory without trace files (*.safetensors)" in err


def test_train_then_eval_json_and_the_errors_around_them(traces, capsys):
    out = traces / "p"
    argv = ("predictor", "train", "--trace", traces / "a.safetensors", "--trace", traces / "b.safetensors")
    code, stdout, err = _cli(capsys, *argv, "--out", out, "--json", *_SMALL)
    assert code == 0 and err == "" and json.loads(stdout)["tokens"] == 12
    code, stdout, err = _cli(capsys, *argv, "--out", out, "--json", *_SMALL)  # a predictor's directory: replaced
    assert code == 0 and sorted(p.name for p in traces.iterdir() if p.name.startswith(".")) == []
    code, stdout, err = _cli(capsys, "predictor", "eval", "--predictor", out, "--trace", traces / "a.safetensors",
                             "--batch-size", "1", "--json")
    assert code == 0 and err == "" and json.loads(stdout)["batch_size"] == 1
    code, _, err = _cli(capsys, "predictor", "eval", "--predictor", out, "--trace", traces / "other.safetensors")
    assert code == 2 and "trained on traces of 'toy', the trace is of 'other': train a predictor on this" in err
    (out / "config.json").write_text("{")
    code, _, err = _cli(capsys, "predictor", "eval", "--predictor", out, "--trace", traces / "a.safetensors")
    assert code == 2 and f"{out / 'config.json'} is not JSON" in err and len(err.strip().splitlines()) == 1


def test_failed_predictor_save_leaves_the_old_one(traces, capsys, monkeypatch):
    import safetensors.torch

    from expertflow.predictor import load_predictor

    out = traces / "p"
    assert _cli(capsys, "predictor", "train", "--trace", traces / "a.safetensors", "--out", out, *_SMALL)[0] == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def torn(tensors, filename, metadata=None):
        open(filename, "wb").write(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", torn)
    with pytest.raises(OSError, match="disk full"):
        load_predictor(out).save(out)
    with pytest.raises(OSError, match="disk full"):
        load_predictor(out).save(traces / "new")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in traces.iterdir() if p.is_dir()) == ["p"]


def test_a_predictor_save_the_writer_refuses_is_one_line_naming_the_directory(traces, capsys, monkeypatch):
    import safetensors.torch
    from safetensors import SafetensorError

    out = _predictor(traces, capsys)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def full(tensors, filename, metadata=None):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    a = traces / "a.safetensors"
    for argv, target in [(("fit-next", "--predictor", out, "--hidden", "4", "--epochs", "1"), out),
                         (("train", "--out", traces / "new", *_SMALL), traces / "new")]:
        code, stdout, err = _cli(capsys, "predictor", *argv, "--trace", a, "--json")
        assert code == 2 and stdout == "" and len(err.strip().splitlines()) == 1, err
        assert f"cannot write {target} (Error while serializing: I/O error: No space left on device" in err
        assert "give a writable place with enough space" in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in traces.iterdir() if p.is_dir()) == ["p"]


def test_train_refuses_routeless_and_repeated_traces_and_bad_flags_before_training(traces, capsys):
    routeless = _trace()
    routeless.experts[:] = -1
    routeless.save(traces / "none.safetensors")
    a = traces / "a.safetensors"
    (traces / "link").symlink_to(a)
    cases = [
        (("--trace", traces / "none.safetensors"), "the traces hold no known routes (every expert id is -1)"),
        (("--trace", a, "--trace", a), "a.safetensors is given twice; give each trace file once"),
        (("--trace", traces, "--trace", a), "a.safetensors is given twice; give each trace file once"),
        (("--trace", a, "--trace", traces / "link"), f"link is given twice (also as {a}); give each trace file"),
        (("--trace", a, "--seed", "-5"), "--seed -5 must not be negative"),
        (("--trace", a, "--seed", str(2**64)), "--seed 18446744073709551616 must be below 2**64 (torch's seed range)"),
        (("--trace", a, "--vocab-size", "0"), "--vocab-size 0 must be at least 1"),
        (("--trace", a, "--next-epochs", "0"), "--next-epochs 0 must be at least 1"),
        (("--trace", a, "--out", a / "sub"), "a.safetensors is a file, so no directory can be made under it"),
        (("--trace", a, "--max-minutes", "0"), "--max-minutes 0.0 must be above 0"),
        (("--trace", a, "--init-embeddings", "no-such-model"), "--init-embeddings no-such-model: no such model "
                                                               "directory or safetensors file"),
    ]
    for extra, message in cases:
        argv = ["predictor", "train", "--out", traces / "p", *_SMALL, *extra]
        code, out, err = _cli(capsys, *argv)
        assert code == 2 and out == "" and message in err and len(err.strip().splitlines()) == 1, (extra, err)
        assert not (traces / "p").exists()


def test_train_over_a_predictor_names_the_files_it_left(traces, capsys):
    out = _predictor(traces, capsys)
    (out / "report.json").write_text("{}")
    code, stdout, err = _cli(capsys, "predictor", "train", "--trace", traces / "a.safetensors", "--out", out,
                             *_SMALL, "--json")
    assert code == 0 and json.loads(stdout)["out"] == str(out)
    assert f"warning: {out} still holds report.json from the predictor it replaced" in err


def test_train_sets_the_next_token_heads_epochs(traces, capsys):
    out = traces / "p"
    code, _, err = _cli(capsys, "predictor", "train", "--trace", traces / "a.safetensors", "--out", out, *_SMALL,
                        "--next-hidden", "4", "--next-epochs", "3")  # the later --next-hidden wins
    assert code == 0, err
    assert len(json.loads((out / "config.json").read_text())["info"]["next_head"]["history"]) == 3


def test_train_that_diverges_names_the_epoch_and_the_fix_and_writes_nothing(traces, capsys):
    a = traces / "a.safetensors"
    for extra, message in [
        (("--lr", "inf"), "--lr inf must be a positive number of at most 1e+30"),
        (("--epochs", "3", "--lr", "1e10"), "training diverged at epoch 0 (loss nan); lower --lr 10000000000.0"),
        (("--epochs", "3", "--lr", "1e10", "--next-hidden", "4"), "training diverged at epoch 0 (loss nan); lower"),
    ]:
        code, out, err = _cli(capsys, "predictor", "train", "--trace", a, "--out", traces / "p", *_SMALL, *extra,
                              "--json")
        assert code == 2 and out == "" and message in err and len(err.strip().splitlines()) == 1, (extra, err)
        assert not (traces / "p").exists()


def test_fit_next_refuses_a_predictor_whose_weights_are_not_finite(traces, capsys):
    import torch

    from expertflow.predictor import load_predictor

    out = _predictor(traces, capsys)
    predictor = load_predictor(out)
    with torch.no_grad():  # as the file of a run that diverged unnoticed holds
        for p in predictor.net.parameters():
            p.fill_(float("nan"))
    predictor.save(out)
    code, stdout, err = _cli(capsys, "predictor", "fit-next", "--predictor", out, "--trace", traces / "a.safetensors",
                             "--hidden", "4", "--epochs", "1", "--out", traces / "q")
    assert code == 2 and stdout == "" and len(err.strip().splitlines()) == 1, err
    assert "decoder states that are not finite" in err and "train the predictor again with a lower" in err
    assert not (traces / "q").exists()


def test_max_minutes_bounds_the_whole_train_command(traces, capsys):
    out = traces / "p"
    code, stdout, err = _cli(capsys, "predictor", "train", "--trace", traces / "a.safetensors", "--out", out, *_SMALL,
                             "--epochs", "3", "--next-hidden", "4", "--next-epochs", "3", "--max-minutes", "1e-9",
                             "--json")
    assert code == 0, err
    summary, info = json.loads(stdout), json.loads((out / "config.json").read_text())["info"]
    assert (summary["epochs_run"], summary["next_epochs_run"], summary["stopped_by"]) == (1, 1, "time limit")
    assert summary["seconds"] == info["total_seconds"] >= info["seconds"]


def test_eval_says_n_a_where_no_cell_has_a_guess(traces, capsys):
    out = _predictor(traces, capsys)
    argv = ("predictor", "eval", "--predictor", out, "--trace", traces / "one.safetensors", "--phase", "prefill")
    code, stdout, _ = _cli(capsys, *argv, "--json")  # one token: prev_step has nothing to go by
    assert code == 0 and json.loads(stdout)["baselines"]["prev_step"]["token_precision_at_k"] is None
    code, stdout, _ = _cli(capsys, *argv)
    row = next(line for line in stdout.splitlines() if line.startswith("prev_step"))
    assert code == 0 and row.split()[-1] == "n/a" and "None" not in stdout


def test_library_warnings_are_shown_in_the_commands_format(traces, capsys):
    _trace(sequences=3).save(traces / "three.safetensors")
    code, _, err = _cli(capsys, "predictor", "train", "--trace", traces / "a.safetensors", "--out", traces / "p",
                        *_SMALL, "--vocab-size", "4", "--json")
    assert code == 0 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("expertflow predictor train: warning: --vocab-size 4, but the traces hold token ids up to 6")
    code, _, err = _cli(capsys, "predictor", "fit-next", "--predictor", traces / "p", "--trace",
                        traces / "three.safetensors", "--hidden", "4", "--epochs", "1", "--json")
    assert code == 0 and err.startswith("expertflow predictor fit-next: warning: these traces' sequences")
    assert "UserWarning" not in err and ".py:" not in err and len(err.strip().splitlines()) == 1, err


def test_train_warns_when_the_vocabulary_is_smaller_than_the_token_ids(traces):
    small = TrainConfig(epochs=1, d_model=8, d_ff=8, heads=1, decoder_layers=1, next_hidden=0, val_fraction=0,
                        vocab_size=4)
    with pytest.warns(UserWarning, match="vocab_size=4, but the traces hold token ids up to 6"):
        train(_trace(), small, progress=False)


def test_a_vocabulary_equal_to_the_largest_id_is_too_small_and_warned_about():
    # ids 1 .. 6 need a vocabulary of 7
    small = TrainConfig(epochs=1, d_model=8, d_ff=8, heads=1, decoder_layers=1, next_hidden=0, val_fraction=0,
                        vocab_size=6)
    with pytest.warns(UserWarning, match="vocab_size=6, but the traces hold token ids up to 6"):
        train(_trace(), small, progress=False)


_SUMMARY_KEYS = {"out", "tokens", "parameters", "epochs_run", "best_epoch", "best_val_recall_at_k", "next_epochs_run",
                 "stopped_by", "seconds"}


def test_train_passes_every_network_flag_on_and_prints_the_whole_summary(tmp_path, capsys):
    # the summary's fields; --encoder-layers, --decoder-layers; --next-offsets K = windows 1 … K
    synthetic_trace(seqs=4).save(tmp_path / "t.safetensors")
    code, out, err = _cli(capsys, "predictor", "train", "--trace", tmp_path / "t.safetensors", "--out", tmp_path / "p",
                          "--epochs", "1", "--d-model", "8", "--d-ff", "8", "--encoder-layers", "2",
                          "--decoder-layers", "1", "--next-hidden", "4", "--next-epochs", "1", "--next-offsets", "2",
                          "--json")
    assert code == 0, err
    assert set(json.loads(out)) == _SUMMARY_KEYS
    model = json.loads((tmp_path / "p" / "config.json").read_text())["model"]
    assert (model["encoder_layers"], model["decoder_layers"], model["next_windows"]) == (2, 1, [1, 2])


def test_train_summary_counts_the_heads_epochs_and_the_whole_runs_seconds(tmp_path, capsys, monkeypatch):
    # next_epochs_run = the head's epochs run (not its best one); seconds = the whole run
    import expertflow.predictor.train as train_module

    real = train_module.train

    def timed(*args, **kwargs):
        predictor = real(*args, **kwargs)
        predictor.info.update(seconds=1.0, total_seconds=7.5)
        predictor.info["next_head"]["best_epoch"] = 0
        return predictor

    monkeypatch.setattr(train_module, "train", timed)
    synthetic_trace(seqs=4).save(tmp_path / "t.safetensors")
    code, out, err = _cli(capsys, "predictor", "train", "--trace", tmp_path / "t.safetensors", "--out", tmp_path / "p",
                          "--epochs", "1", "--d-model", "8", "--d-ff", "8", "--next-hidden", "4", "--next-epochs", "3",
                          "--json")
    assert code == 0, err
    summary = json.loads(out)
    assert (summary["next_epochs_run"], summary["seconds"]) == (3, 7.5)


def test_fit_next_summary_leaves_the_history_to_config_json_and_names_its_own_flags(tmp_path, capsys):
    # the summary is the head's facts without their history; --hidden defaults to 768 (its help); --offsets 0 is
    # named as the flag
    counting = synthetic_trace(seqs=3)
    counting.save(tmp_path / "t.safetensors")
    train(counting, dataclasses.replace(TINY_TRAINING, epochs=1, d_model=8, d_ff=8, next_hidden=0),
          out=tmp_path / "p", progress=False)
    argv = ("predictor", "fit-next", "--predictor", tmp_path / "p", "--trace", tmp_path / "t.safetensors",
            "--epochs", "1", "--json")
    code, out, err = _cli(capsys, *argv)
    assert code == 0, err
    summary = json.loads(out)
    assert "history" not in summary and summary["hidden"] == 768
    assert "history" in json.loads((tmp_path / "p" / "config.json").read_text())["info"]["next_head"]
    code, out, err = _cli(capsys, *argv, "--offsets", "0")
    assert code == 2 and "--offsets 0 must be at least 1" in err, err


def test_eval_defaults_checks_and_text_table(tmp_path, capsys):
    # --batch-size 0 is refused; the default batch size is 16 (its help); the text table's columns are b_acc then
    # recall, as the JSON gives them
    trace = synthetic_trace(seqs=4)
    trace.save(tmp_path / "t.safetensors")
    train(trace, dataclasses.replace(TINY_TRAINING, epochs=1, d_model=8, d_ff=8, next_hidden=0), out=tmp_path / "p",
          progress=False)
    argv = ("predictor", "eval", "--predictor", tmp_path / "p", "--trace", tmp_path / "t.safetensors")
    code, out, err = _cli(capsys, *argv, "--json")
    report = json.loads(out)
    assert code == 0 and report["batch_size"] == 16
    code, out, err = _cli(capsys, *argv)
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()[2:]}
    for name, r in {"predictor": report, **report["baselines"]}.items():
        assert [float(x) for x in rows[name][:2]] == [r["b_acc"], r["token_recall_at_k"]], name
    code, out, err = _cli(capsys, *argv, "--batch-size", "0")
    assert code == 2 and out == "" and "--batch-size 0 must be at least 1" in err, err


def test_tasks_take_a_comma_separated_list(tmp_path, capsys):
    # --tasks "chat, code" keeps the traces of both families
    for i, task in enumerate(("chat", "code", "math")):
        trace = synthetic_trace(seqs=2, seed=i)
        trace.extra_metadata.update(task=task)
        trace.save(tmp_path / f"{task}.safetensors")
    code, out, err = _cli(capsys, "predictor", "train", "--trace", tmp_path, "--tasks", "chat, code", "--out",
                          tmp_path / "p", "--epochs", "1", "--d-model", "8", "--d-ff", "8", "--next-hidden", "0",
                          "--json")
    assert code == 0 and json.loads(out)["tokens"] == 2 * 2 * 11, err


def test_threads_sets_torchs_thread_count(tmp_path, capsys):
    # --threads N (results depend on it, docs/predictor.md)
    import torch

    before = torch.get_num_threads()
    trace = synthetic_trace(seqs=2)
    trace.save(tmp_path / "t.safetensors")
    train(trace, dataclasses.replace(TINY_TRAINING, epochs=1, d_model=8, d_ff=8, next_hidden=0), out=tmp_path / "p",
          progress=False)
    wanted = 2 if before != 2 else 1
    try:
        code, _, err = _cli(capsys, "predictor", "eval", "--predictor", tmp_path / "p", "--trace",
                            tmp_path / "t.safetensors", "--threads", wanted, "--json")
        assert code == 0, err
        assert torch.get_num_threads() == wanted
    finally:
        torch.set_num_threads(before)


def _predictor(traces, capsys):
    out = traces / "p"
    assert _cli(capsys, "predictor", "train", "--trace", traces / "a.safetensors", "--out", out, *_SMALL)[0] == 0
    return out


def test_fit_next_refuses_a_trace_of_another_model_and_bad_split_settings(traces, capsys):
    out = _predictor(traces, capsys)
    _trace(model="other").save(traces / "named.safetensors")
    wide = _trace()
    wide.experts = np.concatenate([wide.experts, np.full_like(wide.experts[..., :1], -1)], axis=-1)  # top-3
    wide.save(traces / "top3.safetensors")
    for name, extra, message in [
        ("named", (), "trained on traces of 'toy', the trace is of 'other': train a predictor on this model's"),
        ("top3", (), "the predictor predicts 1 layers x 4 experts, top-2; the trace has 1 x 4, top-3"),
        ("a", ("--seed", "-1"), "--seed -1 must not be negative"),
        ("a", ("--seed", str(2**64)), "--seed 18446744073709551616 must be below 2**64 (torch's seed range)"),
        ("a", ("--val-fraction", "1"), "--val-fraction 1.0 must lie in [0, 1)"),
    ]:
        code, stdout, err = _cli(capsys, "predictor", "fit-next", "--predictor", out, "--trace",
                                 traces / f"{name}.safetensors", "--hidden", "4", "--epochs", "1", *extra)
        assert code == 2 and stdout == "" and message in err and len(err.strip().splitlines()) == 1, (name, err)


def _refuse_folders_in(monkeypatch, place) -> None:
    """No folder can be made in `place` (what a read-only directory does, for root too)."""
    import tempfile

    make = tempfile.mkdtemp

    def mkdtemp(*args, dir=None, **kwargs):
        if dir is not None and os.path.abspath(dir) == str(place):
            raise PermissionError(13, "Permission denied", str(dir))
        return make(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)


def test_a_new_predictor_in_a_folder_that_takes_no_new_folder_is_refused_before_training(traces, capsys,
                                                                                        monkeypatch):
    """A new predictor is written in a folder made beside it and renamed: where no folder can be made (read-only,
    also for root), it is refused before the work, not after it; so is a name too long for the file system."""
    import expertflow.predictor.train as train

    monkeypatch.setattr(train, "train", lambda *a, **k: pytest.fail("trained before checking where to write"))
    long = traces / ("p" * 250)  # the name fits, the folder the save makes beside it (.NAME.XXXXXXXX) does not
    code, stdout, err = _cli(capsys, "predictor", "train", "--out", long, *_SMALL, "--trace", traces / "a.safetensors")
    assert code == 2 and f"--out {long}: the name is too long for the file system (File name too long); give a " \
        "shorter name" in err, err
    _refuse_folders_in(monkeypatch, traces)
    code, stdout, err = _cli(capsys, "predictor", "train", "--out", traces / "new", *_SMALL, "--trace",
                             traces / "a.safetensors", "--json")
    assert code == 2 and stdout == "" and f"--out {traces / 'new'}: {traces} is not writable (Permission denied)" \
        in err, err


@pytest.mark.parametrize("command", ["train", "fit-next"])
def test_a_predictor_replaced_in_a_read_only_folder_is_written_inside_its_own_directory(traces, capsys, monkeypatch,
                                                                                        command):
    """Replacing a predictor needs only its own directory writable: the files are staged inside it, so the folder
    holding it (read-only here) is never written, and the moves stay on one file system."""
    out = _predictor(traces, capsys)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    _refuse_folders_in(monkeypatch, traces)
    argv = (("train", "--out", out, *_SMALL, "--seed", "3") if command == "train" else
            ("fit-next", "--predictor", out, "--hidden", "4", "--epochs", "1"))
    code, stdout, err = _cli(capsys, "predictor", *argv, "--trace", traces / "a.safetensors", "--json")
    assert code == 0, err
    after = {p.name: p.read_bytes() for p in out.iterdir()}
    assert sorted(after) == sorted(before) and after != before  # replaced, nothing staged left behind


def test_a_predictor_trained_into_new_nested_folders_is_written_whole(traces, capsys):
    out = traces / "a" / "b" / "pred"
    code, _, err = _cli(capsys, "predictor", "train", "--trace", traces / "a.safetensors", "--out", out, *_SMALL)
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "expert_counts.json", "model.safetensors"]
    assert [p.name for p in out.parent.iterdir()] == ["pred"]  # no staging folder left beside it


def test_a_predictor_file_that_cannot_be_written_is_one_line_naming_the_directory(traces, capsys, monkeypatch):
    from pathlib import Path

    out = _predictor(traces, capsys)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    write = Path.write_text

    def full(self, *args, **kwargs):
        if self.name == "config.json":
            raise OSError(28, "No space left on device")
        return write(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full)
    code, stdout, err = _cli(capsys, "predictor", "fit-next", "--predictor", out, "--hidden", "4", "--epochs", "1",
                             "--trace", traces / "a.safetensors", "--json")
    assert code == 2 and stdout == "" and len(err.strip().splitlines()) == 1, err
    assert f"cannot write {out} (No space left on device); give a writable place with enough space" in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in traces.iterdir() if p.is_dir()) == ["p"]


def test_fit_next_in_place_on_a_read_only_predictor_names_the_predictor_flag(traces, capsys, monkeypatch):
    out = _predictor(traces, capsys)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    _refuse_folders_in(monkeypatch, out)  # as a read-only directory, also for root
    argv = ["predictor", "fit-next", "--predictor", out, "--trace", traces / "a.safetensors", "--hidden", "4",
            "--epochs", "1", "--json"]
    code, stdout, err = _cli(capsys, *argv)
    assert code == 2 and stdout == "" and len(err.strip().splitlines()) == 1, err
    assert f"--predictor {out}: {out} is not writable (Permission denied); without --out the predictor is replaced " \
           "there: give --out DIR, a directory you can write to" in err and "--out " + str(out) not in err
    code, stdout, err = _cli(capsys, *argv, "--out", traces / "q")
    assert code == 0 and json.loads(stdout)["out"] == str(traces / "q"), err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_simulate_from_python_names_the_arguments_a_predictive_policy_needs(traces):
    from expertflow import sim
    from expertflow.predictor import default_predictor_path, load_predictor
    from expertflow.predictor.evaluate import predict_trace

    with pytest.raises(ValueError) as err:
        sim.simulate(_trace(), "expertflow", 2, predictor=load_predictor(default_predictor_path()))
    message = str(err.value)
    assert "policy 'expertflow' is driven by route predictions: pass predictions=" in message
    assert "--predictor" not in message
    # the recipe, as written, feeds it: with the next-token head and without one (`--next-hidden 0`)
    recipe = re.search(r"predictions=(predict_trace\(.*?\)) \(", message).group(1)
    for head in (True, False):
        predictor = load_predictor(default_predictor_path())
        if not head:
            predictor.net.next_head = None
        assert predictor.has_next_head == head
        c = predictor.config  # a trace of the predictor's model: 2 sequences of 3 tokens, top-4 of 6 x 32
        trace = Trace(experts=(np.arange(6 * c.num_layers * c.top_k) % c.num_experts).reshape(6, c.num_layers, c.top_k)
                      .astype(np.int32), num_experts=c.num_experts, token_ids=np.arange(6) % 7 + 1,
                      seq_ids=np.repeat([0, 1], 3), positions=np.tile([0, 1, 2], 2), steps=np.arange(6),
                      phase=np.tile([0, 1, 1], 2), model=predictor.info["model"])
        predictions = eval(recipe, {"predict_trace": predict_trace, "predictor": predictor, "trace": trace})
        assert sim.simulate(trace, "expertflow", 8, predictions=predictions).needs > 0


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.update(model=[]), "config.json: 'model' is a list, not an object; train the predictor again"),
    (lambda c: c.update(info="abc"), "config.json: 'info' is a str, not an object; train the predictor again"),
    # sizes far beyond the weights file: compared with it before anything is allocated
    (lambda c: c["model"].update(num_experts=10**12), "model.safetensors does not hold the weights config.json "
                                                      "describes (head.weight: ["),
    (lambda c: c["model"].update(d_model=10**12), "config.json: unreadable network settings (RuntimeError"),
    (None, "lacks expert_counts.json (the training trace's expert counts); train the predictor again"),
])
def test_predictor_files_with_the_wrong_shape_are_named(traces, capsys, edit, message):
    out = _predictor(traces, capsys)
    if edit is None:
        (out / "expert_counts.json").unlink()
    else:
        config = json.loads((out / "config.json").read_text())
        edit(config)
        (out / "config.json").write_text(json.dumps(config))
    code, stdout, err = _cli(capsys, "predictor", "eval", "--predictor", out, "--trace", traces / "a.safetensors")
    assert code == 2 and stdout == "" and message in err and len(err.strip().splitlines()) == 1, err


def test_predictor_files_that_cannot_be_read_as_json_are_named(traces, capsys):
    out = _predictor(traces, capsys)
    (out / "expert_counts.json").unlink()
    (out / "expert_counts.json").mkdir()
    config = (out / "config.json").read_text()
    (out / "config.json").write_text("[" * 10**5 + "]" * 10**5)  # nested past Python's recursion limit
    for message in ("config.json is not JSON (maximum recursion depth", "expert_counts.json is unreadable "
                                                                        "(IsADirectoryError"):
        code, stdout, err = _cli(capsys, "predictor", "eval", "--predictor", out, "--trace", traces / "a.safetensors")
        assert code == 2 and stdout == "" and message in err and len(err.strip().splitlines()) == 1, err
        assert "train the predictor again" in err
        (out / "config.json").write_text(config)


@pytest.mark.parametrize("entry, shown", [
    (None, "(null)"), (-1, "(-1)"), (1.5, "(1.5)"), (1e30, "(1e+30)"), ("x", "could not convert string to float: 'x'"),
])
def test_expert_counts_that_are_not_whole_numbers_are_named(traces, capsys, entry, shown):
    out = _predictor(traces, capsys)
    counts = json.loads((out / "expert_counts.json").read_text())
    counts["expert_counts"][0][1] = entry
    (out / "expert_counts.json").write_text(json.dumps(counts))
    code, stdout, err = _cli(capsys, "predictor", "eval", "--predictor", out, "--trace", traces / "a.safetensors")
    assert code == 2 and stdout == "" and len(err.strip().splitlines()) == 1, err
    assert f"{out / 'expert_counts.json'} " in err and shown in err and "train the predictor again" in err


# -- trace record --------------------------------------------------------------------------------------------------

def test_record_names_the_prompts_file_and_the_tokenizer_it_lacks(tmp_path, capsys):
    out = tmp_path / "r.safetensors"
    base = ("trace", "record", "--model", "tiny-moe", "--out", out, "--prompts")
    code, _, err = _cli(capsys, *base, tmp_path / "none.jsonl")
    assert code == 2 and f"prompts file {tmp_path / 'none.jsonl'} does not exist; give a JSONL file" in err
    code, _, err = _cli(capsys, *base, tmp_path)
    assert code == 2 and f"prompts file {tmp_path} is a directory" in err
    bad = tmp_path / "p.jsonl"
    bad.write_text('\ufeff{"prompt": "hi"}\n\n{"prompt": 3}\n', encoding="utf-8")
    code, _, err = _cli(capsys, *base, bad)
    assert code == 2 and f"{bad}:3: each line needs a string field 'prompt'" in err  # the BOM line is read
    deep = tmp_path / "deep.jsonl"
    deep.write_text('{"prompt": "hi"}\n' + "[" * 10**5 + "]" * 10**5 + "\n")
    code, _, err = _cli(capsys, *base, deep)
    assert code == 2 and f"{deep}:2: JSON nested too deeply to read" in err
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    code, _, err = _cli(capsys, "trace", "record", "--model", tmp_path / "model", "--prompts", bad, "--out", out)
    assert code == 2 and "has no tokenizer files" in err and not out.exists()


def test_trace_stats_text_says_n_a_where_a_figure_is_undefined(tmp_path, capsys):
    import numpy as np

    path = tmp_path / "t.safetensors"
    Trace(experts=np.full((3, 2, 2), -1, np.int32), num_experts=4).save(path)  # one sequence, every cell missing
    code, out, _ = _cli(capsys, "trace", "stats", path)
    assert code == 0 and "None" not in out
    assert "median n/a (whole trace), n/a (within a sequence)" in out
    assert "temporal overlap of consecutive tokens: n/a (every pair of consecutive tokens has a missing cell)" in out
    experts = np.array([[[0, 1]], [[0, 2]], [[-1, -1]]], np.int32)  # one pair of the two has a missing cell
    Trace(experts=experts, num_experts=4).save(path)
    code, out, _ = _cli(capsys, "trace", "stats", path)
    assert "temporal overlap of consecutive tokens: 0.5 over 2 pairs; at each layer, pairs with a missing cell left " \
           "out (chance 0.500)" in out
