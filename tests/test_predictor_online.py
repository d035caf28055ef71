"""The route predictor run online by a wrapped model: what reaches the policy for each forward are the predictions of
the real tokens that forward feeds, in order, each equal to the teacher-forced prediction on that token's own
sequence (`RoutePredictor.predict`: the sequence's prompt to the encoder, its tokens up to this one to the decoder).
Scenarios: several tokens per row on a cache (a cache reused by a second `generate`, prompt-lookup decoding with its
accepted and rejected candidates), beam search, two batches served in turn with their own caches, a static cache
with a padded batch, a mask passed by position, and a right-padded batch; on a stand-in model, a prompt fed as
embeddings, padding among the tokens fed on a cache and a beam reorder into a new cache object. Also the session's
own bookkeeping after `crop`, `reorder` and `merge`, and its next-token probabilities after a multi-token `decode`."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from torch import nn
from transformers import DynamicCache

import expertflow
from expertflow import runtime
from expertflow.counters import Stats
from expertflow.policy import base as policy_base
from expertflow.policy import register_policy
from expertflow.policy.expertflow import ExpertFlowPolicy
from expertflow.predictor import RoutePredictor, load_predictor
from expertflow.predictor.model import PredictorConfig, RouteNet
from expertflow.runtime import RouteForecast
from families import batch, make_tiny, random_predictor

ATOL = 1e-5


class _Recording(ExpertFlowPolicy):
    """`expertflow` that keeps every prediction it is given."""

    name = "expertflow-online-recording"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[np.ndarray] = []

    def on_step(self, step, probs, next_probs=None) -> None:
        self.seen.append(np.array(probs, copy=True))
        super().on_step(step, probs, next_probs)


@pytest.fixture
def wrapped(monkeypatch, tmp_path):
    """A tiny mixtral wrapped with the recording policy and a random predictor: (model, predictor, seen, forwards),
    where `forwards` gets (input_ids, cached positions) of every forward call; unwrapped afterwards."""
    monkeypatch.setattr(policy_base, "_REGISTRY", dict(policy_base._REGISTRY))  # registered for this test only
    register_policy(_Recording)
    model = make_tiny("mixtral")
    path = random_predictor(model, tmp_path)
    forwards = []

    def record(module, args, kwargs):
        cache = kwargs.get("cache")
        ids = kwargs.get("input_ids", args[0] if args else None)
        length = getattr(cache, "get_seq_length", None)  # a paged cache (continuous batching) tells none
        forwards.append((ids.clone(), 0 if length is None else int(length())))

    expertflow.wrap(model, cache_slots=8, policy=_Recording.name, predictor=path, device="cpu")
    handle = model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        yield model, load_predictor(path), runtime.runtime_of(model).cache.policy.seen, forwards
    finally:
        handle.remove()
        expertflow.unwrap(model)


def _sequence(prompt, tokens) -> dict:
    """The batch of one unpadded sequence: `prompt` to the encoder, `tokens` (the sequence so far) to the decoder."""
    p, t = (torch.as_tensor(list(x), dtype=torch.long)[None] for x in (prompt, tokens))
    return {"encoder_ids": p, "encoder_mask": torch.ones_like(p), "decoder_ids": t, "decoder_mask": torch.ones_like(t)}


def _teacher(predictor, prompt, tokens) -> np.ndarray:
    """Teacher-forced probabilities [T, L, E] of `tokens` (the sequence so far) for the encoder prompt `prompt`."""
    return predictor.predict(_sequence(prompt, tokens))[0].float().numpy()


def _teacher_next(predictor, prompt, tokens) -> np.ndarray:
    """The next-token head's teacher-forced probabilities [T, K, L, E]: those of the K tokens after each of `tokens`."""
    return predictor.predict(_sequence(prompt, tokens), with_next=True)[1][0].float().numpy()


