"""The route-path predictor: sessions against the full forward, files, training and its recipe, the network's settings,
metrics and baselines worked out by hand, examples and batches, the next-token head, and the `predictor` commands."""

from __future__ import annotations

import dataclasses
import json
import warnings

import numpy as np
import pytest
import torch
from safetensors import safe_open

from expertflow.cli import main
from expertflow.predictor import PredictorConfig, RoutePredictor, default_predictor_path, load_predictor
from expertflow.predictor import baselines
from expertflow.predictor.data import (SequenceExample, concat_traces, length_batches, load_traces, multi_hot,
                                       pad_batch, same_model, sequences, sequences_digest)
from expertflow.predictor.evaluate import evaluate, predict_trace
from expertflow.predictor.metrics import (batch_accuracy, next_token_recall, route_scores, route_sets, token_scores,
                                          top_k_sets)
from expertflow.predictor.model import RouteNet
from expertflow.predictor.train import TrainConfig, fit_next_head, model_vocab_size, train
from expertflow.trace import Trace

EVAL_KEYS = {"batch_size", "b_acc", "token_recall_at_k", "token_precision_at_k", "per_layer_b_acc", "baselines"}
METRIC_KEYS = {"b_acc", "token_recall_at_k", "token_precision_at_k", "per_layer_b_acc"}
_FIELDS = ("experts", "token_ids", "seq_ids", "positions", "steps", "phase")  # a trace's per-token arrays


def synthetic_trace(seqs: int = 12, prompt: int = 6, generated: int = 5, vocab: int = 16, layers: int = 2,
                    experts: int = 8, seed: int = 0) -> Trace:
    """Batch-1 trace whose top-2 routes are a function of the token and its predecessor."""
    rng = np.random.default_rng(seed)
    rows = {k: [] for k in _FIELDS}
    step = 0
    for s in range(seqs):
        tokens = rng.integers(3, vocab, prompt + generated)
        for pos, tok in enumerate(tokens.tolist()):
            prev = int(tokens[pos - 1]) if pos else 0
            route = []
            for layer in range(layers):
                a = (tok + layer * prev) % experts
                route.append([a, (a + 1 + tok % 3) % experts])
            rows["experts"].append(route)
            rows["token_ids"].append(tok)
            rows["seq_ids"].append(s)
            rows["positions"].append(pos)
            rows["phase"].append(0 if pos < prompt else 1)
            rows["steps"].append(step if pos < prompt else step + pos - prompt + 1)
        step += generated + 1
    return Trace(num_experts=experts, model="synthetic", source="test", **{k: np.array(v) for k, v in rows.items()})


def tiny_net(vocab: int = 16, layers: int = 2, experts: int = 8, seed: int = 0) -> RouteNet:
    torch.manual_seed(seed)
    config = PredictorConfig(vocab_size=vocab, num_layers=layers, num_experts=experts, top_k=2, d_model=16, d_ff=32,
                             heads=2, encoder_layers=1, decoder_layers=2, dropout=0.0)
    return RouteNet(config).eval()


TINY_TRAINING = TrainConfig(epochs=25, d_model=32, d_ff=64, heads=2, encoder_layers=1, decoder_layers=2,
                            dropout=0.0, lr=1e-2, batch_tokens=64, patience=25, max_minutes=None)


def _rows(trace: Trace, keep) -> Trace:
    """`trace` with only the rows `keep` (a mask or an index array, in that order)."""
    return Trace(num_experts=trace.num_experts, model=trace.model, source=trace.source,
                 **{k: getattr(trace, k)[keep] for k in _FIELDS})


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    trace = synthetic_trace()
    out = tmp_path_factory.mktemp("predictor")
    predictor = train(trace, TINY_TRAINING, out=out, progress=False)
    return trace, predictor, out


# -- sessions --------------------------------------------------------------------------------------------------------
def _full(net: RouteNet, prompt: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:  # [T, L, E] probabilities
    with torch.no_grad():
        logits = net(prompt[None], torch.ones(1, len(prompt), dtype=torch.long), tokens[None],
                     torch.ones(1, len(tokens), dtype=torch.long))
    return torch.sigmoid(logits)[0]


def _left_padded(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):], mask[row, width - len(p):] = p, 1
    return ids, mask


def test_incremental_decode_matches_full_forward():
    net = tiny_net()
    predictor = RoutePredictor(net)
    prompts = [torch.tensor([5, 6, 7, 8, 9]), torch.tensor([11, 12, 13])]
    generated = torch.tensor([[3, 4], [10, 14], [15, 3], [4, 4]])  # [steps, B]
    ids, mask = _left_padded(prompts)
    session = predictor.new_session()
    first = session.prefill(ids, mask)
    assert first.shape == (2, 5, 2, 8)
    steps = [session.decode(generated[i][:, None]) for i in range(len(generated))]
    assert steps[0].shape == (2, 1, 2, 8) and session.length == 5 + len(generated)
    for row, prompt in enumerate(prompts):
        expected = _full(net, prompt, torch.cat([prompt, generated[:, row]]))
        got = torch.cat([first[row, mask[row].bool()], *[s[row] for s in steps]])
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


def test_reorder_and_merge_keep_each_rows_predictions():
    net = tiny_net()
    predictor = RoutePredictor(net)
    prompts = [torch.tensor([5, 6, 7]), torch.tensor([8, 9, 10, 11]), torch.tensor([12, 13])]
    a, b = predictor.new_session(), predictor.new_session()
    a.prefill(*_left_padded(prompts[:2]))
    b.prefill(*_left_padded(prompts[2:]))
    a.decode(torch.tensor([[3], [4]]))
    a.reorder(torch.tensor([1, 0]))  # rows swapped: prompts[1], prompts[0]
    merged = type(a).merge([a, b])  # rows: prompts[1], prompts[0], prompts[2]; b is one token shorter
    out = merged.decode(torch.tensor([[14], [15], [3]]))[:, 0]  # [3, L, E]
    histories = [torch.tensor([8, 9, 10, 11, 4, 14]), torch.tensor([5, 6, 7, 3, 15]), torch.tensor([12, 13, 3])]
    for row, (prompt, tokens) in enumerate(zip([prompts[1], prompts[0], prompts[2]], histories)):
        torch.testing.assert_close(out[row], _full(net, prompt, tokens)[-1], atol=1e-5, rtol=1e-4)


def test_predict_names_the_batch_it_takes_when_given_token_ids():
    predictor = load_predictor(default_predictor_path())
    with pytest.raises(TypeError, match=r"predict takes a padded batch, a dict with encoder_ids, encoder_mask, "
                                        r"decoder_ids, decoder_mask \(build it with expertflow\.predictor\.data\."
                                        r"pad_batch.*got a Tensor\. For token ids as they arrive, use a session"):
        predictor.predict(torch.tensor([[5, 6, 7, 8]]), with_next=True)
    with pytest.raises(TypeError, match=r"got a dict with keys \['decoder_ids'\]"):
        predictor.predict({"decoder_ids": torch.tensor([[5]])})


def test_decode_before_prefill_is_an_error():
    with pytest.raises(RuntimeError, match="prefill"):
        RoutePredictor(tiny_net()).new_session().decode(torch.tensor([[3]]))


