"""Checks on the predictor's inputs and outputs made before any work: empty paths, directories that do not hold a
predictor (from the command line and from Python), copies of a trace, window ends and sizes too large to allocate; and
the summaries and session errors around them."""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings

import numpy as np
import pytest
import torch

import expertflow.predictor.train as train_module
from expertflow.predictor import load_predictor
from expertflow.predictor.data import load_traces, sequences
from expertflow.predictor.model import PredictorConfig, RouteNet, check_windows
from expertflow.predictor.session import RoutePredictor
from expertflow.predictor.train import TrainConfig, train
from test_trace_predictor_errors import _cli, _trace

_TINY = dict(epochs=1, d_model=8, d_ff=8, heads=1, decoder_layers=1, next_hidden=0, val_fraction=0)
_SMALL = ("--epochs", "1", "--d-model", "8", "--d-ff", "8", "--decoder-layers", "1", "--val-fraction", "0")


@pytest.fixture
def no_training(monkeypatch):
    """Any training run fails the test: the checks must come first."""
    monkeypatch.setattr(train_module._Run, "fit", lambda self: pytest.fail("trained before checking"))


@pytest.fixture
def model_dir(tmp_path):
    """A directory of other files, as a Hugging Face model's is."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "mixtral"}')
    (model / "model.safetensors").write_bytes(b"weights")
    return model


def _contents(path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def _small_predictor() -> RoutePredictor:
    return train(_trace(), TrainConfig(**_TINY), progress=False)


# -- empty paths ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, flag", [
    (("train", "--trace", "{t}", "--out", ""), "--out"),
    (("train", "--trace", "", "--out", "{d}/p"), "--trace"),
    (("train", "--trace", "{t}", "--out", "{d}/p", "--init-embeddings", ""), "--init-embeddings"),
    (("fit-next", "--predictor", "{d}/p", "--trace", "{t}", "--out", ""), "--out"),
    (("fit-next", "--predictor", "", "--trace", "{t}"), "--predictor"),
    (("eval", "--predictor", "", "--trace", "{t}"), "--predictor"),
    (("eval", "--predictor", "{d}/p", "--trace", ""), "--trace"),
])
def test_an_empty_path_is_refused_naming_its_flag(tmp_path, capsys, monkeypatch, argv, flag):
    """An unset shell variable gives "": read as the current directory, it would have a predictor written over the
    files there (a model's config.json), or read every trace there."""
    here = tmp_path / "here"
    here.mkdir()
    (here / "config.json").write_text("my notes")
    _trace().save(here / "t.safetensors")
    monkeypatch.chdir(here)
    before = _contents(here)
    argv = [a.format(t=here / "t.safetensors", d=tmp_path) for a in argv]
    with pytest.raises(SystemExit) as exit_:
        _cli(capsys, "predictor", *argv, *(_SMALL if argv[0] == "train" else ()))
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"argument {flag}: an empty path, which would be read as the current directory" \
        in err, err
    assert _contents(here) == before


def test_the_library_refuses_an_empty_path_too(tmp_path, monkeypatch, no_training):
    monkeypatch.chdir(tmp_path)
    predictor = RoutePredictor(RouteNet(PredictorConfig(vocab_size=8, num_layers=1, num_experts=4, top_k=2,
                                                        d_model=8, d_ff=8, heads=1, decoder_layers=1)))
    with pytest.raises(ValueError, match="is an empty path, which would be read as the current directory"):
        predictor.save("")
    with pytest.raises(ValueError, match="is an empty path"):
        train(_trace(), TrainConfig(**_TINY), out="", progress=False)
    with pytest.raises(ValueError, match="an empty trace path, which would be read as the current directory"):
        load_traces([""])
    assert list(tmp_path.iterdir()) == []


# -- where a predictor may be written, from Python ----------------------------------------------------------------

def test_save_refuses_a_directory_of_other_files_and_a_file(tmp_path, model_dir):
    predictor = _small_predictor()
    before = _contents(model_dir)
    with pytest.raises(ValueError, match=r"model holds other files \(config\.json, model\.safetensors\) and no "
                                         r"predictor; give a new or empty directory"):
        predictor.save(model_dir)
    assert _contents(model_dir) == before
    notes = tmp_path / "notes.txt"
    notes.write_text("keep me")
    with pytest.raises(ValueError, match="notes.txt is a file; give a directory"):
        predictor.save(notes)
    with pytest.raises(ValueError, match="notes.txt is a file, so no directory can be made under it"):
        predictor.save(notes / "p")
    assert notes.read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "notes.txt"]  # nothing staged left behind