def _real(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    return [row[m.bool()].tolist() for row, m in zip(ids, mask)]


def test_a_cache_continued_with_several_tokens_per_row_predicts_all_of_them(wrapped):
    model, predictor, seen, forwards = wrapped
    inputs = batch("mixtral")
    first = model.generate(**inputs, max_new_tokens=3, min_new_tokens=3, do_sample=False,
                           return_dict_in_generate=True)
    more = torch.tensor([[21, 22, 23, 24]] * 2)
    ids = torch.cat([first.sequences, more], dim=1)
    mask = torch.cat([inputs["attention_mask"], torch.ones(2, ids.shape[1] - inputs["input_ids"].shape[1],
                                                           dtype=torch.long)], dim=1)
    out = model.generate(input_ids=ids, attention_mask=mask, cache=first.past_key_values, max_new_tokens=2,
                         min_new_tokens=2, do_sample=False)
    # forwards: prefill, 2 decode steps, then 5 tokens per row on the cache (the last generated one + 4), 1 step
    assert [tuple(f[0].shape) for f in forwards] == [(2, 7), (2, 1), (2, 1), (2, 5), (2, 1)]
    prompts = _real(inputs["input_ids"], inputs["attention_mask"])
    full = [p + out[r, 7:].tolist() for r, p in enumerate(prompts)]
    reference = [_teacher(predictor, p, f) for p, f in zip(prompts, full)]
    for k, (fed, cached) in enumerate(forwards[1:], start=1):
        width = fed.shape[1]
        expected = np.concatenate([ref[cached - 7 + len(p):][:width] for p, ref in zip(prompts, reference)])
        assert seen[k].shape == expected.shape, k
        np.testing.assert_allclose(seen[k], expected, rtol=0, atol=ATOL, err_msg=f"forward {k}")


# (2, 1, 0): row 0's first chunk is all padding; (3, 0, 1): and its second chunk has padding too
# static: every chunk gets a prepared 4-D mask over the whole cache, where a chunk's padding shows at its positions
@pytest.mark.parametrize("cache", [None, "static"])
@pytest.mark.parametrize("chunk, first, pad", [(4, 0, 0), (2, 1, 0), (3, 0, 1)])
def test_a_prompt_fed_in_chunks_is_read_whole_for_the_generated_tokens(wrapped, chunk, first, pad, cache):
    """Chunked prefill feeds the prompt over several forwards: each chunk's real tokens are predicted (going on from
    the first chunk, cheaply), and once the prompt ends the session reads all of it, so the generated tokens are
    predicted as `predict` gives them teacher-forced with the whole prompt."""
    model, predictor, seen, forwards = wrapped
    inputs = {k: torch.cat([torch.zeros(2, pad, dtype=torch.long), v[:, first:]], dim=1)
              for k, v in batch("mixtral").items()}
    width = inputs["input_ids"].shape[1]
    out = model.generate(**inputs, max_new_tokens=3, min_new_tokens=3, do_sample=False, prefill_chunk_size=chunk,
                         cache_implementation=cache)
    chunks = [min(chunk, width - start) for start in range(0, width, chunk)]
    assert [tuple(f[0].shape) for f in forwards] == [(2, n) for n in chunks] + [(2, 1)] * 2
    mask = inputs["attention_mask"]
    for k, (fed, cached) in enumerate(forwards[:len(chunks)]):
        assert seen[k].shape[0] == int(mask[:, cached:cached + fed.shape[1]].sum()), k  # the real tokens only
    prompts = _real(inputs["input_ids"], mask)
    for k, (fed, cached) in enumerate(forwards[len(chunks):], start=len(chunks)):
        expected = np.concatenate([_teacher(predictor, p, p + out[r, width:].tolist())[cached - width + len(p):][:1]
                                   for r, p in enumerate(prompts)])
        np.testing.assert_allclose(seen[k], expected, rtol=0, atol=ATOL, err_msg=f"forward {k}")


@pytest.mark.parametrize("cache", [None, "static"])
def test_a_padding_token_fed_alone_gets_no_prediction(wrapped, cache):
    """A prompt fed one token per forward (`prefill_chunk_size=1`) with left padding: a forward whose one token is
    padding in some row gives that row no prediction (nor a place in its session's history), as padding among
    several tokens does; the tokens stay the unwrapped model's."""
    model, predictor, seen, forwards = wrapped
    ids = torch.tensor([[0, 0, 0, 5, 17, 33, 9], [11, 12, 250, 14, 15, 16, 301]])
    mask = (ids != 0).long()
    generation = dict(max_new_tokens=2, min_new_tokens=2, do_sample=False, prefill_chunk_size=1,
                      cache_implementation=cache)
    out = model.generate(input_ids=ids, attention_mask=mask, **generation)
    assert [tuple(f[0].shape) for f in forwards] == [(2, 1)] * 8
    assert [s.shape[0] for s in seen] == [int(mask[:, k].sum()) for k in range(7)] + [2]
    assert torch.equal(out, make_tiny("mixtral").generate(input_ids=ids, attention_mask=mask, **generation))


def test_a_prompt_continued_on_a_cache_whose_rows_changed_starts_from_what_is_at_hand(wrapped):
    """A prompt prefilled, then the cache's rows repeated (or some selected), then several tokens per row: not the
    prompt's rows any more, so the session starts from the tokens at hand (it crashed joining the two)."""
    from transformers import DynamicCache

    model, _, seen, _ = wrapped
    prefix, more = torch.tensor([[5, 17, 33, 9, 40]]), torch.tensor([[21, 22], [23, 24], [25, 26]])
    logits = []
    for m in (make_tiny("mixtral"), model):
        cache = DynamicCache(config=m.config)
        with torch.no_grad():
            m(input_ids=prefix, cache=cache, use_cache=True)
            cache.batch_repeat_interleave(3)
            logits.append(m(input_ids=more, cache=cache, use_cache=True).logits)
    assert torch.equal(logits[1], logits[0]) and seen[-1].shape[0] == 6


def test_prompt_lookup_candidates_are_predicted_and_rejected_ones_forgotten(wrapped):
    model, predictor, seen, forwards = wrapped
    prompt = [7, 7, 7, 7]
    ids = torch.tensor([prompt])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                         prompt_lookup_num_tokens=3)
    final = out[0].tolist()
    shapes = [(f[0].shape[1], f[1]) for f in forwards]
    # The scenario: candidates in the first forward, all rejected (the cache keeps the prompt); later forwards of
    # the last token and candidates on the cache, whose candidates are all accepted, or some.
    kept = [(width, after - cached) for (width, cached), (_, after) in zip(shapes, shapes[1:]) if width > 1]
    assert shapes[0][0] > len(prompt) == shapes[1][1]
    assert any(k == width for width, k in kept[1:]) and any(1 < k < width for width, k in kept[1:])
    assert len(seen) == len(forwards)
    for k, (fed, cached) in enumerate(forwards):
        expected = _teacher(predictor, prompt, final[:cached] + fed[0].tolist())[cached:]
        np.testing.assert_allclose(seen[k], expected, rtol=0, atol=ATOL, err_msg=f"forward {k} {shapes[k]}")