def test_several_tokens_per_decode_and_crop_match_full_forward():
    torch.manual_seed(0)
    predictor = RoutePredictor(RouteNet(dataclasses.replace(tiny_net().config, next_hidden=8)).eval())
    prompts = [torch.tensor([5, 6, 7, 8, 9]), torch.tensor([11, 12, 13])]
    session = predictor.new_session()
    session.prefill(*_left_padded(prompts))
    candidates = torch.tensor([[3, 4, 10], [14, 15, 3]])
    probs = session.decode(candidates)  # three tokens per row at once
    assert probs.shape == (2, 3, 2, 8) and session.length == 8
    session.crop(6)  # keep the first candidate, as a model's cache does when it rejects the other two
    assert session.length == 6 and session.next_probs is None
    last = session.decode(torch.tensor([[7], [9]]))
    for row, prompt in enumerate(prompts):
        full, _ = _teacher_forced(predictor, prompt, torch.cat([prompt, candidates[row]]))
        torch.testing.assert_close(probs[row], full[-3:], atol=1e-5, rtol=1e-4)
        kept = torch.cat([prompt, candidates[row, :1], torch.tensor([7, 9])[row:row + 1]])
        full, after = _teacher_forced(predictor, prompt, kept)
        torch.testing.assert_close(last[row, 0], full[-1], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(session.next_probs[row], after[-1], atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="crop keeps 0 to 7"):
        session.crop(8)


def _teacher_forced(predictor: RoutePredictor, prompt: torch.Tensor, tokens: torch.Tensor):
    """`predict(with_next=True)` of one unpadded sequence: ([T, L, E], [T, K, L, E])."""
    ones = lambda x: torch.ones(1, len(x), dtype=torch.long)  # noqa: E731
    probs, after = predictor.predict({"encoder_ids": prompt[None], "encoder_mask": ones(prompt),
                                      "decoder_ids": tokens[None], "decoder_mask": ones(tokens)}, with_next=True)
    return probs[0], after[0]


def test_decode_refuses_a_right_padded_batch_and_prefill_takes_it():
    net = tiny_net()
    session = RoutePredictor(net).new_session()
    prompts = [torch.tensor([5, 6, 7]), torch.tensor([8, 9, 10, 11, 12])]
    ids, mask = torch.tensor([[5, 6, 7, 0, 0], [8, 9, 10, 11, 12]]), torch.tensor([[1, 1, 1, 0, 0], [1] * 5])
    probs = session.prefill(ids, mask)
    assert session.right_padded
    for row, prompt in enumerate(prompts):  # a teacher-forced pass is exact with right padding
        torch.testing.assert_close(probs[row, mask[row].bool()], _full(net, prompt, prompt), atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="right-padded"):
        session.decode(torch.tensor([[3], [4]]))
    session.reorder(torch.tensor([1]))  # the long row alone has no padding after its tokens
    assert not session.right_padded
    session.decode(torch.tensor([[3]]))
    session.prefill(*_left_padded(prompts))
    assert not session.right_padded


def test_a_net_used_under_inference_mode_can_still_be_trained():
    net = tiny_net()
    RoutePredictor(net).new_session().prefill(torch.tensor([[1, 2, 3]]))  # builds the position tables
    net.train()
    ids = torch.tensor([[1, 2, 3, 4]])
    net(ids, torch.ones_like(ids), ids, torch.ones_like(ids)).sum().backward()
    assert net.decoder_bias.bias.weight.grad is not None and net.encoder_bias.bias.weight.grad is not None


def test_predict_masks_the_padding_of_shorter_prompts_in_cross_attention():
    # a right-padded prompt gives its row what the row gets alone
    predictor = RoutePredictor(tiny_net())
    short, full = synthetic_trace(seqs=1, prompt=2, generated=2, seed=1), synthetic_trace(seqs=1, seed=2)
    both = predictor.predict(pad_batch(sequences(full) + sequences(short)))
    alone = predictor.predict(pad_batch(sequences(short)))
    torch.testing.assert_close(both[1, :4], alone[0], atol=1e-5, rtol=1e-4)


# -- files and training ----------------------------------------------------------------------------------------------
def test_save_load_round_trip(trained, tmp_path):
    trace, predictor, out = trained
    assert {p.name for p in out.iterdir()} >= {"config.json", "model.safetensors", "expert_counts.json"}
    back = load_predictor(out)
    assert back.config == predictor.config
    np.testing.assert_array_equal(back.expert_counts, baselines.expert_counts(trace))
    ids = torch.tensor([[3, 4, 5, 6]])
    torch.testing.assert_close(back.new_session().prefill(ids), predictor.new_session().prefill(ids))


def test_training_learns_and_is_deterministic(trained):
    trace, predictor, _ = trained
    report = evaluate(predictor, trace, batch_size=1, phase="all")
    assert report["token_recall_at_k"] > report["baselines"]["frequency"]["token_recall_at_k"] + 0.2
    assert predictor.info["train_sequences"] + predictor.info["val_sequences"] == 12
    again = train(trace, TINY_TRAINING, progress=False)
    for (name, x), (_, y) in zip(predictor.net.state_dict().items(), again.net.state_dict().items()):
        torch.testing.assert_close(x, y, msg=name)


def test_training_that_diverges_stops_with_an_error_and_keeps_no_nan_epoch():
    from dataclasses import replace

    trace = synthetic_trace(seqs=4)
    for lr in (float("inf"), float("nan"), 1e300):
        with pytest.raises(ValueError, match="must be a positive number of at most 1e"):
            TrainConfig(lr=lr)
    for setting in ({"val_fraction": 0.0}, {"next_hidden": 0}, {"next_epochs": 1}):  # with or without validation
        config = replace(TINY_TRAINING, epochs=3, lr=1e10, **{"next_hidden": 4, **setting})
        with pytest.raises(ValueError, match=r"training diverged at epoch 0 \(loss nan\); lower lr=1"):
            train(trace, config, progress=False)
    predictor = train(trace, replace(TINY_TRAINING, epochs=1, next_hidden=0), progress=False)
    with pytest.raises(ValueError, match="the next-token head's training diverged at epoch 0 .*; lower its learning"):
        fit_next_head(predictor, trace, hidden=4, epochs=2, lr=1e20, progress=False)
    with torch.no_grad():  # as the file of a run that diverged unnoticed holds
        for p in predictor.net.parameters():
            p.fill_(float("nan"))
    with pytest.raises(ValueError, match="decoder states that are not finite .*train the predictor again with a lower"):
        fit_next_head(predictor, trace, hidden=4, epochs=1, progress=False)


def test_max_minutes_bounds_the_next_token_heads_epochs_too():
    from dataclasses import replace

    config = replace(TINY_TRAINING, epochs=3, next_hidden=4, next_epochs=3, max_minutes=1e-9)
    info = train(synthetic_trace(seqs=4), config, progress=False).info
    assert (info["epochs_run"], info["stopped_by"]) == (1, "time limit")  # at least one epoch of each
    assert (len(info["next_head"]["history"]), info["next_head"]["stopped_by"]) == (1, "time limit")
    assert info["total_seconds"] >= info["seconds"]


def test_progress_bar_total_follows_the_batches_each_epoch_draws(monkeypatch):
    import expertflow.predictor.train as train_module

    seen = []

    class Bar:  # records (steps done, total shown) at every update
        def __init__(self, *args, total=None, **kwargs):
            self.total, self.n = total, 0

        def update(self, n=1):
            self.n += n
            seen.append((self.n, self.total))

        def refresh(self):
            pass

        def set_postfix(self, **kwargs):
            pass

        def close(self):
            pass

    monkeypatch.setattr(train_module, "tqdm", Bar)
    # sequences of 3 to 14 tokens in batches of 64 padded tokens: 4 planned per epoch, jittered lengths draw 5
    trace = concat_traces([synthetic_trace(seqs=2, prompt=2, generated=g, seed=g) for g in range(1, 13)])
    train(trace, dataclasses.replace(TINY_TRAINING, epochs=2, batch_tokens=64, val_fraction=0.0, next_hidden=0))
    assert seen[-1] == (2 * 5, 2 * 5) and all(n <= total for n, total in seen)


def test_large_vocabularies_share_rows_as_documented():
    net = RouteNet(PredictorConfig(vocab_size=32000, num_layers=1, num_experts=4, top_k=1, d_model=8, d_ff=8,
                                   heads=1, decoder_layers=1))
    ids = torch.arange(32000)
    rows = net.embedding_rows(ids)
    assert torch.equal(rows[:32000 - 16384], rows[16384:])  # ids 16,384 apart share a row
    assert sorted(rows[:16384].tolist()) == list(range(16384))  # a permutation of id mod 16384
    assert (torch.bincount(rows) == 2).float().mean() > 0.9  # nearly every row holds two ids


def test_model_embeddings_become_fixed_features(tmp_path):
    from dataclasses import replace

    from safetensors.torch import save_file

    table = torch.randn(16, 8)
    save_file({"model.embed_tokens.weight": table, "lm_head.weight": torch.randn(16, 8)},
              str(tmp_path / "model.safetensors"))
    config = replace(TINY_TRAINING, epochs=2, init_embeddings=str(tmp_path))
    predictor = train(synthetic_trace(seqs=4), config, out=tmp_path / "p", progress=False)
    assert predictor.config.token_features == 8
    torch.testing.assert_close(predictor.net.features.float(), table.half().float())
    back = load_predictor(tmp_path / "p")
    ids = torch.tensor([[3, 4, 15]])
    torch.testing.assert_close(back.new_session().prefill(ids), predictor.new_session().prefill(ids))
    save_file({"other.weight": table}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="no input embedding table"):
        train(synthetic_trace(seqs=4), replace(config, init_embeddings=str(tmp_path / "other.safetensors")),
              progress=False)


def test_a_damaged_weights_file_of_the_init_embeddings_model_says_to_get_the_model_again(tmp_path):
    """--init-embeddings DIR whose weights file is cut short: the file is the model's own, so the fix is a new copy
    of the model, not another path; a file given in its place that is not safetensors: pass the directory."""
    from safetensors.torch import save_file

    from expertflow.predictor.train import load_embedding_table

    save_file({"model.embed_tokens.weight": torch.randn(16, 8)}, str(tmp_path / "model.safetensors"))
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:len(data) // 2])
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'model.safetensors'} cannot be read \(.*\); a weights file "
                                         rf"of {tmp_path} is damaged or incomplete: download or save the model again$"):
        load_embedding_table(tmp_path)
    (tmp_path / "notes.txt").write_text("not weights")
    with pytest.raises(ValueError, match="notes.txt is not a safetensors file .*; pass the model's directory$"):
        load_embedding_table(tmp_path / "notes.txt")


def test_vocabulary_comes_from_the_model_wherever_training_runs(tmp_path, monkeypatch):
    from dataclasses import replace

    from safetensors.torch import save_file

    model = tmp_path / "models" / "org" / "moe"
    model.mkdir(parents=True)
    (model / "config.json").write_text('{"vocab_size": 40}')
    save_file({"model.embed_tokens.weight": torch.randn(40, 8)}, str(model / "model.safetensors"))
    trace = replace(synthetic_trace(seqs=2), model="models/org/moe")  # a relative name, as older traces store
    monkeypatch.chdir(tmp_path)
    assert model_vocab_size(trace) == 40
    monkeypatch.chdir(model.parent)  # elsewhere, the directory given for the embeddings is read
    assert model_vocab_size(trace, str(model)) == 40
    small = replace(TINY_TRAINING, epochs=1, next_hidden=0, init_embeddings=str(model))
    assert train(trace, small, progress=False).config.vocab_size == 40
    (model / "config.json").unlink()  # no config.json: the table has one row per token of the model
    assert model_vocab_size(trace, str(model / "model.safetensors"), table_rows=40) == 40
    with pytest.warns(UserWarning, match="'models/org/moe' has no readable config.json from here"):
        assert model_vocab_size(trace) == 16  # the largest token id + 1, no longer silently


def test_the_built_in_models_short_name_reads_its_vocabulary_from_anywhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # as the benchmarks' traces name it (`--model tiny-moe`)
    trace = dataclasses.replace(synthetic_trace(seqs=2), model="tiny-moe")
    assert model_vocab_size(trace) == 3072


@pytest.mark.parametrize("name", ["org/moe", "models/org/moe", "/gone/moe", "./moe"])
def test_a_path_or_hub_id_without_a_readable_config_gets_the_largest_id_with_a_warning(name, tmp_path, monkeypatch):
    # a hub id read as org/name is also a relative path: either way its config.json is not read from here
    monkeypatch.chdir(tmp_path)
    trace = dataclasses.replace(synthetic_trace(seqs=2), model=name)
    with pytest.warns(UserWarning, match=f"the trace's model '{name}' has no readable config.json from here: .*"
                                         r"largest token id \+ 1 \(16\).* give the model's vocabulary as "
                                         "vocab_size=V, or train where that name leads to the model's directory"):
        assert model_vocab_size(trace) == 16
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a bare name (a class name) names no directory
        assert model_vocab_size(dataclasses.replace(trace, model="MixtralForCausalLM")) == 16