def test_save_still_writes_a_new_an_empty_and_a_predictors_directory(tmp_path):
    predictor = _small_predictor()
    (tmp_path / "empty").mkdir()
    for place in (tmp_path / "new", tmp_path / "empty", tmp_path / "new"):  # the last: a predictor's, replaced
        predictor.save(place)
        assert load_predictor(place).parameters_count() == predictor.parameters_count()


def test_train_refuses_an_out_that_cannot_take_a_predictor_before_training(tmp_path, model_dir, no_training):
    before = _contents(model_dir)
    with pytest.raises(ValueError, match="model holds other files .* and no predictor"):
        train(_trace(), TrainConfig(**_TINY), out=model_dir, progress=False)
    assert _contents(model_dir) == before
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="notes.txt is a file; give a directory"):
        train(_trace(), TrainConfig(**_TINY), out=tmp_path / "notes.txt", progress=False)
    (tmp_path / "link").symlink_to(tmp_path / "gone")  # a dangling link: the save's rename onto it would fail
    with pytest.raises(ValueError, match="link is a symbolic link to .*gone, which does not exist; make that directory"):
        train(_trace(), TrainConfig(**_TINY), out=tmp_path / "link", progress=False)


def test_check_predictor_dir_names_the_flag_it_was_given_by(tmp_path, model_dir):
    from expertflow.predictor.session import check_predictor_dir

    with pytest.raises(ValueError, match=f"^--out {re.escape(str(model_dir))} holds other files"):
        check_predictor_dir(model_dir, "--out")
    with pytest.raises(ValueError, match=f"^{re.escape(str(model_dir))} holds other files"):
        check_predictor_dir(model_dir)
    check_predictor_dir(tmp_path / "new" / "deeper")  # new folders: fine, and none made
    assert not (tmp_path / "new").exists()


def test_fit_next_refuses_an_out_of_other_files_before_fitting(tmp_path, model_dir, capsys, monkeypatch):
    _trace().save(tmp_path / "a.safetensors")
    _small_predictor().save(tmp_path / "p")
    before, kept = _contents(model_dir), _contents(tmp_path / "p")
    monkeypatch.setattr(train_module, "fit_next_head", lambda *a, **k: pytest.fail("fitted before checking --out"))
    code, out, err = _cli(capsys, "predictor", "fit-next", "--predictor", tmp_path / "p", "--trace",
                          tmp_path / "a.safetensors", "--out", model_dir)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert f"error: --out {model_dir} holds other files (config.json, model.safetensors) and no predictor" in err
    assert _contents(model_dir) == before and _contents(tmp_path / "p") == kept