def test_prompt_lookup_first_candidates_stay_out_of_a_varied_prompt(wrapped):
    """With a prompt of different tokens, a candidate folded into the predictor's prompt (the encoder's input) changes
    every prediction after it."""
    model, predictor, seen, forwards = wrapped
    prompt = [3, 9, 4, 3, 9]
    ids = torch.tensor([prompt])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                         prompt_lookup_num_tokens=3)
    final = out[0].tolist()
    assert forwards[0][0].shape[1] > len(prompt) == forwards[1][1]  # candidates in the first forward, then dropped
    assert len(seen) == len(forwards)
    for k, (fed, cached) in enumerate(forwards):
        expected = _teacher(predictor, prompt, final[:cached] + fed[0].tolist())[cached:]
        np.testing.assert_allclose(seen[k], expected, rtol=0, atol=ATOL, err_msg=f"forward {k}")


class _ReorderLog(DynamicCache):
    """A dynamic cache that notes how generate reorders its rows."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.reorders: list[list[int]] = []

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        self.reorders.append(beam_idx.tolist())
        super().reorder_cache(beam_idx)


# chunk 4: chunked prefill (4 + 3 tokens), the prompt read whole at the first decode step, after the first reorder
@pytest.mark.parametrize("chunk", [None, 4])
def test_beam_search_predictions_follow_each_beam(wrapped, chunk):
    model, predictor, seen, forwards = wrapped
    inputs, beams = batch("mixtral"), 3
    cache = _ReorderLog(config=model.config)
    model.generate(**inputs, cache=cache, num_beams=beams, max_new_tokens=5, min_new_tokens=5, do_sample=False,
                   prefill_chunk_size=chunk)
    chunks = 1 if chunk is None else -(-inputs["input_ids"].shape[1] // chunk)
    assert len(cache.reorders) == len(forwards) - chunks + 1 >= 5
    prompts = [p for p in _real(inputs["input_ids"], inputs["attention_mask"]) for _ in range(beams)]
    history = [list(p) for p in prompts]
    for k, (fed, cached) in enumerate(forwards[chunks:], start=chunks):
        history = [list(history[i]) for i in cache.reorders[k - chunks]]  # generate reorders after every step
        for row, token in zip(history, fed[:, 0].tolist()):
            row.append(token)
        expected = np.stack([_teacher(predictor, p, h)[-1] for p, h in zip(prompts, history)])
        np.testing.assert_allclose(seen[k], expected, rtol=0, atol=ATOL, err_msg=f"step {k}")
    assert len({tuple(h) for h in history}) > 2  # the beams went their own ways


def test_unwrap_takes_back_the_beam_reorder(tmp_path):
    model = make_tiny("mixtral")
    before = set(model.__dict__)
    expertflow.wrap(model, cache_slots=8, policy="expertflow", predictor=random_predictor(model, tmp_path),
                    device="cpu")
    assert "_reorder_cache" in model.__dict__
    expertflow.unwrap(model)
    assert set(model.__dict__) == before


@pytest.mark.parametrize("original", ["dropped", "kept"])
def test_unwrapping_a_shallow_copy_takes_back_its_beam_reorder_too(tmp_path, original):
    import copy
    import gc

    model = make_tiny("mixtral")
    before = set(model.__dict__)
    predictor = random_predictor(model, tmp_path)
    expertflow.wrap(model, cache_slots=8, policy="expertflow", predictor=predictor, device="cpu")
    shallow = copy.copy(model)
    if original == "dropped":
        del model
        gc.collect()
    expertflow.unwrap(shallow)
    assert set(shallow.__dict__) == before
    copy.deepcopy(shallow)  # nothing uncopyable left behind
    expertflow.wrap(shallow, cache_slots=8, policy="expertflow", predictor=predictor, device="cpu")
    expertflow.unwrap(shallow)  # no stale stand-in recorded as the attribute to put back
    assert set(shallow.__dict__) == before


def test_batches_served_in_turn_with_their_own_caches_keep_their_own_history(wrapped):
    model, predictor, seen, forwards = wrapped
    turns = {"a": batch("mixtral"), "b": {"input_ids": torch.tensor([[3, 4, 5, 6], [0, 9, 8, 7]]),
                                          "attention_mask": torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])}}
    state = {}
    with torch.no_grad():
        for name, inputs in turns.items():
            cache = DynamicCache(config=model.config)
            logits = model(**inputs, cache=cache, use_cache=True).logits
            state[name] = [cache, inputs["attention_mask"], logits[:, -1].argmax(-1, keepdim=True),
                           _real(inputs["input_ids"], inputs["attention_mask"])]
        for step in range(3):
            for name in turns:
                cache, mask, token, history = state[name]
                mask = torch.cat([mask, torch.ones_like(token)], dim=1)
                logits = model(input_ids=token, attention_mask=mask, cache=cache, use_cache=True).logits
                prompts = _real(turns[name]["input_ids"], turns[name]["attention_mask"])
                for row, t in zip(history, token[:, 0].tolist()):
                    row.append(t)
                expected = np.stack([_teacher(predictor, p, h)[-1] for p, h in zip(prompts, history)])
                np.testing.assert_allclose(seen[-1], expected, rtol=0, atol=ATOL, err_msg=f"{name} step {step}")
                state[name][1:3] = mask, logits[:, -1].argmax(-1, keepdim=True)


@pytest.mark.parametrize("return_dict", [True, False])
def test_a_decoding_loop_on_the_cache_the_model_made_keeps_each_prompt(wrapped, return_dict):
    """A first forward without a cache returns the one the model made (in a tuple with return_dict=False); going on
    with it, the session that read the prompt follows (it was started again from the one new token, its prompt
    lost)."""
    model, predictor, seen, forwards = wrapped
    inputs = batch("mixtral")
    prompts = _real(inputs["input_ids"], inputs["attention_mask"])
    history = [list(p) for p in prompts]
    with torch.no_grad():
        logits, cache = model(**inputs, use_cache=True, return_dict=return_dict)[:2]
        mask = inputs["attention_mask"]
        for step in range(3):
            token = logits[:, -1].argmax(-1, keepdim=True)
            for row, t in zip(history, token[:, 0].tolist()):
                row.append(t)
            mask = torch.cat([mask, torch.ones_like(token)], dim=1)
            logits, cache = model(input_ids=token, attention_mask=mask, cache=cache, use_cache=True,
                                  return_dict=return_dict)[:2]
            expected = np.stack([_teacher(predictor, p, h)[-1] for p, h in zip(prompts, history)])
            np.testing.assert_allclose(seen[-1], expected, rtol=0, atol=ATOL, err_msg=f"step {step}")


def test_a_forward_that_raises_keeps_no_session_waiting_for_its_cache(wrapped, monkeypatch):
    model = wrapped[0]
    routes = runtime.runtime_of(model).routes
    monkeypatch.setattr(model.model, "forward", lambda *args, **kwargs: (_ for _ in ()).throw(RuntimeError("x")))
    with torch.no_grad(), pytest.raises(RuntimeError, match="x"):
        model(**batch("mixtral"), use_cache=True)
    assert routes._uncached is None  # the session and its prompt are not held on to


@pytest.mark.parametrize("attention", ["sdpa", "eager"])  # the prepared mask: boolean, additive
def test_a_static_cache_with_a_padded_batch_predicts_the_real_tokens_only(wrapped, attention):
    model, predictor, seen, forwards = wrapped
    model.set_attn_implementation(attention)
    inputs = batch("mixtral")  # 11 real tokens of 14
    out = model.generate(**inputs, max_new_tokens=3, min_new_tokens=3, do_sample=False,
                         cache_implementation="static")
    prompts = _real(inputs["input_ids"], inputs["attention_mask"])
    reference = [_teacher(predictor, p, p + out[r, 7:].tolist()) for r, p in enumerate(prompts)]
    prefill = np.concatenate([ref[:len(p)] for p, ref in zip(prompts, reference)])
    assert [s.shape[0] for s in seen] == [11, 2, 2]
    np.testing.assert_allclose(seen[0], prefill, rtol=0, atol=ATOL)
    for step in (1, 2):
        expected = np.stack([ref[len(p) + step - 1] for p, ref in zip(prompts, reference)])
        np.testing.assert_allclose(seen[step], expected, rtol=0, atol=ATOL, err_msg=f"step {step}")


def test_a_mask_passed_by_position_keeps_the_padding_out(wrapped):
    model, predictor, seen, forwards = wrapped
    inputs = batch("mixtral")
    with torch.no_grad():
        model(inputs["input_ids"], inputs["attention_mask"])
        model(**inputs)
    assert seen[0].shape[0] == seen[1].shape[0] == 11
    np.testing.assert_array_equal(seen[0], seen[1])


def test_a_right_padded_batch_generates_and_its_session_refuses_to_decode(wrapped):
    model, predictor, seen, forwards = wrapped
    ids = torch.tensor([[5, 17, 33, 9, 0, 0, 0], [11, 12, 250, 14, 15, 16, 301]])
    mask = (ids != 0).long()
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, min_new_tokens=3, do_sample=False)
    assert [s.shape[0] for s in seen] == [11, 2, 2]  # the prompt's real tokens, then one row per sequence
    session = predictor.new_session()
    session.prefill(ids, mask)
    assert session.right_padded
    with pytest.raises(ValueError, match="right-padded"):
        session.decode(torch.tensor([[1], [2]]))


# -- the session on its own ---------------------------------------------------------------------------------------
def _small_predictor() -> RoutePredictor:
    """An untrained (seeded) predictor with a next-token head: vocabulary 16, 2 layers of 8 experts, top-2."""
    torch.manual_seed(0)
    config = PredictorConfig(vocab_size=16, num_layers=2, num_experts=8, top_k=2, d_model=16, d_ff=32, heads=2,
                             encoder_layers=1, decoder_layers=2, dropout=0.0, next_hidden=8)
    return RoutePredictor(RouteNet(config).eval())


def test_crop_to_the_whole_length_is_allowed_and_changes_nothing():
    """`crop` keeps 0 to `length` positions: keeping them all is no change, not an error."""
    session = _small_predictor().new_session()
    session.prefill(torch.tensor([[3, 4, 5]]))
    before = session.next_probs.clone()
    session.crop(session.length)
    assert session.length == 3
    torch.testing.assert_close(session.next_probs, before, rtol=0, atol=0)


def test_a_crop_that_cuts_off_the_right_padding_lets_the_batch_decode_again():
    """`right_padded` says whether some row has padding after a real token: once `crop` has cut the padding off, no
    row has any, and `decode` goes on as on the unpadded sequences."""
    predictor = _small_predictor()
    session = predictor.new_session()
    session.prefill(torch.tensor([[3, 4, 5, 0], [6, 7, 8, 9]]), torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]))
    assert session.right_padded
    session.crop(3)
    assert not session.right_padded
    out = session.decode(torch.tensor([[10], [11]]))[:, 0].numpy()
    for row, (prompt, token) in enumerate((([3, 4, 5], 10), ([6, 7, 8, 9], 11))):
        expected = _teacher(predictor, prompt, prompt[:3] + [token])[-1]
        np.testing.assert_allclose(out[row], expected, rtol=0, atol=ATOL, err_msg=f"row {row}")


def test_next_probs_after_a_multi_token_decode_are_those_of_the_last_new_token():
    """`decode` of several tokens per row (candidate tokens, a continued prompt): `next_probs` is then that of each
    row's last new token."""
    predictor = _small_predictor()
    session = predictor.new_session()
    session.prefill(torch.tensor([[3, 4, 5]]))
    session.decode(torch.tensor([[6, 7, 8]]))
    expected = _teacher_next(predictor, [3, 4, 5], [3, 4, 5, 6, 7, 8])[-1]
    np.testing.assert_allclose(session.next_probs[0].numpy(), expected, rtol=0, atol=ATOL)