def test_an_unnamed_trace_cannot_join_two_models(tmp_path):
    from dataclasses import replace

    unnamed, x, y = (replace(synthetic_trace(seqs=2), model=m) for m in ("unknown", "org/model-X", "/data/model-Y"))
    for i, trace in enumerate((unnamed, x, y)):
        trace.save(tmp_path / f"{i}.safetensors")
    with pytest.raises(ValueError, match="1.safetensors is of 'org/model-X', .*2.safetensors of '/data/model-Y'"):
        load_traces([tmp_path / f"{i}.safetensors" for i in range(3)])
    assert concat_traces([unnamed, x]).model == "org/model-X"  # what the predictor records and later checks


def test_sequences_need_token_ids():
    trace = synthetic_trace(seqs=2)
    trace.token_ids[:] = -1
    with pytest.raises(ValueError, match="token ids"):
        sequences(trace)


def test_examples_split_prompt_and_tokens():
    trace = synthetic_trace(seqs=2, prompt=3, generated=2)
    first = sequences(trace)[0]
    np.testing.assert_array_equal(first.prompt, trace.token_ids[:3])
    np.testing.assert_array_equal(first.tokens, trace.token_ids[:5])


def test_concat_and_task_filter(tmp_path):
    a, b = synthetic_trace(seqs=2, seed=1), synthetic_trace(seqs=3, seed=2)
    a.extra_metadata.update(task="chat", split="train")
    b.extra_metadata.update(task="math", split="test")
    a.save(tmp_path / "a.safetensors")
    b.save(tmp_path / "b.safetensors")
    both = concat_traces([a, b])
    assert len(np.unique(both.seq_ids)) == 5 and len(np.unique(both.steps)) == len(np.unique(a.steps)) + len(
        np.unique(b.steps))
    assert load_traces([tmp_path], tasks=["math"]).num_tokens == b.num_tokens
    assert load_traces([tmp_path], split="train").num_tokens == a.num_tokens
    assert load_traces([tmp_path], tasks=["chat", "math"], split="test").num_tokens == b.num_tokens
    with pytest.raises(ValueError, match="no trace has task"):
        load_traces([tmp_path], tasks=["code"])
    with pytest.raises(ValueError, match=r"no trace has task \['code'\]"):  # one task missing: not ignored
        load_traces([tmp_path], tasks=["chat", "code"])


# -- training recipe -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("setting, message", [
    ({"patience": 0}, "patience=0 must be at least 1"),
    ({"next_hidden": -1}, "next_hidden=-1 must not be negative"),  # refused at once, not after the training
])
def test_train_config_refuses_bad_settings_at_once(setting, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**setting)


@pytest.mark.parametrize("minutes", [0, -5.0, float("nan"), float("inf")])
def test_max_minutes_is_a_finite_number_above_zero_or_none(minutes):
    # a limit of 0 or less would stop after one epoch as "time limit", and NaN would silently mean no limit
    with pytest.raises(ValueError, match=rf"max_minutes={minutes} must be a finite number of minutes above 0; give "
                                         "None for no time limit"):
        TrainConfig(max_minutes=minutes)
    assert TrainConfig(max_minutes=None).max_minutes is None


def test_the_vocabulary_is_at_least_the_largest_token_id_plus_one(tmp_path):
    # a config.json or embedding table smaller than the ids the traces hold does not shrink it
    (tmp_path / "config.json").write_text('{"vocab_size": 10}')
    trace = dataclasses.replace(synthetic_trace(seqs=2), model=str(tmp_path))  # token ids up to 15
    assert model_vocab_size(trace) == 16
    assert model_vocab_size(dataclasses.replace(trace, model=""), table_rows=10) == 16


def test_the_embeddings_model_directory_names_the_vocabulary_before_the_traces_model(tmp_path):
    # --init-embeddings DIR is read first (docs/predictor.md, Vocabulary)
    for name, size in (("traced", 40), ("embeddings", 50)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({"vocab_size": size}))
    trace = dataclasses.replace(synthetic_trace(seqs=2), model=str(tmp_path / "traced"))
    assert model_vocab_size(trace, str(tmp_path / "embeddings")) == 50


def test_the_seed_draws_the_validation_split_and_fit_next_draws_the_same_one(monkeypatch):
    # train's split comes from its seed, so that the next-token head (refitted with the predictor's seed) is
    # validated on the same held-out sequences
    import expertflow.predictor.train as train_module

    drawn = []
    split = train_module._split

    def recording(examples, fraction, rng):
        train_set, val_set = split(examples, fraction, rng)
        drawn.append(sorted(e.seq_id for e in val_set))
        return train_set, val_set

    monkeypatch.setattr(train_module, "_split", recording)
    config = dataclasses.replace(TINY_TRAINING, epochs=1, d_model=8, d_ff=8, next_hidden=4, next_epochs=1,
                                 val_fraction=0.25)
    for seed in (1, 2):
        train(synthetic_trace(seqs=8), dataclasses.replace(config, seed=seed), progress=False)
    (train1, head1), (train2, head2) = drawn[:2], drawn[2:]
    assert train1 == head1 and train2 == head2 and train1 != train2
    assert train1 == sorted(np.random.default_rng(1).permutation(8)[:2].tolist())


def _run(trace: Trace, **settings):
    """The training run `train` would start on `trace` with TINY_TRAINING and `settings`, on a tiny network."""
    from expertflow.predictor.train import _Run, _split

    config = dataclasses.replace(TINY_TRAINING, **settings)
    rng = np.random.default_rng(config.seed)
    train_set, val_set = _split(sequences(trace), config.val_fraction, rng)
    return _Run(tiny_net(), config, train_set, val_set, rng, progress=False)


def test_learning_rate_warms_up_linearly_then_decays_by_a_cosine_to_its_floor():
    # 40 steps (one batch an epoch), warm-up 5 % = 2 steps, then cosine from lr to 5 % of it
    run = _run(synthetic_trace(seqs=4), epochs=40, batch_tokens=10**6, lr=1.0, val_fraction=0.0)
    assert (run.total_steps, run.warmup) == (40, 2)
    assert [run.lr_at(s) for s in (0, 1, 2)] == pytest.approx([0.5, 1.0, 1.0])
    assert run.lr_at(21) == pytest.approx(0.05 + 0.95 * 0.5)  # half way through the decay
    assert run.lr_at(40) == pytest.approx(0.05) and run.lr_at(45) == pytest.approx(0.05)  # the floor, and after it


def test_an_epochs_history_shows_the_learning_rate_of_its_last_step():
    # one batch an epoch, 3 epochs: warm-up of 1 step, then lr, lr, (0.05 + 0.95 / 2) lr
    config = dataclasses.replace(TINY_TRAINING, epochs=3, batch_tokens=10**6, val_fraction=0.0, next_hidden=0)
    history = train(synthetic_trace(seqs=4), config, progress=False).info["history"]
    assert [h["lr"] for h in history] == pytest.approx([1e-2, 1e-2, 1e-2 * (0.05 + 0.95 * 0.5)])


def test_weight_decay_applies_to_matrices_only():
    # "weight decay 0.01 on the weight matrices, not on the relative-position bias tables or on vectors"
    # (docs/predictor.md, Optimiser)
    run = _run(synthetic_trace(seqs=4))
    decay, rest = run.optimizer.param_groups
    matrices = {id(p) for n, p in run.net.named_parameters() if p.dim() >= 2 and not n.endswith("_bias.bias.weight")}
    assert {id(p) for p in decay["params"]} == matrices and decay["weight_decay"] == 0.01
    assert not matrices & {id(p) for p in rest["params"]} and rest["weight_decay"] == 0.0
    assert len(decay["params"]) + len(rest["params"]) == len(list(run.net.parameters()))


def _scripted_validation(monkeypatch, recalls):
    """Make `_Run.validate` return `recalls` epoch by epoch; returns the weights seen at each validation."""
    import copy

    import expertflow.predictor.train as train_module

    seen, script = [], iter(recalls)

    def validate(self):
        seen.append(copy.deepcopy(self.net.state_dict()))
        return 0.5, next(script)

    monkeypatch.setattr(train_module._Run, "validate", validate)
    return seen


def test_early_stopping_waits_patience_epochs_after_the_best_one(monkeypatch):
    # an equal recall is no improvement; the run stops once patience epochs passed without one, and says so
    _scripted_validation(monkeypatch, [0.5, 0.5, 0.5, 0.6, 0.6, 0.6, 0.6])
    config = dataclasses.replace(TINY_TRAINING, epochs=7, patience=2, next_hidden=0, d_model=8, d_ff=8)
    info = train(synthetic_trace(seqs=4), config, progress=False).info
    assert (info["epochs_run"], info["best_epoch"], info["stopped_by"]) == (3, 0, "early stop")
    assert info["best_val_recall_at_k"] == 0.5


def test_the_best_epochs_weights_are_kept(monkeypatch):
    # the epoch with the best validation recall, not the last one
    seen = _scripted_validation(monkeypatch, [0.1, 0.9, 0.2, 0.3])
    config = dataclasses.replace(TINY_TRAINING, epochs=4, next_hidden=0, d_model=8, d_ff=8)
    predictor = train(synthetic_trace(seqs=4), config, progress=False)
    assert predictor.info["best_epoch"] == 1
    for name, value in predictor.net.state_dict().items():
        torch.testing.assert_close(value, seen[1][name], msg=name)
    assert any(not torch.equal(seen[1][k], seen[3][k]) for k in seen[1])