def test_the_shipped_predictor_is_never_replaced(tmp_path, capsys, monkeypatch, no_training):
    """fit-next replaces its --predictor in place when no --out is given: the shipped one is refused by name."""
    from expertflow.predictor import default_predictor_path

    shipped = default_predictor_path()
    before = _contents(shipped)
    _trace().save(tmp_path / "a.safetensors")
    monkeypatch.setattr(train_module, "fit_next_head", lambda *a, **k: pytest.fail("fitted the shipped predictor"))
    code, out, err = _cli(capsys, "predictor", "fit-next", "--predictor", shipped, "--trace",
                          tmp_path / "a.safetensors")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert f"--predictor {shipped} is the predictor shipped with expertflow" in err and "give --out DIR" in err
    code, out, err = _cli(capsys, "predictor", "train", "--trace", tmp_path / "a.safetensors", "--out", shipped,
                          *_SMALL)
    assert code == 2 and f"--out {shipped} is the predictor shipped with expertflow" in err, err
    with pytest.raises(ValueError, match="is the predictor shipped with expertflow.*give another directory"):
        load_predictor(shipped).save(shipped)
    assert _contents(shipped) == before
    (tmp_path / "link").symlink_to(shipped)
    for other_name in (f"{shipped}/", tmp_path / "link", os.path.relpath(shipped)):  # the same directory
        with pytest.raises(ValueError, match="is the predictor shipped with expertflow"):
            load_predictor(shipped).save(other_name)
    assert _contents(shipped) == before
    shutil.copytree(shipped, tmp_path / "copy")  # a copy of it is the user's own
    load_predictor(tmp_path / "copy").save(tmp_path / "copy")


def test_embeddings_of_a_model_with_fewer_tokens_than_the_trace_are_refused_before_training(tmp_path, capsys,
                                                                                             no_training):
    from safetensors.torch import save_file

    table = tmp_path / "other.safetensors"
    save_file({"model.embed_tokens.weight": torch.zeros(4, 8)}, str(table))  # 4 tokens; the trace's ids reach 6
    with pytest.raises(ValueError, match=r"init_embeddings=.*other\.safetensors has 4 token rows, but the trace "
                                         "holds token ids up to 6: it is not the traced model's"):
        train(_trace(), TrainConfig(**_TINY, init_embeddings=str(table)), progress=False)
    save_file({"model.embed_tokens.weight": torch.zeros(6, 8)}, str(table))  # ids 0..6 need 7 rows
    with pytest.raises(ValueError, match="has 6 token rows, but the trace holds token ids up to 6"):
        train(_trace(), TrainConfig(**_TINY, init_embeddings=str(table)), progress=False)
    save_file({"model.embed_tokens.weight": torch.zeros(4, 8)}, str(table))
    _trace().save(tmp_path / "a.safetensors")
    code, out, err = _cli(capsys, "predictor", "train", "--trace", tmp_path / "a.safetensors", "--out",
                          tmp_path / "p", "--init-embeddings", table, *_SMALL)
    assert code == 2 and f"--init-embeddings {table} has 4 token rows" in err, err
    assert not (tmp_path / "p").exists()


# -- copies of a trace ---------------------------------------------------------------------------------------------

def test_a_copy_of_a_trace_under_another_name_is_refused(tmp_path, capsys):
    a = tmp_path / "a.safetensors"
    _trace().save(a)
    shutil.copy(a, tmp_path / "copy.safetensors")
    with pytest.raises(ValueError, match=r"copy\.safetensors holds the same routes as .*a\.safetensors \(a copy\?\): "
                                         "every one of its 2 sequences is there too.* would count twice"):
        load_traces([a, tmp_path / "copy.safetensors"])
    _trace(model="/elsewhere/toy").save(tmp_path / "renamed.safetensors")  # the same records, other metadata
    with pytest.raises(ValueError, match="renamed.safetensors holds the same routes as"):
        load_traces([a, tmp_path / "renamed.safetensors"])
    code, out, err = _cli(capsys, "predictor", "train", "--trace", tmp_path, "--out", tmp_path / "p", *_SMALL)
    assert code == 2 and out == "" and "holds the same routes as" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "p").exists()


def test_a_subset_copy_is_refused_whichever_file_comes_first(tmp_path):
    full, part = tmp_path / "full.safetensors", tmp_path / "part.safetensors"
    _trace(sequences=3).save(full)
    _trace(sequences=3).subset([0, 2]).save(part)
    for order in ([full, part], [part, full]):
        with pytest.raises(ValueError, match=rf"part\.safetensors holds the same routes as {re.escape(str(full))} "
                                             r"\(a copy\?\): every one of its 2 sequences"):
            load_traces(order)