def test_reorder_drops_the_next_token_probabilities_of_the_old_rows():
    """`next_probs` [B, K, L, E] belongs to the rows of the last call: after `reorder` (here one row of two is
    kept) it is gone, as after `crop`."""
    session = _small_predictor().new_session()
    session.prefill(torch.tensor([[3, 4, 5], [6, 7, 8]]))
    assert session.next_probs.shape[0] == 2
    session.reorder(torch.tensor([1]))
    assert session.next_probs is None


def test_a_merge_that_takes_a_right_padded_session_refuses_to_decode():
    """A merged session is right padded when any of its sessions is: that row's padding would otherwise sit
    between its prompt and its new tokens."""
    predictor = _small_predictor()
    right, left = predictor.new_session(), predictor.new_session()
    right.prefill(torch.tensor([[3, 4, 0]]), torch.tensor([[1, 1, 0]]))
    left.prefill(torch.tensor([[5, 6, 7]]))
    merged = type(right).merge([right, left])
    assert merged.right_padded
    with pytest.raises(ValueError, match="right-padded"):
        merged.decode(torch.tensor([[1], [2]]))


# -- RouteForecast on a stand-in model -----------------------------------------------------------------------------
class _Cache:
    """A stand-in KV cache: only its length matters to `RouteForecast`."""

    def __init__(self, length: int = 0) -> None:
        self.length = length

    def get_seq_length(self) -> int:
        return self.length