def test_held_out_sequences_without_known_routes_validate_nothing():
    """A recall or loss over no known cell is no measurement (it read 0.0, so the first epoch was kept and training
    stopped early): such a split trains as one without validation, with a warning, the head too."""
    trace = synthetic_trace(seqs=8, generated=6)
    held = sorted(np.random.default_rng(0).permutation(8)[:2].tolist())  # the split seed 0 draws
    trace.experts[np.isin(trace.seq_ids, held)] = -1
    config = dataclasses.replace(TINY_TRAINING, epochs=4, patience=1, d_model=8, d_ff=8, next_hidden=4,
                                 next_epochs=3, val_fraction=0.25, seed=0)
    with pytest.warns(UserWarning) as caught:
        info = train(trace, config, progress=False).info
    assert [str(w.message).split(" (")[0] for w in caught] == [
        "the 2 held-out sequences have no known routes", "the 22 held-out token pairs have no known next routes"]
    assert (info["epochs_run"], info["best_epoch"], info["best_val_recall_at_k"], info["stopped_by"]) == \
        (4, 3, None, "epochs")
    head = info["next_head"]
    assert (head["val_pairs"], head["best_epoch"], head["best_val_loss"]) == (0, 2, None)


def test_the_loss_is_the_mean_bce_per_expert_over_known_cells():
    # averaged over experts, and over known cells only (padding and missing cells are not counted)
    from expertflow.predictor.train import _masked_bce

    logits = torch.zeros(1, 2, 1, 4)  # [B, T, L, E]: every expert at probability 1/2
    targets = torch.tensor([[[[1.0, 0, 0, 0]], [[0.0, 1, 0, 0]]]])
    known = torch.tensor([[[1.0], [0.0]]])
    assert float(_masked_bce(logits, targets, known)) == pytest.approx(np.log(2))


def test_validation_recall_of_a_partly_known_route_counts_its_known_experts():
    # a cell whose router named one expert (the other id -1) is fully found when the top-k holds it
    from expertflow.predictor.train import _recall_at_k

    logits = torch.tensor([[[[5.0, 4.0, 0.0, 0.0]]]])
    targets = torch.tensor([[[[1.0, 0.0, 0.0, 0.0]]]])
    assert _recall_at_k(logits, targets, torch.ones(1, 1, 1), 2) == pytest.approx(1.0)


def test_validation_weighs_its_batches_by_their_known_cells():
    # several validation batches give the figures of one batch over all held-out cells
    from expertflow.predictor.train import _masked_bce, _recall_at_k

    trace = concat_traces([synthetic_trace(seqs=3, prompt=2, generated=g, seed=g) for g in (1, 6, 12)])
    run = _run(trace, val_fraction=0.5, batch_tokens=30)
    assert len(length_batches(run.val_set, 30)) > 1
    batch = pad_batch(run.val_set, 8)
    with torch.no_grad():
        logits = run.net(batch["encoder_ids"], batch["encoder_mask"], batch["decoder_ids"], batch["decoder_mask"])
    loss, recall = run.validate()
    assert loss == pytest.approx(float(_masked_bce(logits, batch["targets"], batch["known"])), rel=1e-5)
    assert recall == pytest.approx(_recall_at_k(logits, batch["targets"], batch["known"], 2), rel=1e-5)


def test_ids_that_share_a_row_share_the_mean_of_their_embeddings():
    # "ids that share a row average theirs"
    from expertflow.predictor.train import _init_embeddings

    net = RouteNet(PredictorConfig(vocab_size=20, num_layers=1, num_experts=4, top_k=1, d_model=8, d_ff=8, heads=1,
                                   max_embeddings=8, token_features=2))
    table = torch.arange(40, dtype=torch.float32).reshape(20, 2)
    _init_embeddings(net, table)
    rows = net.embedding_rows(torch.arange(20))
    for row in range(8):
        torch.testing.assert_close(net.features[row].float(), table[rows == row].mean(0).half().float())


def test_an_embedding_table_larger_than_the_vocabulary_is_refused(tmp_path):
    # a table with more tokens than the predictor's vocabulary is not the traced model's
    from safetensors.torch import save_file

    save_file({"model.embed_tokens.weight": torch.randn(20, 4)}, str(tmp_path / "model.safetensors"))
    config = dataclasses.replace(TINY_TRAINING, epochs=1, next_hidden=0, vocab_size=16, init_embeddings=str(tmp_path))
    with pytest.raises(ValueError, match="the embedding table has 20 tokens but the predictor's vocabulary is 16"):
        train(synthetic_trace(seqs=2), config, progress=False)


# -- network settings ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("setting, message", [
    ({"dropout": 1.0}, r"dropout=1.0 must lie in \[0, 1\)"),
    ({"decoder_layers": 0}, "decoder_layers=0 must be at least 1"),
    ({"encoder_layers": -1}, "encoder_layers=-1 must not be negative"),
])
def test_predictor_config_refuses_impossible_networks(setting, message):
    with pytest.raises(ValueError, match=message):
        PredictorConfig(vocab_size=16, num_layers=1, num_experts=4, top_k=1, **setting)


def test_d_model_must_split_evenly_into_heads():
    # named when the settings are read, not a reshape error in the first forward
    with pytest.raises(ValueError, match="d_model=30 must be divisible by heads=4"):
        PredictorConfig(vocab_size=16, num_layers=1, num_experts=4, top_k=1, d_model=30, heads=4)


@pytest.mark.parametrize("bidirectional", [True, False])
def test_relative_position_buckets_are_t5s(bidirectional):
    # the buckets are T5's (exact up to 8 / 16, log-spaced to 128); a saved predictor's position biases are indexed
    # by them, so a different map would silently change every shipped predictor's output
    from transformers.models.t5.modeling_t5 import T5Attention

    from expertflow.predictor.model import relative_bucket

    relative = torch.arange(-300, 301)
    expected = T5Attention._relative_position_bucket(relative, bidirectional=bidirectional, num_buckets=32,
                                                     max_distance=128)
    assert torch.equal(relative_bucket(relative, bidirectional, 32, 128), expected)


@pytest.mark.parametrize("setting, message", [
    ({"relative_buckets": 3}, "relative_buckets=3 must be at least 4: the encoder splits them by direction"),
    ({"relative_max_distance": 8}, "relative_max_distance=8 must be above 16: relative_buckets=32 gives each "
                                   r"distance below 16 a bucket of its own in the decoder \(below 8 in the encoder\)"),
    ({"relative_max_distance": 16}, "relative_max_distance=16 must be above 16"),
    ({"relative_buckets": 8, "relative_max_distance": 4}, "relative_max_distance=4 must be above 4"),
])
def test_relative_position_settings_the_bucket_map_cannot_use_are_refused(setting, message):
    # with fewer buckets the encoder has no exact distance (a division by zero at the first forward); up to the exact
    # range the log-spaced buckets are negative, NaN cast to an index, or collide with exact ones
    with pytest.raises(ValueError, match=message):
        PredictorConfig(vocab_size=16, num_layers=1, num_experts=4, top_k=1, **setting)


def test_the_smallest_relative_position_settings_give_every_distance_a_bucket():
    from expertflow.predictor.model import relative_bucket

    config = PredictorConfig(vocab_size=16, num_layers=1, num_experts=4, top_k=1, d_model=8, d_ff=8, heads=1,
                             relative_buckets=4, relative_max_distance=3)
    relative = torch.arange(-40, 41)
    for bidirectional in (True, False):
        buckets = relative_bucket(relative, bidirectional, config.relative_buckets, config.relative_max_distance)
        assert 0 <= int(buckets.min()) and int(buckets.max()) < 4
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        logits = RouteNet(config).eval()(ids, torch.ones_like(ids), ids, torch.ones_like(ids))
    assert torch.isfinite(logits).all()


def test_long_calls_attend_a_block_of_queries_at_a_time_with_the_same_results(monkeypatch):
    """Past `_SCORES_AT_ONCE` attention scores, a call attends a block of queries at a time with the bias of its
    rows alone (a long prompt's whole [B, H, S, S] took gigabytes): the same outputs, padded or not, in a prompt pass
    and in a later multi-token decoder call, and never more scores at once than the bound."""
    import torch.nn.functional as F

    import expertflow.predictor.model as model_module
    from expertflow.predictor.model import DecoderCache

    net = tiny_net(vocab=50, seed=3)
    ids = torch.randint(1, 50, (2, 40))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0  # left padding

    def run():
        with torch.no_grad():
            encoded = net.encode(ids, mask)
            cross = net.cross_kv(encoded)
            cache = DecoderCache(net.config.decoder_layers)
            first = net.decode(ids[:, :30], mask[:, :30], cross, mask, cache)
            return encoded, first, net.decode(ids[:, 30:], mask, cross, mask, cache)  # after 30 cached

    whole = run()
    attended = []
    sdpa = F.scaled_dot_product_attention

    def recording(q, k, v, attn_mask=None, dropout_p=0.0):
        attended.append(q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2])
        return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p)

    monkeypatch.setattr(model_module, "_SCORES_AT_ONCE", 2 * 2 * 8 * 40)  # blocks of 8 queries
    monkeypatch.setattr(model_module.F, "scaled_dot_product_attention", recording)
    blocks = run()
    # blocks of 8 queries over 40 keys (10 over 30): encoder 5; first 30 decoded, per layer 3 (self) + 4 (cross); the
    # other 10, per layer 2 + 2
    assert max(attended) <= 2 * 2 * 8 * 40 and len(attended) == 5 + 2 * (3 + 4) + 2 * (2 + 2)
    for a, b in zip(whole, blocks):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_blocks_position_bias_is_the_whole_ones_rows():
    net = tiny_net()
    for position in (net.encoder_bias, net.decoder_bias):
        for start, queries, keys in ((0, 7, 7), (3, 5, 12), (100, 50, 400), (9, 1, 10)):
            block = position.block(start, queries, keys)
            assert torch.equal(block, position(start, queries, keys)) and block.is_contiguous()