def test_copies_are_looked_for_among_the_traces_the_task_and_split_keep(tmp_path):
    """The same prompt may sit in a task's train and test sets: loading one split reads only that split's traces."""
    train_trace, test_trace = _trace(sequences=2), _trace(sequences=3)
    train_trace.extra_metadata["split"], test_trace.extra_metadata["split"] = "train", "test"
    train_trace.save(tmp_path / "train.safetensors")
    test_trace.save(tmp_path / "test.safetensors")  # holds every sequence of the train trace, and one more
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_traces([tmp_path], split="train").num_tokens == 6
        assert load_traces([tmp_path], split="test").num_tokens == 9
    with pytest.raises(ValueError, match="train.safetensors holds the same routes as"):
        load_traces([tmp_path])


def test_a_rebatched_subset_or_renumbered_copy_is_refused_too(tmp_path):
    a = tmp_path / "a.safetensors"
    _trace(sequences=3).save(a)
    copies = {"rebatched": _trace(sequences=3).rebatch(3), "subset": _trace(sequences=3).subset([0, 2])}
    renumbered = _trace(sequences=3)
    renumbered.seq_ids = renumbered.seq_ids + 10
    copies["renumbered"] = renumbered
    for name, trace in copies.items():
        trace.save(tmp_path / f"{name}.safetensors")
        with pytest.raises(ValueError, match=rf"{name}\.safetensors holds the same routes as .*a\.safetensors"):
            load_traces([a, tmp_path / f"{name}.safetensors"])
        (tmp_path / f"{name}.safetensors").unlink()


def test_copies_are_found_by_each_sequences_content_whatever_the_row_order(tmp_path):
    a = tmp_path / "a.safetensors"
    _trace(sequences=3).save(a)
    shuffled = _trace(sequences=3)
    order = np.random.default_rng(0).permutation(shuffled.num_tokens)  # rows in another order, steps kept with them
    for name in ("experts", "token_ids", "seq_ids", "positions", "steps", "phase"):
        setattr(shuffled, name, getattr(shuffled, name)[order])
    shuffled.save(tmp_path / "shuffled.safetensors")
    with pytest.raises(ValueError, match=f"shuffled.safetensors holds the same routes as {re.escape(str(a))} "
                                         r"\(a copy\?\)"):
        load_traces([a, tmp_path / "shuffled.safetensors"])
    (tmp_path / "shuffled.safetensors").unlink()
    shared = _trace(sequences=3)
    shared.experts[:3] = (shared.experts[:3] + 1) % 4  # sequence 0 differs, 1 and 2 are a's
    shared.save(tmp_path / "b.safetensors")
    shutil.copy(a, tmp_path / "c.safetensors")
    with pytest.raises(ValueError, match=rf"c\.safetensors holds the same routes as {re.escape(str(a))} \(a copy"):
        load_traces([a, tmp_path / "b.safetensors", tmp_path / "c.safetensors"])  # named by its first file only


def test_other_positions_or_phases_are_other_sequences_and_empty_traces_are_no_copies(tmp_path):
    base = _trace()
    base.save(tmp_path / "a.safetensors")
    shifted = _trace()
    shifted.positions = shifted.positions + 5  # the same tokens and routes later in a prompt
    resplit = _trace()
    resplit.phase = np.ones_like(resplit.phase)  # the same tokens, all decoded
    empty = _trace(sequences=0)
    for other in (shifted, resplit):
        other.save(tmp_path / "b.safetensors")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert load_traces([tmp_path / "a.safetensors", tmp_path / "b.safetensors"]).num_tokens == 12
    empty.save(tmp_path / "e1.safetensors")
    empty.save(tmp_path / "e2.safetensors")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        paths = [tmp_path / n for n in ("a.safetensors", "e1.safetensors", "e2.safetensors")]
        assert load_traces(paths).num_tokens == 6