class _Model(nn.Module):
    """A model whose forward does nothing and whose own `_reorder_cache` (as a few models have) returns the reordered
    cache as a new object."""

    def forward(self, input_ids=None, attention_mask=None, past_key_values=None, inputs_embeds=None) -> None:
        return None

    def _reorder_cache(self, cache: _Cache, beam_idx: torch.Tensor) -> _Cache:
        return _Cache(cache.length)


def _forecast(predictor) -> tuple[_Model, list[np.ndarray]]:
    """A stand-in model with a `RouteForecast` attached, and the list that gets the predictions [tokens, L, E] that
    each forward hands on."""
    seen = []
    forecast = RouteForecast(predictor, Stats(), lambda probs, after: seen.append(probs),
                             lambda new_step: contextlib.nullcontext())
    model = _Model()
    forecast.attach(model)
    return model, seen


def test_a_session_started_after_a_prompt_fed_as_embeddings_follows_its_cache():
    """A forward fed embeddings gets no prediction; the forwards after it continue sequences no session has
    followed, so a new session starts there, and it then follows the cache: the next forward goes on with its
    history rather than starting yet another session."""
    predictor = _small_predictor()
    model, seen = _forecast(predictor)
    cache = _Cache(0)
    model(inputs_embeds=torch.zeros(1, 5, 4), past_key_values=cache)
    cache.length = 5  # the five prompt positions, which the predictor never saw
    model(input_ids=torch.tensor([[3]]), past_key_values=cache)
    cache.length = 6
    model(input_ids=torch.tensor([[4]]), past_key_values=cache)
    assert len(seen) == 2
    np.testing.assert_allclose(seen[1][0], _teacher(predictor, [3], [3, 4])[-1], rtol=0, atol=ATOL)