def test_a_vocabulary_that_fits_the_table_is_embedded_by_id():
    # vocab_size <= max_embeddings: the id is the row (only larger vocabularies are hashed; at 7 rows the hash would
    # move every id but 0)
    net = RouteNet(PredictorConfig(vocab_size=7, num_layers=1, num_experts=4, top_k=1, d_model=8, d_ff=8, heads=1,
                                   max_embeddings=7))
    assert net.embedding_rows(torch.arange(7)).tolist() == list(range(7))


def test_with_token_features_the_learned_embedding_starts_at_zero():
    # a token never trained on is placed by its features alone (docs/predictor.md, Token features)
    net = RouteNet(PredictorConfig(vocab_size=16, num_layers=1, num_experts=4, top_k=1, d_model=8, d_ff=8, heads=1,
                                   token_features=4))
    assert not net.embed.weight.any()


# -- metrics and baselines on a hand-made case -----------------------------------------------------------------------
def hand_trace() -> Trace:
    # Two sequences (E = 4, L = 2, top-2), each: one prompt token, then two decode tokens.
    routes = {  # (seq, position): (layer-0 experts, layer-1 experts)
        (0, 0): ([0, 1], [2, 3]), (0, 1): ([0, 1], [0, 1]), (0, 2): ([2, 3], [0, 1]),
        (1, 0): ([0, 1], [0, 1]), (1, 1): ([0, 2], [0, 1]), (1, 2): ([2, 3], [2, 3]),
    }
    keys = sorted(routes)
    return Trace(experts=np.array([routes[k] for k in keys]), num_experts=4, token_ids=[3, 4, 5, 6, 7, 8],
                 seq_ids=[s for s, _ in keys], positions=[p for _, p in keys], steps=[0, 1, 2, 3, 4, 5],
                 phase=[0 if p == 0 else 1 for _, p in keys])


def hand_prediction() -> np.ndarray:
    guesses = [([0, 1], [2, 3]), ([0, 1], [2, 3]), ([2, 3], [0, 1]),
               ([0, 1], [0, 1]), ([0, 1], [0, 1]), ([0, 1], [2, 3])]
    return route_sets(np.array(guesses), 4)


def test_b_acc_by_hand():
    # Batch size 2, decode steps: step 1 = tokens (0,1), (1,1); step 2 = (0,2), (1,2).
    # Step 1, layer 0: R = {0,1} | {0,2} = {0,1,2}, R^ = {0,1} -> 2/3; layer 1: R = {0,1}, R^ = {0,1,2,3} -> 1.
    # Step 2, layer 0: R = {2,3}, R^ = {0,1,2,3} -> 1; layer 1: R = {0,1,2,3}, R^ = {0,1,2,3} -> 1.
    # b_acc = mean(5/6, 1) = 11/12; per layer: (5/6, 1).
    trace = hand_trace()
    scores = route_scores(trace, hand_prediction(), batch_size=2)
    assert scores["b_acc"] == pytest.approx(11 / 12, abs=1e-4)
    assert scores["per_layer_b_acc"] == pytest.approx([5 / 6, 1.0], abs=1e-4)
    # Token recall over the 8 decode cells: 1, 0 | 1, 1 | 1/2, 1 | 0, 1 -> 5.5 / 8.
    assert scores["token_recall_at_k"] == pytest.approx(5.5 / 8, abs=1e-4)
    assert scores["token_precision_at_k"] == pytest.approx(5.5 / 8, abs=1e-4)
    # Batch size 1: each batch is one token, so b_acc is the mean over tokens of their mean layer recall.
    assert route_scores(trace, hand_prediction(), batch_size=1)["b_acc"] == pytest.approx(5.5 / 8, abs=1e-4)


def test_b_acc_weighs_each_batch_once_when_a_batch_lacks_a_layer():
    # Batch 0 knows layers 0 and 1: recalls 1 and 0 -> 1/2. Batch 1 knows only layer 0: recall 1 -> 1.
    # b_acc = mean(1/2, 1) = 3/4 (weighing the three known cells alike would give 2/3); per layer (1, 0).
    true = route_sets(np.array([[[0], [1]], [[2], [-1]]]), 4)
    pred = route_sets(np.array([[[0], [2]], [[2], [3]]]), 4)  # the guess for the missing cell counts nowhere
    b_acc, per_layer = batch_accuracy(true, pred, steps=np.array([0, 1]))
    assert b_acc == pytest.approx(3 / 4) and per_layer == pytest.approx([1.0, 0.0])


def test_next_token_recall_by_hand():
    # The guess made at each token is scored on the next token of its sequence (decode tokens only):
    # (0,0)->(0,1): layer 0 {0,1} vs {0,1} = 1, layer 1 {2,3} vs {0,1} = 0; (0,1)->(0,2): 0, 0;
    # (1,0)->(1,1): {0,1} vs {0,2} = 1/2, {0,1} vs {0,1} = 1; (1,1)->(1,2): 0, 0.  -> 2.5 / 8.
    # The current token's own routes: 1, 0 | 0, 1 | 1/2, 1 | 1/2, 0 -> 4 / 8.
    scores = next_token_recall(hand_trace(), hand_prediction().astype(float))
    assert scores == {"next_token_head": pytest.approx(2.5 / 8), "current_routes": pytest.approx(4 / 8), "tokens": 4}
    assert next_token_recall(hand_trace(), hand_prediction().astype(float), phase="prefill") == \
        {"next_token_head": None, "current_routes": None, "tokens": 0}  # nothing measured, not a recall of 0


def test_metrics_ignore_missing_ids_and_count_precision_of_wider_guesses():
    true = route_sets(np.array([[[0, -1]], [[-1, -1]]]), 4)  # token 0 knows one expert, token 1 none
    pred = route_sets(np.array([[[0, 1]], [[2, 3]]]), 4)
    assert token_scores(true, pred) == {"token_recall_at_k": 1.0, "token_precision_at_k": 0.5}
    b_acc, per_layer = batch_accuracy(true, pred, np.array([0, 0]))
    assert (b_acc, per_layer) == (1.0, [1.0])


def test_a_guess_for_a_missing_route_counts_on_neither_side_of_b_acc():
    # One batch: token 0's route {0, 1} is guessed as {2, 3}; token 1's route is missing and guessed as {0, 1}.
    # R = {0, 1}, R^ = {2, 3} (token 1's guess is not scored): b_acc 0, as the token recall says.
    true = route_sets(np.array([[[0, 1]], [[-1, -1]]]), 4)
    pred = route_sets(np.array([[[2, 3]], [[0, 1]]]), 4)
    assert batch_accuracy(true, pred, np.array([0, 0])) == (0.0, [0.0])
    assert token_scores(true, pred)["token_recall_at_k"] == 0.0
    # a partly known route is a known cell: its guess counts
    true = route_sets(np.array([[[0, -1]], [[1, 2]]]), 4)
    assert batch_accuracy(true, route_sets(np.array([[[2, 3]], [[0, 3]]]), 4), np.array([0, 0]))[0] == 2 / 3


def test_nothing_to_score_is_refused_not_reported_as_zero():
    trace = hand_trace()
    decode = trace.phase == 1
    trace.experts[decode] = -1
    with pytest.raises(ValueError, match="the trace's decode tokens have no known routes"):
        route_scores(trace, hand_prediction(), batch_size=2)
    assert route_scores(trace, hand_prediction(), batch_size=2, phase="prefill")["b_acc"] == 1.0


def test_an_empty_guess_counts_in_recall_but_not_in_precision():
    true = route_sets(np.array([[[0, 1]], [[2, 3]]]), 4)
    pred = route_sets(np.array([[[0, 1]], [[-1, -1]]]), 4)  # token 1: no guess (prev_step at a first token)
    assert token_scores(true, pred) == {"token_recall_at_k": 0.5, "token_precision_at_k": 1.0}


def test_precision_without_any_guess_is_undefined_not_zero():
    true = route_sets(np.array([[[0, 1]], [[2, 3]]]), 4)
    none = route_sets(np.full((2, 1, 2), -1), 4)  # prev_step on first tokens only
    assert token_scores(true, none) == {"token_recall_at_k": 0.0, "token_precision_at_k": None}


def test_top_k_sets_breaks_ties_by_lower_id():
    np.testing.assert_array_equal(top_k_sets(np.array([[0.1, 0.5, 0.5, 0.2]]), 2), [[False, True, True, False]])


def test_baselines_by_hand():
    trace = hand_trace()
    counts = np.array([[5, 4, 1, 0], [0, 1, 3, 2]])
    # prev_step: each decode token guesses its predecessor's route.
    # recall cells: (0,1): 1, 0 | (0,2): 0, 1 | (1,1): 1/2, 1 | (1,2): 1/2, 0 -> 4 / 8
    assert route_scores(trace, baselines.prev_step(trace), 1)["token_recall_at_k"] == pytest.approx(0.5)
    # prev_layer: layer 0 = frequency top-2 {0,1}; layer 1 = own layer-0 route.
    # layer 0: 1, 0, 1/2, 0; layer 1: 1, 0, 1/2, 1 -> 4 / 8
    assert route_scores(trace, baselines.prev_layer(trace, counts), 1)["token_recall_at_k"] == pytest.approx(0.5)
    # frequency: {0,1} at layer 0 (1, 0, 1/2, 0) and {2,3} at layer 1 (0, 0, 0, 1) -> 2.5 / 8
    freq = baselines.frequency(trace, counts)
    assert route_scores(trace, freq, 1)["token_recall_at_k"] == pytest.approx(2.5 / 8)
    np.testing.assert_array_equal(baselines.expert_counts(trace), [[4, 3, 3, 2], [4, 4, 2, 2]])
    with pytest.raises(ValueError, match="expert counts"):
        baselines.frequency(trace, counts[:1])


def test_per_layer_b_acc_averages_only_the_batches_that_know_the_layer():
    # batch 0 knows both layers (layer 1 right), batch 1 only layer 0: layer 1's figure is batch 0's alone
    true = route_sets(np.array([[[0], [1]], [[2], [-1]]]), 4)
    pred = route_sets(np.array([[[0], [1]], [[3], [3]]]), 4)
    b_acc, per_layer = batch_accuracy(true, pred, steps=np.array([0, 1]))
    assert per_layer == pytest.approx([0.5, 1.0]) and b_acc == pytest.approx(0.5)