def test_a_sequence_repeated_inside_a_file_is_counted_each_time(tmp_path):
    _trace(sequences=2).save(tmp_path / "a.safetensors")
    twice = _trace(sequences=3)
    twice.experts[3:6] = twice.experts[0:3]
    twice.token_ids[3:6] = twice.token_ids[0:3]  # sequences 0 and 1 are both a's first; 2 is new
    twice.save(tmp_path / "b.safetensors")
    with pytest.warns(UserWarning, match="2 of the 3 sequences of") as caught:
        load_traces([tmp_path / "a.safetensors", tmp_path / "b.safetensors"])
    assert caught[0].filename == __file__  # told at the caller's line, not inside the library


def test_traces_that_differ_are_all_kept_and_a_shared_sequence_is_told(tmp_path, capsys):
    _trace().save(tmp_path / "a.safetensors")
    other = _trace()
    other.experts[0, 0] = [2, 1]  # was [0, 1]: one expert id of sequence 0 differs; sequence 1 is the same
    other.save(tmp_path / "b-lr=0.1.safetensors")  # a name like a setting: shown as it is, not as a flag
    with pytest.warns(UserWarning, match=r"1 of the 2 sequences of .*b-lr=0\.1\.safetensors are also in "
                                         r".*a\.safetensors"):
        assert len(sequences(load_traces([tmp_path]))) == 4
    code, _, err = _cli(capsys, "predictor", "train", "--trace", tmp_path, "--out", tmp_path / "p", *_SMALL)
    assert code == 0 and re.search(r"^expertflow predictor train: warning: 1 of the 2 sequences of "
                                   r".*b-lr=0\.1\.safetensors are also in", err, re.M), err
    other.experts[3, 0] = [2, 1]  # now both differ: nothing to tell
    other.save(tmp_path / "b-lr=0.1.safetensors")
    shutil.rmtree(tmp_path / "p")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(sequences(load_traces([tmp_path]))) == 4


# -- window ends and sizes -----------------------------------------------------------------------------------------

def test_window_ends_are_bounded_before_any_work(tmp_path, capsys, no_training):
    with pytest.raises(ValueError, match="reach 10000000 tokens ahead; the head predicts at most 64 ahead"):
        check_windows((1, 2, 4, 10_000_000), training=True)
    assert check_windows((1, 64), training=True) == (1, 64)
    with pytest.raises(ValueError, match="at most 64 ahead"):
        TrainConfig(next_windows=(1, 2, 4, 10_000_000))
    a = tmp_path / "a.safetensors"
    _trace().save(a)
    with pytest.raises(SystemExit):
        _cli(capsys, "predictor", "train", "--trace", a, "--out", tmp_path / "p", "--next-windows", "1,2,4,10000000")
    assert "give increasing offsets of at least 1 and at most 64" in capsys.readouterr().err
    code, _, err = _cli(capsys, "predictor", "train", "--trace", a, "--out", tmp_path / "p", "--next-offsets",
                        "65")  # just past the bound: fails fast if it is lost
    assert code == 2 and "--next-offsets 65 must be at least 1 and at most 64" in err, err
    assert not (tmp_path / "p").exists()


def test_a_saved_predictor_whose_windows_reach_further_still_loads_predicts_and_takes_a_new_head(tmp_path, capsys):
    """The bound is for heads about to be trained: one saved with farther windows is read as it is."""
    predictor = _small_predictor()
    with pytest.raises(ValueError, match="at most 64 ahead"):  # a head about to be trained
        train_module.fit_next_head(predictor, _trace(), windows=(1, 65))
    c = predictor.config
    windows = (1, 2, 100)
    predictor.net.next_head = torch.nn.Sequential(torch.nn.Linear(c.d_model, 4), torch.nn.GELU(),
                                                  torch.nn.Linear(4, len(windows) * c.num_layers * c.num_experts))
    predictor.net.config = PredictorConfig(**{**c.to_dict(), "next_hidden": 4, "next_windows": windows})
    predictor.save(tmp_path / "p")
    loaded = load_predictor(tmp_path / "p")
    assert loaded.config.next_windows == windows and loaded.has_next_head
    from expertflow.predictor.evaluate import predict_trace
    _, after = predict_trace(loaded, _trace(), with_next=True)
    assert np.isfinite(after).all()
    _trace().save(tmp_path / "t.safetensors")
    code, _, err = _cli(capsys, "predictor", "fit-next", "--predictor", tmp_path / "p", "--trace",
                        tmp_path / "t.safetensors", "--hidden", "4", "--epochs", "1", "--windows", "1,2,4")
    assert code == 0, err
    assert load_predictor(tmp_path / "p").config.next_windows == (1, 2, 4)