def test_padding_among_the_tokens_fed_on_a_cache_gets_no_prediction():
    """What reaches the policy are the predictions of the real tokens a forward feeds: padding among the tokens fed
    on top of a cache gets no row."""
    model, seen = _forecast(_small_predictor())
    cache = _Cache(0)
    model(input_ids=torch.tensor([[3, 4, 5], [6, 7, 8]]), attention_mask=torch.ones(2, 3, dtype=torch.long),
          past_key_values=cache)
    cache.length = 3
    mask = torch.tensor([[1, 1, 1, 0, 1], [1, 1, 1, 1, 1]])  # row 0 feeds one padding token and one real one
    model(input_ids=torch.tensor([[0, 9], [10, 11]]), attention_mask=mask, past_key_values=cache)
    assert seen[1].shape[0] == 3


def test_a_beam_reorder_into_a_new_cache_object_moves_the_session_with_it():
    """Beam search reorders the cache's rows through the model's `_reorder_cache`; when the model's own returns a
    new cache object, the session, reordered alike, follows the new one, so the next forward continues each beam's
    history."""
    predictor = _small_predictor()
    model, seen = _forecast(predictor)
    before = _Cache(0)
    model(input_ids=torch.tensor([[3, 4, 5], [6, 7, 8]]), past_key_values=before)
    before.length = 3
    model(input_ids=torch.tensor([[9], [10]]), past_key_values=before)
    before.length = 4
    after = model._reorder_cache(before, torch.tensor([1, 0]))  # as generate calls it
    assert after is not before
    model(input_ids=torch.tensor([[11], [12]]), past_key_values=after)
    for row, (prompt, tokens) in enumerate((([6, 7, 8], [6, 7, 8, 10, 11]), ([3, 4, 5], [3, 4, 5, 9, 12]))):
        expected = _teacher(predictor, prompt, tokens)[-1]
        np.testing.assert_allclose(seen[2][row], expected, rtol=0, atol=ATOL, err_msg=f"row {row}")