def test_phase_all_scores_prompt_and_decode_tokens():
    # the prompt tokens' 4 cells are right: (5.5 + 4) / 12
    scores = route_scores(hand_trace(), hand_prediction(), batch_size=1, phase="all")
    assert scores["token_recall_at_k"] == pytest.approx(9.5 / 12, abs=1e-4)


def test_next_token_recall_refuses_an_offset_below_one():
    with pytest.raises(ValueError, match="offset=0 must be at least 1"):
        next_token_recall(hand_trace(), hand_prediction().astype(float), offset=0)


def test_next_token_recall_scores_only_following_tokens_with_a_known_route():
    # token (0, 2) has no route: of the hand-worked pairs, (0,0)->(0,1), (1,0)->(1,1) and (1,1)->(1,2) are left;
    # the head's 1, 0 | 1/2, 1 | 0, 0 -> 2.5 / 6, the current token's routes 1, 0 | 1/2, 1 | 1/2, 0 -> 3 / 6
    trace = hand_trace()
    trace.experts[2] = -1
    guess = hand_prediction().astype(float)
    assert next_token_recall(trace, guess) == \
        {"next_token_head": pytest.approx(2.5 / 6), "current_routes": pytest.approx(3 / 6), "tokens": 3}
    trace.experts[trace.phase == 1] = -1  # following tokens, none with a route: nothing measured, not a recall of 0
    assert next_token_recall(trace, guess) == {"next_token_head": None, "current_routes": None, "tokens": 0}


def test_top_k_ties_go_to_the_lower_id_whichever_ids_tie():
    # ties among more than k experts go to the lower ids (metrics docstring, frequency baseline)
    np.testing.assert_array_equal(top_k_sets(np.array([[0.5, 0.5, 0.5, 0.1]]), 2), [[True, True, False, False]])
    trace = hand_trace()
    freq = baselines.frequency(trace, np.array([[3, 3, 3, 0], [0, 2, 2, 2]]))
    np.testing.assert_array_equal(freq[0], [[True, True, False, False], [False, True, True, False]])


def test_prev_step_has_no_guess_for_a_sequences_first_token():
    # not the previous sequence's last token
    trace = hand_trace()
    guess = baselines.prev_step(trace)
    assert not guess[trace.positions == 0].any()
    scores = route_scores(trace, guess, batch_size=1, phase="prefill")
    assert scores["token_precision_at_k"] is None and scores["token_recall_at_k"] == 0.0


def test_prev_step_follows_positions_whatever_order_the_rows_come_in():
    # prompt tokens share a step; the row order of a trace is not a promise
    trace = synthetic_trace(seqs=2, prompt=4, generated=2)
    order = np.random.default_rng(0).permutation(trace.num_tokens)
    shuffled = _rows(trace, order)
    np.testing.assert_array_equal(baselines.prev_step(shuffled), baselines.prev_step(trace)[order])


def test_frequency_without_training_counts_guesses_nothing():
    # zero counts are no counts: no guess (precision undefined), not experts 0 .. k-1
    trace = hand_trace()
    guess = baselines.frequency(trace, np.zeros((2, 4), dtype=np.int64))
    assert not guess.any()


def test_evaluate_scores_the_predictors_top_k_and_each_baseline_by_its_own_rule():
    # the report is route_scores of the top-k and of each baseline's own guess
    trace = hand_trace()
    counts = np.array([[5, 4, 1, 0], [0, 1, 3, 2]])
    net = RouteNet(PredictorConfig(vocab_size=16, num_layers=2, num_experts=4, top_k=2, d_model=16, d_ff=32,
                                   heads=2)).eval()
    predictor = RoutePredictor(net, counts)
    report = evaluate(predictor, trace, batch_size=2, phase="all")
    pred = top_k_sets(predict_trace(predictor, trace), 2)
    assert {k: report[k] for k in ("b_acc", "token_recall_at_k", "token_precision_at_k", "per_layer_b_acc")} == \
        route_scores(trace, pred, 2, "all")
    expected = {"prev_step": baselines.prev_step(trace), "prev_layer": baselines.prev_layer(trace, counts),
                "frequency": baselines.frequency(trace, counts)}
    for name, guess in expected.items():
        assert report["baselines"][name] == route_scores(trace, guess, 2, "all"), name


def test_predict_trace_equals_prefill_then_decode(trained):
    trace, predictor, _ = trained
    probs = predict_trace(predictor, trace)  # teacher-forced, whole sequences at once
    first = sequences(trace)[0]
    n = len(first.prompt)
    session = predictor.new_session()
    online = [session.prefill(torch.from_numpy(first.prompt)[None])[0]]
    online += [session.decode(torch.tensor([[tok]]))[0] for tok in first.tokens[n:].tolist()]
    torch.testing.assert_close(torch.from_numpy(probs[first.index]), torch.cat(online), atol=1e-5, rtol=1e-4)


# -- examples and batches --------------------------------------------------------------------------------------------
def test_a_sequences_tokens_are_in_position_order_whatever_their_steps():
    # the decoder reads a sequence "in position order" (docs/predictor.md, Training); steps only break ties
    trace = hand_trace()
    trace.steps[:] = [0, 2, 1, 3, 5, 4]  # each sequence's last two tokens recorded in the other order
    first = sequences(trace)[0]
    np.testing.assert_array_equal(first.tokens, [3, 4, 5])
    np.testing.assert_array_equal(first.index, [0, 1, 2])


def test_the_digest_tells_where_one_sequence_ends_and_the_next_begins():
    # the same token ids cut into other sequences are other sequences (and another validation split)
    def example(tokens):
        tokens = np.array(tokens, dtype=np.int64)
        return SequenceExample(0, tokens[:1], tokens, np.zeros((len(tokens), 1, 1), np.int32), np.arange(len(tokens)))

    assert sequences_digest([example([1, 2]), example([3])]) != sequences_digest([example([1]), example([2, 3])])


def test_model_names_are_compared_whatever_their_case():
    # a model's last path part, lower-case (a case-insensitive file system may give the other spelling)
    assert same_model("/data/models/Tiny-MoE", "/home/me/tiny-moe/")


def test_a_snapshot_in_the_hub_cache_is_the_model_its_hub_id_names():
    """`trace record --model` takes a directory: for a model in the Hugging Face cache that is a snapshot, whose last
    part is a commit hash; the same model loaded by hub id is named `org/name`."""
    snapshot = "/root/.cache/huggingface/hub/models--mistralai--Mixtral-8x7B-v0.1/snapshots/0a1b2c3d4e/"
    assert same_model(snapshot, "mistralai/Mixtral-8x7B-v0.1")
    assert same_model(snapshot, "/models/mixtral-8x7b-v0.1")
    assert not same_model(snapshot, "Qwen/Qwen1.5-MoE-A2.7B")
    assert not same_model("/cache/models--org--a/snapshots/1234", "/cache/models--org--b/snapshots/1234")
    # only a snapshot directory itself: a folder of models named like a cache entry keeps its models' own names
    assert same_model("/data/models--archive/tiny-moe", "/work/tiny-moe")
    assert not same_model("/data/models--archive/tiny-moe", "archive")
    assert not same_model("/cache/models--org--a/snapshots/1234/sub-a", "/cache/models--org--a/snapshots/1234/sub-b")


def test_a_layer_with_some_expert_ids_missing_is_a_known_cell():
    # known = at least one id >= 0 (the -1 ids are ignored, the cell is not); a layer with none is unknown
    hot, known = multi_hot(np.array([[[0, -1], [-1, -1]]]), 4)
    np.testing.assert_array_equal(known, [[True, False]])
    np.testing.assert_array_equal(hot[0, 0], [1, 0, 0, 0])
    trace = hand_trace()
    trace.experts[1, 0, 1] = -1  # token (0, 1): layer 0 partly known
    trace.experts[2, 1] = -1  # token (0, 2): layer 1 unknown
    batch = pad_batch(sequences(trace), 4)
    np.testing.assert_array_equal(batch["known"][0].numpy(), [[1, 1], [1, 1], [1, 0]])


def test_pad_batch_masks_exactly_each_sequences_prompt_and_tokens():
    # right padding is masked in the encoder, the decoder and the loss
    short, full = synthetic_trace(seqs=1, prompt=2, generated=1, seed=1), synthetic_trace(seqs=1, seed=2)
    batch = pad_batch(sequences(full) + sequences(short), 8)
    assert batch["encoder_mask"].tolist() == [[1] * 6, [1, 1, 0, 0, 0, 0]]
    assert batch["decoder_mask"].tolist() == [[1] * 11, [1] * 3 + [0] * 8]
    assert batch["known"][1].sum(-1).tolist() == [2] * 3 + [0] * 8


def test_predicting_a_trace_gives_each_sequence_what_it_gets_alone():
    # sequences of different lengths share padded batches: the padding changes nothing, and each row's predictions
    # go back to its own trace rows
    predictor = RoutePredictor(tiny_net())
    predictor.net.next_head = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.GELU(), torch.nn.Linear(8, 32))
    predictor.net.config = dataclasses.replace(predictor.config, next_hidden=8, next_windows=(1, 2))
    parts = [synthetic_trace(seqs=1, prompt=p, generated=g, seed=p) for p, g in ((6, 5), (2, 1), (4, 3))]
    joined = concat_traces(parts)
    probs, after = predict_trace(predictor, joined, with_next=True)
    start = 0
    for part in parts:
        alone, alone_after = predict_trace(predictor, part, with_next=True)
        rows = slice(start, start + part.num_tokens)
        np.testing.assert_allclose(probs[rows], alone, atol=1e-5)
        np.testing.assert_allclose(after[rows], alone_after, atol=1e-5)
        start += part.num_tokens