def _reference_pairs(examples, windows):
    """Per token with a successor, per window (a, b] after it: the OR of the known routes of its tokens, and whether
    its first token's cells are known; a plain loop."""
    ys, ks = [], []
    for e in examples:
        hot = np.zeros((len(e.tokens), e.experts.shape[1], 4), dtype=np.uint8)
        known = (e.experts >= 0).any(-1)
        for j, layer, k in zip(*np.nonzero(e.experts >= 0)):
            hot[j, layer, e.experts[j, layer, k]] = 1
        for j in range(len(e.tokens) - 1):
            y = np.zeros((len(windows), *hot.shape[1:]), dtype=np.uint8)
            kn = np.zeros((len(windows), hot.shape[1]), dtype=bool)
            for w, (a, b) in enumerate(zip((0,) + tuple(windows[:-1]), windows)):
                for i in range(j + a + 1, min(j + b, len(e.tokens) - 1) + 1):
                    y[w] |= hot[i] * known[i][:, None]
                kn[w] = known[j + a + 1] if j + a + 1 < len(e.tokens) else False
            ys.append(y)
            ks.append(kn)
    return np.stack(ys), np.stack(ks)


def test_next_pairs_cost_no_more_than_the_sequences_whatever_the_window_ends(tmp_path):
    """The targets of a window reaching far past every sequence are built from the tokens there are: a typo such as
    a window ending 10**12 tokens ahead must not allocate memory in proportion to it."""
    trace = _trace(sequences=3, tokens=5)
    trace.experts[3, 0, :] = -1  # a cell with no known route
    examples = sequences(trace)
    net = RouteNet(PredictorConfig(vocab_size=8, num_layers=1, num_experts=4, top_k=2, d_model=8, d_ff=8, heads=1,
                                   decoder_layers=1))
    for windows in ((1,), (1, 2, 4), (2, 3), (1, 3, 10**12)):
        _, y, known = train_module._next_pairs(net, examples, windows, max_tokens=10)
        want_y, want_known = _reference_pairs(sorted(examples, key=lambda e: len(e.tokens)), windows)
        assert y.dtype == torch.uint8 and known.dtype == torch.bool
        assert sorted(map(bytes, y.numpy())) == sorted(map(bytes, want_y))  # batches may reorder sequences
        assert sorted(map(bytes, known.numpy())) == sorted(map(bytes, want_known))


def test_sizes_too_large_to_allocate_are_one_line_naming_the_flags_before_training(tmp_path, capsys, no_training):
    a = tmp_path / "a.safetensors"
    _trace().save(a)
    huge = str(2**48)  # petabytes: no machine allocates them, whatever its overcommit
    for extra, message in [(("--d-model", huge, "--next-hidden", "0"), f"the network (--d-model {huge}, --d-ff 8) "
                                                                       "cannot be allocated ("),
                           (("--d-model", "8", "--next-hidden", huge), f"the next-token head (--next-hidden {huge}) "
                                                                       "cannot be allocated (")]:
        code, out, err = _cli(capsys, "predictor", "train", "--trace", a, "--out", tmp_path / "p", "--epochs", "1",
                              "--d-ff", "8", "--decoder-layers", "1", "--val-fraction", "0", *extra)
        assert code == 2 and out == "" and message in err and "give smaller sizes" in err, err
        assert len(err.strip().splitlines()) == 1
        assert not (tmp_path / "p").exists()