def test_continuous_batching_is_exact_and_every_packed_forward_is_predicted(wrapped):
    """`generate_batch` packs the requests of a step into one row over a paged cache, which tells no length: no
    session follows it, so each forward starts a session of its own from the tokens it packs (no history: poorer
    prefetches, never other tokens), every one of them predicted (the paged mask's layout is not read as padding)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model, _, seen, forwards = wrapped
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    settings = dict(generation_config=GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=-1,
                                                       pad_token_id=0), progress_bar=False,
                    continuous_batching_config=ContinuousBatchingConfig(num_blocks=16, max_batch_tokens=64))
    reference = make_tiny("mixtral").generate_batch(inputs=prompts, **settings)  # a small paged cache: fast on a CPU
    out = model.generate_batch(inputs=prompts, **settings)
    assert {k: v.generated_tokens for k, v in out.items()} == {k: v.generated_tokens for k, v in reference.items()}
    assert [tuple(fed.shape) for fed, _ in forwards] == [(1, 8), (1, 2), (1, 2), (1, 2)]  # both prompts, then a
    assert [len(probs) for probs in seen] == [8, 2, 2, 2]  # token of each request per step; the last one is not fed


def test_a_compiled_model_runs_the_runtime_and_the_predictor_out_of_the_graph(wrapped):
    """`torch.compile` cannot trace the host-side decisions (the predictor's hook feeds the policy numpy arrays): they
    run eagerly, out of the compiled graph, and the tokens stay those of the unwrapped model."""
    model, _, seen, _ = wrapped
    inputs, gen = batch("mixtral"), dict(max_new_tokens=2, min_new_tokens=2, do_sample=False)
    reference = make_tiny("mixtral").generate(**inputs, **gen)
    model.compile(backend="eager")  # traced as inductor would trace it, without its slow code generation
    try:
        assert torch.equal(model.generate(**inputs, **gen), reference)
    finally:
        model._compiled_call_impl = None
        torch._dynamo.reset()
    assert len(seen) == 2