def test_a_trace_without_prompt_tokens_is_still_predicted():
    # an empty prompt keeps one masked encoder slot (imported decode-only logs have no prefill rows)
    trace = synthetic_trace(seqs=2, prompt=3, generated=3)
    trace.phase[:] = 1
    batch = pad_batch(sequences(trace))
    assert batch["encoder_ids"].shape == (2, 1) and batch["encoder_mask"].tolist() == [[0], [0]]
    assert np.isfinite(predict_trace(RoutePredictor(tiny_net()), trace)).all()


def _lengths(*lengths: int) -> list[SequenceExample]:
    """Examples of these token counts (one prompt token each)."""
    return [SequenceExample(i, np.zeros(1, np.int64), np.zeros(n, np.int64), np.zeros((n, 1, 1), np.int32),
                            np.arange(n)) for i, n in enumerate(lengths)]


def test_length_batches_hold_at_most_max_tokens_padded_tokens_and_may_fill_them():
    # the padded size counts the sequence that joins, and exactly max_tokens is allowed
    examples = _lengths(2, 5, 4, 4)
    batches = length_batches(examples, 8)
    for batch in batches:
        assert max(len(examples[i].tokens) for i in batch) * len(batch) <= 8
    assert sorted(map(sorted, batches)) == [[0, 2], [1], [3]]  # 2 + 4 fill 8 exactly


def test_length_batches_with_a_generator_come_in_shuffled_order():
    # training batches are not always shortest first: one sequence a batch, lengths 10 apart (more than their jitter
    # moves them), so only the shuffle can put a longer one first
    examples = _lengths(*range(10, 210, 10))
    orders = [[b[0] for b in length_batches(examples, 10, np.random.default_rng(seed))] for seed in range(5)]
    assert any(order != sorted(order, key=lambda i: len(examples[i].tokens)) for order in orders)


# -- next-token head -------------------------------------------------------------------------------------------------
def counting_trace(seqs: int = 16, length: int = 12, vocab: int = 12, layers: int = 2, experts: int = 8) -> Trace:
    """Batch-1 trace whose tokens count up (3, 4, …, wrapping) from a random start and whose top-2 routes are a
    function of the token: the next token, hence its routes, follows from the current one."""
    rng = np.random.default_rng(1)
    rows = {k: [] for k in _FIELDS}
    step = 0
    for s in range(seqs):
        start = int(rng.integers(0, vocab - 3))
        for pos in range(length):
            tok = 3 + (start + pos) % (vocab - 3)
            rows["experts"].append([[(tok + layer) % experts, (3 * tok + layer + 1) % experts]
                                    for layer in range(layers)])
            rows["token_ids"].append(tok)
            rows["seq_ids"].append(s)
            rows["positions"].append(pos)
            rows["phase"].append(0 if pos < 4 else 1)
            rows["steps"].append(step if pos < 4 else step + pos - 3)
        step += length - 3
    return Trace(num_experts=experts, model="synthetic", source="test", **{k: np.array(v) for k, v in rows.items()})


def _next_recall(trace: Trace, guess: np.ndarray, offset: int = 1) -> float:
    """Top-k recall of `guess[i]` (per token) against the routes of the token `offset` places after token i in its
    sequence."""
    hits = cells = 0
    for example in sequences(trace):
        for i, j in zip(example.index[:-offset], example.index[offset:]):
            for layer in range(trace.num_layers):
                top = np.argsort(-guess[i, layer], kind="stable")[:trace.top_k]
                hits += len(set(top.tolist()) & set(trace.experts[j, layer].tolist()))
                cells += trace.top_k
    return hits / cells


def test_next_head_learns_the_following_tokens_routes_and_leaves_the_rest_alone():
    from dataclasses import replace

    trace = counting_trace()
    predictor = train(trace, replace(TINY_TRAINING, next_hidden=0), progress=False)
    assert not predictor.has_next_head
    with pytest.raises(ValueError, match="fit-next"):
        predict_trace(predictor, trace, with_next=True)
    before = predict_trace(predictor, trace)
    facts = fit_next_head(predictor, trace, hidden=32, epochs=40, batch=16, progress=False)
    assert predictor.has_next_head and predictor.config.next_hidden == 32
    assert predictor.info["next_head"] == facts
    probs, after = predict_trace(predictor, trace, with_next=True)
    assert after.shape == (trace.num_tokens, 8, 2, 8)  # the next 8 tokens by default, in windows 1, 2, 3-4, 5-8
    np.testing.assert_array_equal(after[:, 2], after[:, 3])  # one guess for a window, shared by its tokens
    np.testing.assert_array_equal(probs, before)  # the rest of the network is frozen
    learned, naive = _next_recall(trace, after[:, 0]), _next_recall(trace, probs)
    assert learned > 0.8 and learned > naive + 0.4, (learned, naive)  # its own routes: a poor guess of the next
    assert _next_recall(trace, after[:, 1], offset=2) > 0.7  # two tokens ahead: counting up, just as predictable


def test_window_targets_are_the_union_of_their_tokens_routes():
    from expertflow.predictor.train import _next_pairs

    trace = counting_trace(seqs=1)
    example = sequences(trace)[0]
    net = RouteNet(PredictorConfig(vocab_size=16, num_layers=2, num_experts=8, top_k=2, d_model=16, d_ff=32, heads=2))
    x, y, known = _next_pairs(net, [example], (1, 3))  # t+1; any of t+2, t+3
    n = len(example.index)
    assert x.shape == (n - 1, 16) and y.shape == (n - 1, 2, 2, 8) and known.shape == (n - 1, 2, 2)
    routes = trace.experts[example.index]  # [n, L, k] in sequence order
    for i in range(n - 1):
        for layer in range(2):
            assert set(np.flatnonzero(y[i, 0, layer].numpy())) == set(routes[i + 1, layer].tolist())
            later = set(routes[i + 2:i + 4, layer].ravel().tolist())  # fewer (or none) at the sequence's end
            assert set(np.flatnonzero(y[i, 1, layer].numpy())) == later
    assert known[:, 0].all() and known[:-1, 1].all() and not known[-1, 1].any()  # t+2 lies past the end


def test_window_chances_spread_over_their_tokens():
    from expertflow.predictor.model import window_token_probs

    p = torch.rand(5, 3, 2, 4)  # [B, W, L, E] for windows t+1, any of t+2 … t+3, t+4
    out = window_token_probs(p, (1, 3, 4))
    assert out.shape == (5, 4, 2, 4)
    torch.testing.assert_close(out[:, 0], p[:, 0])
    torch.testing.assert_close(out[:, 3], p[:, 2])
    torch.testing.assert_close(out[:, 1], out[:, 2])
    torch.testing.assert_close(1 - (1 - out[:, 1]) * (1 - out[:, 2]), p[:, 1])  # the window's own chance
    assert window_token_probs(p, (1, 2, 3)) is p  # one token per window: as given


def test_config_windows_checked_and_older_files_read():
    base = dict(vocab_size=16, num_layers=2, num_experts=8, top_k=2)
    assert PredictorConfig(**base, next_windows=[1, 2, 4]).next_windows == (1, 2, 4)
    assert PredictorConfig(**base, next_windows=[1, 2, 4]).next_tokens == 4
    for bad in ([], [0, 1], [2, 2], [3, 1]):
        with pytest.raises(ValueError, match="increasing offsets"):
            PredictorConfig(**base, next_windows=bad)
    assert PredictorConfig.from_dict({**base, "next_offsets": 3}).next_windows == (1, 2, 3)  # one per token
    saved = PredictorConfig(**base, next_hidden=8, next_windows=(1, 2, 4, 8)).to_dict()
    assert PredictorConfig.from_dict(json.loads(json.dumps(saved))).next_windows == (1, 2, 4, 8)


