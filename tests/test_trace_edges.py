"""The model name a trace records and what reads it later: the recorder stores a model loaded from a local directory
by its absolute path, `predictor train` finds that model's vocabulary from any working directory (and says so when it
cannot), and `wrap` still takes the trace's predictor for the model loaded by the relative path or the absolute one."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import expertflow
from expertflow.cli import main
from expertflow.models import tiny_moe_path
from expertflow.trace import Trace


@pytest.fixture
def relative_model(tmp_path, monkeypatch):
    """The tiny MoE saved as models/moe under `tmp_path` (linked file by file: not the built-in model's directory),
    loaded by that relative path from `tmp_path`; returns (model, its directory)."""
    from transformers import AutoModelForCausalLM

    directory = tmp_path / "models" / "moe"
    directory.mkdir(parents=True)
    for f in tiny_moe_path().iterdir():
        (directory / f.name).symlink_to(f)
    monkeypatch.chdir(tmp_path)
    return AutoModelForCausalLM.from_pretrained("models/moe", dtype=torch.float32).eval(), directory


def _predictor_trained_on(model, path, name: str) -> str:
    """An untrained predictor that fits `model`, saved as trained on traces of `name` (as `predictor train` does)."""
    from expertflow.adapters import find_adapter
    from expertflow.predictor import RoutePredictor
    from expertflow.predictor.model import PredictorConfig, RouteNet

    layers = find_adapter(model)[1]
    config = PredictorConfig(vocab_size=model.config.vocab_size, num_layers=len(layers),
                             num_experts=model.config.num_local_experts, top_k=model.config.num_experts_per_tok,
                             d_model=16, d_ff=32, heads=2, encoder_layers=1, decoder_layers=1, next_hidden=16)
    torch.manual_seed(0)
    RoutePredictor(RouteNet(config), info={"model": name}).save(path)
    return str(path)


def test_a_model_loaded_by_a_relative_path_is_recorded_by_its_absolute_path(relative_model, tmp_path, monkeypatch):
    from expertflow.predictor.train import model_vocab_size
    from expertflow.recorder import record

    model, directory = relative_model
    trace = record(model, ["Hi"], batch_size=1, max_new_tokens=1, progress=False)
    assert trace.model == str(directory)
    assert record(model, ["Hi"], batch_size=1, max_new_tokens=1, progress=False, model_name="moe").model == "moe"
    monkeypatch.chdir(tmp_path / "models")  # training elsewhere still reads the model's config
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert model_vocab_size(trace) == model.config.vocab_size == 3072


def test_a_predictor_of_the_absolute_path_fits_the_model_loaded_by_either_path(relative_model, tmp_path):
    from transformers import AutoModelForCausalLM

    model, directory = relative_model
    predictor = _predictor_trained_on(model, tmp_path / "predictor", str(directory))
    absolute = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    for loaded in (model, absolute):  # name_or_path "models/moe", then the absolute path
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "trained on traces of another model"
            expertflow.wrap(loaded, policy="expertflow", predictor=predictor, cache_slots=64, device="cpu")
        expertflow.unwrap(loaded)
    other = _predictor_trained_on(model, tmp_path / "other", "/models/another-moe")
    with pytest.warns(UserWarning, match="was trained on traces of '/models/another-moe', this model is 'models/moe'"):
        expertflow.wrap(model, policy="expertflow", predictor=other, cache_slots=64, device="cpu")
    expertflow.unwrap(model)


def test_predictor_train_says_when_it_falls_back_to_the_largest_token_id(tmp_path, capsys, monkeypatch):
    """A relative name that looks like a hub id (org/name), read from elsewhere, gets the warning too."""
    import numpy as np

    trace = Trace(experts=np.array([[[0, 1]], [[1, 2]], [[2, 3]]]), num_experts=4, token_ids=[5, 9, 11],
                  seq_ids=[0, 0, 0], positions=[0, 1, 2], steps=[0, 1, 2], phase=[0, 1, 1], model="models/moe")
    trace.save(tmp_path / "t.safetensors")
    monkeypatch.chdir(tmp_path)
    argv = ["predictor", "train", "--trace", "t.safetensors", "--out", "p", "--epochs", "1", "--d-model", "8",
            "--d-ff", "8", "--decoder-layers", "1", "--next-hidden", "0", "--val-fraction", "0", "--json"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert err == ("expertflow predictor train: warning: the trace's model 'models/moe' has no readable config.json "
                   "from here: the predictor's vocabulary is taken as the largest token id + 1 (12), and ids it never "
                   "saw share rows; give the model's vocabulary as --vocab-size V, or train where that name leads to "
                   "the model's directory (a trace of a model loaded from a local directory stores its absolute "
                   "path)\n")
    assert json.loads((tmp_path / "p" / "config.json").read_text())["model"]["vocab_size"] == 12