def test_fit_next_names_its_hidden_width_when_it_cannot_be_allocated(tmp_path, capsys):
    a = tmp_path / "a.safetensors"
    _trace().save(a)
    _small_predictor().save(tmp_path / "p")
    before = _contents(tmp_path / "p")
    code, out, err = _cli(capsys, "predictor", "fit-next", "--predictor", tmp_path / "p", "--trace", a, "--hidden",
                          str(2**48))
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert f"the next-token head (--hidden {2**48}) cannot be allocated (" in err
    assert _contents(tmp_path / "p") == before


def test_an_allocation_that_fails_during_training_is_one_line(tmp_path, capsys, monkeypatch):
    def fails(self):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
                           "memory: you tried to allocate 2217600000000 bytes.")

    monkeypatch.setattr(train_module._Run, "fit", fails)
    _trace().save(tmp_path / "a.safetensors")
    code, out, err = _cli(capsys, "predictor", "train", "--trace", tmp_path / "a.safetensors", "--out", tmp_path / "p",
                          *_SMALL)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert "error: out of memory (" in err and "lower --d-model, --d-ff or --next-hidden" in err

    def broken(self):
        raise RuntimeError("some other failure")

    monkeypatch.setattr(train_module._Run, "fit", broken)  # not an allocation: not hidden
    with pytest.raises(RuntimeError, match="some other failure"):
        _cli(capsys, "predictor", "train", "--trace", tmp_path / "a.safetensors", "--out", tmp_path / "p", *_SMALL)


# -- summaries -----------------------------------------------------------------------------------------------------

def test_the_train_summary_counts_the_next_token_heads_parameters(tmp_path, capsys):
    from test_predictor import synthetic_trace

    synthetic_trace(seqs=4).save(tmp_path / "t.safetensors")
    argv = ("predictor", "train", "--trace", tmp_path / "t.safetensors", "--epochs", "1", "--d-model", "8",
            "--d-ff", "8", "--decoder-layers", "1", "--next-hidden", "4", "--next-epochs", "1")
    code, out, err = _cli(capsys, *argv, "--out", tmp_path / "p", "--json")
    assert code == 0, err
    predictor = load_predictor(tmp_path / "p")
    head = sum(p.numel() for p in predictor.net.next_head.parameters())
    assert json.loads(out)["parameters"] == predictor.parameters_count() == predictor.info["parameters"] + head
    code, out, err = _cli(capsys, *argv, "--out", tmp_path / "q")
    assert code == 0, err
    assert f"{predictor.parameters_count()} parameters ({predictor.info['parameters']} + {head} in the next-token " \
           "head)" in out


def test_the_fit_next_summary_without_a_validation_set_says_so(tmp_path, capsys):
    from test_predictor import synthetic_trace

    synthetic_trace(seqs=4).save(tmp_path / "t.safetensors")
    _cli(capsys, "predictor", "train", "--trace", tmp_path / "t.safetensors", "--out", tmp_path / "p", *_SMALL,
         "--next-hidden", "0")
    code, out, err = _cli(capsys, "predictor", "fit-next", "--predictor", tmp_path / "p", "--trace",
                          tmp_path / "t.safetensors", "--hidden", "4", "--epochs", "1", "--val-fraction", "0")
    assert code == 0, err
    assert "no validation set (--val-fraction 0, or too few sequences to hold some out): the last epoch's head was " \
           "kept" in out
    assert "recall of their routes  (" not in out


# -- sessions ------------------------------------------------------------------------------------------------------

def test_prefill_of_no_tokens_is_a_clear_error(tmp_path):
    session = _small_predictor().new_session()
    with pytest.raises(ValueError, match=r"prefill takes input_ids \[B, T\] with T >= 1 .*; got \(1, 0\)"):
        session.prefill(torch.zeros(1, 0, dtype=torch.long))