def test_session_next_probs_equal_the_teacher_forced_ones(trained, tmp_path):
    trace, predictor, _ = trained
    assert predictor.has_next_head  # train() fits one by default
    _, after = predict_trace(predictor, trace, with_next=True)
    first = sequences(trace)[0]
    n = len(first.prompt)
    session = predictor.new_session()
    session.prefill(torch.from_numpy(first.prompt)[None])
    online = [session.next_probs]
    for tok in first.tokens[n:].tolist():
        session.decode(torch.tensor([[tok]]))
        online.append(session.next_probs)
    torch.testing.assert_close(torch.cat(online), torch.from_numpy(after[first.index[n - 1:]]), atol=1e-5, rtol=1e-4)
    # right padding: a row's guess comes from its last real token, not from the padding after it
    ids = torch.tensor([[3, 4, 5, 6], [7, 8, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    session.prefill(ids, mask)
    alone = predictor.new_session()
    alone.prefill(ids[1:, :2])
    torch.testing.assert_close(session.next_probs[1], alone.next_probs[0], atol=1e-5, rtol=1e-4)
    back = load_predictor(_saved(predictor, tmp_path))
    with safe_open(str(tmp_path / "p" / "model.safetensors"), "pt") as f:  # the head is stored in fp16
        assert {f.get_slice(k).get_dtype() for k in f.keys() if k.startswith("next_head.")} == {"F16"}
    assert back.net.next_head[0].weight.dtype == torch.float32  # and computes in fp32, as before saving
    back_session = back.new_session()
    back_session.prefill(ids[:1])
    session.prefill(ids[:1])
    torch.testing.assert_close(back_session.next_probs, session.next_probs)


def test_fit_next_with_another_seed_does_not_warn_about_the_training_split():
    # the warning is about redrawing the network's split; another seed draws another split on purpose
    predictor = train(synthetic_trace(seqs=4, seed=1), dataclasses.replace(TINY_TRAINING, epochs=1, next_hidden=0),
                      progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fit_next_head(predictor, synthetic_trace(seqs=4, seed=2), hidden=4, epochs=1, seed=5, progress=False)


def test_the_next_token_head_keeps_its_epoch_of_lowest_validation_loss():
    # the best epoch on validation, not the last one (lr high enough that the loss goes up again)
    predictor = train(synthetic_trace(seqs=8), dataclasses.replace(TINY_TRAINING, epochs=1, next_hidden=0),
                      progress=False)
    facts = fit_next_head(predictor, synthetic_trace(seqs=8), hidden=16, epochs=6, lr=0.3, batch=8, progress=False)
    losses = [h["val_loss"] for h in facts["history"]]
    assert facts["best_epoch"] == int(np.argmin(losses)) != len(losses) - 1
    assert facts["best_val_loss"] == min(losses)


def test_the_next_token_heads_learning_rate_decays_to_five_percent(monkeypatch):
    # "AdamW (lr 3e-3, cosine decay)", to 5 % as the network's
    import expertflow.predictor.train as train_module

    made = []
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR

    class Recording(cosine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(train_module.torch.optim.lr_scheduler, "CosineAnnealingLR", Recording)
    predictor = train(synthetic_trace(seqs=4), dataclasses.replace(TINY_TRAINING, epochs=1, next_hidden=0),
                      progress=False)
    fit_next_head(predictor, synthetic_trace(seqs=4), hidden=4, epochs=2, lr=1e-2, progress=False)
    assert made[-1].optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.05)


def _saved(predictor: RoutePredictor, path) -> str:
    predictor.save(path / "p")
    return str(path / "p")


# -- command line ----------------------------------------------------------------------------------------------------
def test_cli_train_and_eval_json(tmp_path, capsys):
    trace = synthetic_trace()
    trace.save(tmp_path / "t.safetensors")
    out = tmp_path / "p"
    assert main(["predictor", "train", "--trace", str(tmp_path / "t.safetensors"), "--out", str(out), "--epochs", "1",
                 "--d-model", "16", "--d-ff", "32", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["out"] == str(out)
    assert main(["predictor", "eval", "--predictor", str(out), "--trace", str(tmp_path / "t.safetensors"),
                 "--batch-size", "4", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) == EVAL_KEYS and report["batch_size"] == 4
    assert set(report["baselines"]) == {"prev_step", "prev_layer", "frequency"}
    assert all(set(v) == METRIC_KEYS for v in report["baselines"].values())
    assert len(report["per_layer_b_acc"]) == 2


def test_cli_fit_next_json(tmp_path, capsys):
    trace = counting_trace(seqs=4)
    trace.save(tmp_path / "t.safetensors")
    out = tmp_path / "p"
    assert main(["predictor", "train", "--trace", str(tmp_path / "t.safetensors"), "--out", str(out), "--epochs", "1",
                 "--d-model", "16", "--d-ff", "32", "--next-hidden", "0", "--json"]) == 0
    capsys.readouterr()
    assert not load_predictor(out).has_next_head
    assert main(["predictor", "fit-next", "--predictor", str(out), "--trace", str(tmp_path / "t.safetensors"),
                 "--hidden", "8", "--epochs", "2", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["out"] == str(out) and summary["hidden"] == 8 and summary["pairs"] > 0
    assert load_predictor(out).has_next_head and summary["windows"] == [1, 2, 4, 8]
    assert main(["predictor", "fit-next", "--predictor", str(out), "--trace", str(tmp_path / "t.safetensors"),
                 "--hidden", "8", "--epochs", "1", "--windows", "1,3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["windows"] == [1, 3]
    assert load_predictor(out).config.next_windows == (1, 3)
    assert main(["predictor", "fit-next", "--predictor", str(out), "--trace", str(tmp_path / "t.safetensors"),
                 "--hidden", "8", "--epochs", "1", "--offsets", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["windows"] == [1, 2]
    assert main(["predictor", "fit-next", "--predictor", str(out), "--trace", str(tmp_path / "t.safetensors"),
                 "--hidden", "0", "--json"]) == 2
    assert "--hidden 0 must be at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["predictor", "fit-next", "--predictor", str(out), "--trace", str(tmp_path / "t.safetensors"),
              "--windows", "4,2"])
    assert "give increasing offsets" in capsys.readouterr().err


def test_cli_fit_next_without_validation_writes_strict_json(tmp_path, capsys):
    trace = counting_trace(seqs=1)  # one sequence: nothing left to validate the next-token head on
    trace.save(tmp_path / "t.safetensors")
    out = tmp_path / "p"
    assert main(["predictor", "train", "--trace", str(tmp_path / "t.safetensors"), "--out", str(out), "--epochs", "1",
                 "--d-model", "16", "--d-ff", "32", "--next-hidden", "0", "--json"]) == 0
    capsys.readouterr()
    assert main(["predictor", "fit-next", "--predictor", str(out), "--trace", str(tmp_path / "t.safetensors"),
                 "--hidden", "8", "--epochs", "1", "--json"]) == 0
    strict = {"parse_constant": lambda name: pytest.fail(f"{name} is not JSON")}
    assert json.loads(capsys.readouterr().out, **strict)["best_val_loss"] is None
    json.loads((out / "config.json").read_text(), **strict)


def test_cli_fit_next_validates_on_the_predictors_own_split(tmp_path, capsys):
    counting_trace(seqs=10).save(tmp_path / "t.safetensors")
    common = ["--trace", str(tmp_path / "t.safetensors"), "--json"]
    assert main(["predictor", "train", *common, "--out", str(tmp_path / "p"), "--epochs", "1", "--d-model", "16",
                 "--d-ff", "32", "--seed", "3", "--val-fraction", "0.3", "--next-hidden", "8",
                 "--next-epochs", "2"]) == 0
    fitted = json.loads((tmp_path / "p" / "config.json").read_text())["info"]["next_head"]
    refit = ["predictor", "fit-next", "--predictor", str(tmp_path / "p"), *common, "--hidden", "8", "--epochs", "2"]
    assert main([*refit, "--out", str(tmp_path / "q")]) == 0
    capsys.readouterr()
    again = json.loads((tmp_path / "q" / "config.json").read_text())["info"]["next_head"]
    assert (again["seed"], again["val_fraction"]) == (3, 0.3)
    assert again["val_pairs"] == fitted["val_pairs"] == 3 * 11 and again["history"] == fitted["history"]
    assert main([*refit, "--out", str(tmp_path / "r"), "--seed", "0", "--val-fraction", "0.1"]) == 0  # flags win
    summary = json.loads(capsys.readouterr().out)
    assert (summary["seed"], summary["val_fraction"], summary["val_pairs"]) == (0, 0.1, 11)


def test_train_refuses_a_split_that_leaves_the_next_token_head_nothing_before_training():
    from dataclasses import replace

    whole = synthetic_trace(seqs=3, prompt=3, generated=4)
    keep = ~((whole.seq_ids < 2) & (whole.positions > 0))  # sequences 0 and 1 keep one token, sequence 2 all seven
    trace = _rows(whole, keep)
    with pytest.raises(ValueError, match=r"all fall in the validation split \(1 held out\)"):
        train(trace, replace(TINY_TRAINING, seed=0), progress=False)  # seed 0 holds out sequence 2
    predictor = train(trace, replace(TINY_TRAINING, epochs=1, next_hidden=0, val_fraction=0), progress=False)
    with pytest.raises(ValueError, match="all fall in the validation split"):
        fit_next_head(predictor, trace, hidden=4, epochs=1, seed=0, val_fraction=0.1, progress=False)


def test_cli_eval_names_a_missing_predictor(tmp_path, capsys):
    synthetic_trace(seqs=1).save(tmp_path / "t.safetensors")
    assert main(["predictor", "eval", "--predictor", str(tmp_path / "none"), "--trace",
                 str(tmp_path / "t.safetensors"), "--json"]) == 2
    assert "not a route predictor directory" in capsys.readouterr().err


@pytest.mark.skipif(not (default_predictor_path() / "config.json").is_file(), reason="no shipped predictor")
def test_shipped_predictor_loads_and_fits_the_tiny_moe():
    predictor = load_predictor(default_predictor_path())
    assert (predictor.config.num_layers, predictor.config.num_experts, predictor.config.top_k) == (6, 32, 4)
    assert (default_predictor_path() / "model.safetensors").stat().st_size <= 8_000_000  # the size budget: 8 MB
    probs = predictor.new_session().prefill(torch.tensor([[1, 100, 200]]))
    assert probs.shape == (1, 3, 6, 32)


def test_fit_next_names_damaged_split_settings_and_knows_renamed_traces():
    from dataclasses import replace

    trace = synthetic_trace(seqs=4)
    predictor = train(trace, replace(TINY_TRAINING, epochs=1, next_hidden=0), progress=False)
    predictor.info["train_config"]["seed"] = 1.5
    with pytest.raises(ValueError, match="seed 1.5 or val_fraction 0.1 is not an integer and a number"):
        fit_next_head(predictor, trace, hidden=4, epochs=1, progress=False)
    predictor.info["train_config"]["seed"] = 0
    other = replace(synthetic_trace(seqs=4), source="other.safetensors")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same sequences in the same order, whatever the files are called
        facts = fit_next_head(predictor, other, hidden=4, epochs=1, progress=False)
    assert facts["sequences_digest"] == predictor.info["sequences_digest"]


def test_fit_next_warns_when_the_traces_hold_other_sequences_or_another_order():
    from dataclasses import replace

    a, b = synthetic_trace(seqs=4, seed=1), synthetic_trace(seqs=4, seed=2)  # one recorder: the same `source`
    predictor = train([a, b], replace(TINY_TRAINING, epochs=1, next_hidden=0), progress=False)
    for traces in ([synthetic_trace(seqs=4, seed=3), synthetic_trace(seqs=4, seed=4)], [b, a]):
        with pytest.warns(UserWarning, match="are not the ones the predictor was trained on, in that order .*its "
                                             "validation split is drawn again"):
            fit_next_head(predictor, traces, hidden=4, epochs=1, progress=False)
    del predictor.info["sequences_digest"]  # a predictor saved before the digest (the shipped one): by `source`
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fit_next_head(predictor, [b, a], hidden=4, epochs=1, progress=False)
    with pytest.warns(UserWarning, match="the predictor was trained on 'test \\+ test', these traces are 'test'"):
        fit_next_head(predictor, a, hidden=4, epochs=1, progress=False)
