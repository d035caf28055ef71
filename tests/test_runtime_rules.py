"""Single rules of the runtime (`expertflow/runtime.py`), each on a small case: one thread at a time (who owns a
forward's step, and when), the refusal of a backward pass through an offloaded layer and the layer's own output, the
model's byte counts, a model looping three times per step, the occupancy row of a planned step whose forward failed,
the route predictor's plumbing (the arguments it reads, the masks and caches it follows, the beam-reorder stand-in
and what unwrap puts back), the checks on a predictor path, the device waits `stats` collects, and the refusal of a
single expert tensor in `load_state_dict`."""

from __future__ import annotations

import contextlib
import copy
import threading

import numpy as np
import pytest
import torch
from torch import nn

import emulated_cuda
import expertflow
from emulated_cuda import emulate
from expertflow import runtime
from expertflow.counters import Stats
from expertflow.policy import register_policy
from expertflow.policy.expertflow import ExpertFlowPolicy
from expertflow.runtime import RouteForecast, WrapError, runtime_of
from families import batch, make_tiny, random_predictor
from test_families_sweep import _two_looped_steps
from test_predictor_online import ATOL, _Cache, _forecast, _small_predictor, _teacher


class _StepLog(ExpertFlowPolicy):
    """`expertflow` that keeps the step number of every `on_step`."""

    name = "expertflow-step-log"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.planned: list[int] = []

    def on_step(self, step, probs, next_probs=None) -> None:
        self.planned.append(step)
        super().on_step(step, probs, next_probs)


# ---- one thread at a time ---------------------------------------------------------------------------------------

def test_a_forward_that_another_thread_runs_first_is_planned_as_its_own_step(registry, monkeypatch, tmp_path):
    """`watch_forward` puts the runtime's forward pre-hook before the predictor's: a thread becomes the owner of the
    model's steps before its predictions plan a step. A second thread whose forward runs in between then plans and
    runs its own step, and the first plans the step after it: every step is planned exactly once."""
    register_policy(_StepLog)
    model = make_tiny("mixtral")
    path = random_predictor(model, tmp_path)
    paused, release = threading.Event(), threading.Event()
    original = runtime.OffloadRuntime.enter_forward

    def enter(self, module, args):  # the first thread stops at the start of the runtime's pre-hook
        if threading.current_thread().name == "first" and not paused.is_set():
            paused.set()
            release.wait(timeout=30)
        return original(self, module, args)

    monkeypatch.setattr(runtime.OffloadRuntime, "enter_forward", enter)
    expertflow.wrap(model, policy=_StepLog.name, predictor=path, cache_slots=8, device="cpu")
    inputs = batch("mixtral")
    errors = []

    def first():
        try:
            with torch.no_grad():
                model(**inputs)
        except BaseException as error:  # pragma: no cover - shown by the assertion
            errors.append(error)

    thread = threading.Thread(target=first, name="first")
    try:
        thread.start()
        assert paused.wait(timeout=30)
        with torch.no_grad():
            model(**inputs)  # the main thread's forward runs while the first waits before owning the model
        release.set()
        thread.join(timeout=60)
        assert not errors
        assert runtime_of(model).cache.policy.planned == [0, 1]  # not [0, 0]: the first's plan overwritten
        assert expertflow.stats(model).steps == 2
    finally:
        release.set()
        thread.join(timeout=60)
        expertflow.unwrap(model)


def test_a_refused_forward_does_not_release_the_running_threads_hold_on_the_model():
    """The refused thread's forward call ends too (its `leave_forward` runs, `always_call`): it must not clear the
    ownership of the thread still inside its forward call, or the next try would get in mid-step."""
    model = make_tiny("mixtral")
    inputs = batch("mixtral")
    expertflow.wrap(model, cache_slots=8, device="cpu")
    between, release, errors = threading.Event(), threading.Event(), []

    def hold(module, args):  # the first thread stops between two MoE layers (no lock held, inside its forward)
        if threading.current_thread().name == "first" and not between.is_set():
            between.set()
            release.wait(timeout=30)

    def first():
        try:
            with torch.no_grad():
                model(**inputs)
        except BaseException as error:  # pragma: no cover - shown by the assertion
            errors.append(error)

    handle = model.model.layers[1].register_forward_pre_hook(hold)
    thread = threading.Thread(target=first, name="first")
    try:
        thread.start()
        assert between.wait(timeout=30)
        for _ in range(2):  # refused, and refused again: the first thread still runs its step
            with pytest.raises(RuntimeError, match="one thread at a time"), torch.no_grad():
                model(**inputs)
        release.set()
        thread.join(timeout=60)
        assert not errors and expertflow.stats(model).steps == 1
    finally:
        release.set()
        thread.join(timeout=60)
        handle.remove()
        expertflow.unwrap(model)


def test_a_layer_that_continues_another_threads_step_run_outside_the_forward_is_refused():
    """Outside the model's forward call (an encoder run on its own) a thread owns the step its first layer started:
    another thread's layer that would continue that step (a higher layer index) is refused (`exclusive`), and
    changes no counter; the owner goes on."""
    model = make_tiny("mixtral")
    call = (torch.randn(3, model.config.hidden_size), torch.tensor([[0, 1], [2, 3], [1, 4]]), torch.full((3, 2), 0.5))
    expertflow.wrap(model, cache_slots=2, device="cpu")
    result = {}

    def other():
        try:
            with torch.no_grad():
                model.model.layers[1].mlp.experts(*call)
            result["ran"] = True
        except RuntimeError as error:
            result["error"] = str(error)

    try:
        with torch.no_grad():
            model.model.layers[0].mlp.experts(*call)  # this thread's step 0
        thread = threading.Thread(target=other)
        thread.start()
        thread.join(timeout=60)
        assert "one thread at a time" in result.get("error", ""), result
        needs = expertflow.stats(model).needs
        with torch.no_grad():
            model.model.layers[1].mlp.experts(*call)  # the owner continues its step
        stats = expertflow.stats(model)
        assert stats.steps == 1 and stats.needs > needs
    finally:
        expertflow.unwrap(model)


def test_a_stale_forward_owner_running_another_wrapped_model_does_not_shut_this_one():
    """After a Ctrl-C skipped `leave_forward`, the recorded owner is checked against its stack for a forward call of
    *this* model: that thread running another wrapped model must not refuse this one to other threads."""
    first, second = make_tiny("mixtral"), make_tiny("mixtral", seed=1)
    inputs = batch("mixtral")
    expertflow.wrap(first, cache_slots=8, device="cpu")
    expertflow.wrap(second, cache_slots=8, device="cpu")
    inside, release, result = threading.Event(), threading.Event(), {}

    def interrupt(module, args):
        raise KeyboardInterrupt

    def hold(module, args):  # this thread stays inside `second`'s forward call
        inside.set()
        release.wait(timeout=30)

    def other():
        try:
            with torch.no_grad():
                first(**inputs)
            result["ran"] = True
        except RuntimeError as error:
            result["error"] = str(error)
        finally:
            release.set()

    handles = [first.model.layers[1].register_forward_pre_hook(interrupt)]
    try:
        with pytest.raises(KeyboardInterrupt), torch.no_grad():
            first(**inputs)  # this thread is left recorded as `first`'s owner
        handles.pop().remove()
        handles.append(second.model.layers[1].register_forward_pre_hook(hold))
        thread = threading.Thread(target=lambda: (inside.wait(timeout=30), other()))
        thread.start()
        with torch.no_grad():
            second(**inputs)  # held until the other thread has called `first`
        thread.join(timeout=60)
        assert result == {"ran": True}, result
    finally:
        release.set()
        for handle in handles:
            handle.remove()
        expertflow.unwrap(first)
        expertflow.unwrap(second)


# ---- a layer's output -------------------------------------------------------------------------------------------

def _layer_call(model, rows: int = 3, grad: bool = False):
    """Arguments of an experts module called on its own: `rows` tokens routed to two experts each."""
    hidden = torch.randn(rows, model.config.hidden_size, requires_grad=grad)
    return hidden, torch.tensor([[0, 1], [2, 3], [1, 4]])[:rows], torch.full((rows, 2), 0.5)


def test_a_backward_through_an_offloaded_layers_output_is_refused_at_the_layer():
    """Backward from a tensor that is not one of the model's outputs (a layer's output taken by a hook, or an experts
    module called on its own) reaches no output hook: the layer itself refuses it (`_InferenceOnly`), before any
    gradient reaches its input."""
    model = make_tiny("mixtral")
    expertflow.wrap(model, cache_slots=2, device="cpu")
    try:
        hidden, index, weights = _layer_call(model, grad=True)
        out = model.model.layers[0].mlp.experts(hidden, index, weights)
        assert out.requires_grad
        with pytest.raises(RuntimeError, match="inference only"):
            out.sum().backward()
        assert hidden.grad is None
    finally:
        expertflow.unwrap(model)


def test_a_tensor_the_caller_passed_in_and_gets_back_keeps_its_own_backward():
    """`inputs_embeds` comes back as the first hidden state: the refusal lands on what the model computed, not on the
    caller's own tensor, whose graph never reaches the model (a backward through it is the caller's business, also
    after unwrap); a backward through the model's hidden states is refused."""
    model = make_tiny("mixtral")
    soft = torch.zeros(1, 4, model.config.hidden_size, requires_grad=True)  # a learned soft prompt, say
    embeds = model.get_input_embeddings()(torch.tensor([[5, 17, 33, 9]])).detach() + soft
    expertflow.wrap(model, cache_slots=2, device="cpu")
    try:
        out = model(inputs_embeds=embeds, output_hidden_states=True)
        assert out.hidden_states[0] is embeds
        with pytest.raises(RuntimeError, match="inference only"):
            out.hidden_states[1].sum().backward(retain_graph=True)
        (embeds ** 2).sum().backward()
        assert soft.grad is not None
    finally:
        expertflow.unwrap(model)


def test_a_tensor_the_caller_passed_inside_a_container_keeps_its_own_backward_too():
    """Switch's `encoder_outputs` holds the caller's encoder states, handed back as `encoder_last_hidden_state`:
    they keep their own backward (the refusing hook stayed on them, even after unwrap)."""
    from transformers.modeling_outputs import MoEModelOutput

    model = make_tiny("switch_transformers")
    base = torch.randn(2, 5, model.config.d_model, requires_grad=True)
    states = base * 1.0  # the caller's own tensor, with a gradient function
    expertflow.wrap(model, cache_slots=8, device="cpu")
    try:
        out = model(encoder_outputs=MoEModelOutput(last_hidden_state=states),
                    decoder_input_ids=torch.tensor([[0, 5, 6], [0, 7, 8]]))
        assert out.encoder_last_hidden_state is states
        with pytest.raises(RuntimeError, match="inference only"):
            out.logits.sum().backward(retain_graph=True)
    finally:
        expertflow.unwrap(model)
    (states * 2).sum().backward()
    assert base.grad is not None


def test_a_backward_through_the_base_model_inside_is_refused_before_any_weight_gets_a_gradient():
    """`model.model(ids)` (for its hidden states) reaches no output hook of the wrapped model: the base model's own
    outputs refuse the backward, before the final norm after the last MoE layer gets a gradient."""
    model = make_tiny("mixtral")
    expertflow.wrap(model, cache_slots=2, device="cpu")
    try:
        for output in (model.model(input_ids=torch.tensor([[5, 17, 33, 9]])).last_hidden_state,  # the base model
                       model(input_ids=torch.tensor([[5, 17, 33, 9]])).logits):  # and the model itself
            with pytest.raises(RuntimeError, match="inference only"):
                output.sum().backward()
            assert [name for name, param in model.named_parameters() if param.grad is not None] == []
    finally:
        expertflow.unwrap(model)
    assert not model.model._forward_hooks, "unwrap takes the hook away"


def test_an_offloaded_layers_output_can_be_changed_in_place_with_autograd_on():
    """The layer's output is its own tensor, not a view made by the refusing autograd function: a model (or hook)
    may add to it in place, as it may to transformers' own output."""
    model = make_tiny("mixtral")
    hidden, index, weights = _layer_call(model, grad=True)
    expected = model.model.layers[0].mlp.experts(hidden, index, weights).detach() + 1
    expertflow.wrap(model, cache_slots=2, device="cpu")
    try:
        out = model.model.layers[0].mlp.experts(hidden, index, weights)
        out += 1
        assert torch.allclose(out.detach(), expected, atol=1e-5)
    finally:
        expertflow.unwrap(model)


# ---- bytes, steps and loops -------------------------------------------------------------------------------------

def test_full_model_bytes_are_the_bytes_of_all_the_models_weights():
    """`OffloadRuntime.full_model_bytes`: the non-expert weights plus every expert, i.e. what the unwrapped model
    holds; `device_bytes` is the non-expert part plus the slot bank."""
    model = make_tiny("mixtral")
    full = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    expertflow.wrap(model, cache_slots=3, device="cpu")
    try:
        rt = runtime_of(model)
        assert rt.full_model_bytes == full
        assert rt.device_bytes == rt.plan.non_expert_bytes + 3 * rt.plan.slot_bytes < full
    finally:
        expertflow.unwrap(model)


def test_a_model_looping_three_times_announces_each_pass_end_as_the_loops_first_layer(monkeypatch):
    """Each pass of a looped model has its own loop point (`_loops[layer, pass]`): with layers 1-2 run three times
    per step, the ends of the first two passes announce layer 1 of the same step, and only the last pass's end
    announces the next step."""
    steps, requested = _two_looped_steps(monkeypatch, lambda d: d.update(loop_num_passes=3))
    assert steps == 2
    assert requested[7:] == [(1, 0, (1, 1)), (1, 1, (1, 2)), (1, 2, (1, 1)), (1, 1, (1, 2)), (1, 2, (1, 1)),
                             (1, 1, (1, 2)), (1, 2, (2, 0))]


def test_a_planned_forward_that_fails_before_its_first_moe_layer_leaves_no_occupancy_row(registry, tmp_path):
    """Stats: `slots_per_layer` holds one row per step, taken at its start. The predictor plans a step before the
    model's embedding runs; a forward that fails after that but before its first MoE layer (here the embedding
    refuses a token id) counts no step and leaves no row. The next forward plans the same step again (the policy
    gets `on_step` for it once more) and records that step's row once."""
    register_policy(_StepLog)
    model = make_tiny("mixtral")
    path = random_predictor(model, tmp_path)
    inputs = batch("mixtral")
    expertflow.wrap(model, policy=_StepLog.name, predictor=path, cache_slots=8, device="cpu")
    try:
        stats = expertflow.stats(model)
        with torch.no_grad():
            model(**inputs)
            for _ in range(2):
                with pytest.raises(IndexError):
                    model(input_ids=torch.tensor([[model.config.vocab_size + 1]]))
                assert (stats.steps, len(stats.slots_per_layer)) == (1, 1)
            model(**inputs)
        assert (stats.steps, len(stats.slots_per_layer)) == (2, 2)
        assert runtime_of(model).cache.policy.planned == [0, 1, 1, 1]
    finally:
        expertflow.unwrap(model)


# ---- the route predictor's plumbing, on stand-in models ---------------------------------------------------------

class _Plain(nn.Module):
    """A stand-in model whose forward does nothing, without a `_reorder_cache` of its own."""

    def forward(self, input_ids=None, attention_mask=None, past_key_values=None, logits_to_keep=0) -> None:
        return None


class _TakesKwargs(nn.Module):
    """A stand-in model that takes everything but its ids through `**kwargs`."""

    def forward(self, input_ids=None, **kwargs) -> None:
        return None


class _LengthOnly:
    """A stand-in KV cache with a length and no `reorder_cache`."""

    def __init__(self, length: int = 0) -> None:
        self.length = length

    def get_seq_length(self) -> int:
        return self.length


class _Unreferenced:
    """A stand-in KV cache that takes no weak reference (`__slots__` without `__weakref__`)."""

    __slots__ = ("length",)

    def __init__(self, length: int = 0) -> None:
        self.length = length

    def get_seq_length(self) -> int:
        return self.length


def _attach(model: nn.Module, predictor=None) -> list[np.ndarray]:
    """Attach a `RouteForecast` to `model`; the list that gets the predictions [tokens, L, E] each forward hands
    on."""
    seen = []
    forecast = RouteForecast(predictor or _small_predictor(), Stats(), lambda probs, after: seen.append(probs),
                             lambda new_step: contextlib.nullcontext())
    forecast.attach(model)
    return seen


def test_a_cache_reset_and_refilled_with_embeddings_is_not_followed_by_its_old_session():
    """A forward fed embeddings drops the session that followed its cache (`_before_forward`): a cache reset and
    reused for a new prompt fed as embeddings must not continue the old sequence's history when ids come next."""
    predictor = _small_predictor()
    model, seen = _forecast(predictor)
    cache = _Cache(0)
    model(input_ids=torch.tensor([[3, 4, 5]]), past_key_values=cache)
    cache.length = 3
    model(input_ids=torch.tensor([[6]]), past_key_values=cache)  # the session now holds 4 positions
    cache.length = 0  # the cache is reset and reused: a new prompt of 4 positions fed as embeddings
    model(inputs_embeds=torch.zeros(1, 4, 4), past_key_values=cache)
    cache.length = 4
    model(input_ids=torch.tensor([[9]]), past_key_values=cache)
    assert len(seen) == 3
    # a new session that starts at the new sequence's first id, not 9 decoded after [3, 4, 5, 6]
    np.testing.assert_allclose(seen[2][0], _teacher(predictor, [9], [9])[-1], rtol=0, atol=ATOL)


def test_the_mask_and_cache_a_forward_takes_through_its_kwargs_are_read():
    """`_arguments`: a forward that takes its attention mask and cache through `**kwargs` still has them read, so
    its session follows the cache and padding gets no prediction."""
    predictor = _small_predictor()
    model = _TakesKwargs()
    seen = _attach(model, predictor)
    cache = _Cache(0)
    model(input_ids=torch.tensor([[0, 3, 4], [6, 7, 8]]), attention_mask=torch.tensor([[0, 1, 1], [1, 1, 1]]),
          past_key_values=cache)
    assert seen[0].shape[0] == 5  # the padding token gets no row
    cache.length = 3
    model(input_ids=torch.tensor([[5], [9]]), attention_mask=torch.ones(2, 4, dtype=torch.long),
          past_key_values=cache)
    np.testing.assert_allclose(seen[1][1], _teacher(predictor, [6, 7, 8], [6, 7, 8, 9])[-1], rtol=0, atol=ATOL)


def test_a_first_forward_with_candidates_after_a_right_padded_prompt_is_predicted_not_refused():
    """The first forward of prompt-lookup/assisted decoding feeds prompt + candidates (`logits_to_keep` =
    candidates + 1). When the prompt part is right padded the session cannot `decode` the candidates after it:
    `_start` then prefills all the tokens as the prompt instead (the wrapped model's forward must not fail)."""
    model = _Plain()
    seen = _attach(model)
    ids = torch.tensor([[3, 4, 0, 5, 6], [7, 8, 9, 10, 11]])
    mask = torch.tensor([[1, 1, 0, 1, 1], [1, 1, 1, 1, 1]])  # row 0's prompt [3, 4, pad], candidates [5, 6]
    model(input_ids=ids, attention_mask=mask, past_key_values=_Cache(0), logits_to_keep=3)
    assert seen[0].shape[0] == 9  # every real token, the candidates included


def test_a_prepared_mask_per_attention_kind_keeps_the_padding_out_of_the_predictions():
    """`_fed_mask`: a first forward may get one prepared 4-D mask per kind of attention (a dict, as transformers
    builds for models mixing full and sliding attention): the padding it shows gets no prediction row."""
    model = _Plain()
    seen = _attach(model)
    prepared = torch.tril(torch.ones(3, 3, dtype=torch.bool)).expand(2, 1, 3, 3).clone()
    prepared[0, 0, :, 0] = False  # row 0's first token is padding: nothing attends to it
    model(input_ids=torch.tensor([[0, 3, 4], [6, 7, 8]]), past_key_values=_Cache(0),
          attention_mask={"full_attention": prepared, "sliding_attention": prepared})
    assert seen[0].shape[0] == 5


def test_a_prepared_mask_on_a_filled_cache_reads_the_fed_tokens_as_real():
    """`_fed_mask`: after the first forward a prepared 4-D mask's columns are cache positions, not the fed tokens:
    a fed token's own is column cached + its index (a left-padded row's new token is not dropped because the row's
    first cache position is padding)."""
    model = _Plain()
    seen = _attach(model)
    prepared = torch.ones(2, 1, 1, 4, dtype=torch.bool)  # one new token on 3 cached positions
    prepared[0, 0, 0, 0] = False  # row 0's first cached position is padding
    model(input_ids=torch.tensor([[5], [9]]), attention_mask=prepared, past_key_values=_Cache(3))  # no session yet
    assert seen[0].shape[0] == 2


def test_a_later_prompt_chunk_s_padding_in_a_prepared_mask_gets_no_prediction():
    """`_fed_mask` on a filled cache: a prompt chunk fed with a static cache's prepared mask (keys: every cache
    position) shows its padding at the chunk's own positions; with one mask per kind of attention, the full one is
    read, where a sliding window's holds fewer keys (and is not read: its tokens would all be taken as real)."""
    model = _Plain()
    seen = _attach(model)
    causal = torch.arange(5)[None, :] <= 2 + torch.arange(3)[:, None]  # 3 tokens on 2 cached positions
    prepared = causal.expand(2, 1, 3, 5).clone()
    prepared[0, 0, :, :4] = False  # row 0: its cached positions and the chunk's first two tokens are padding
    window = torch.ones(2, 1, 3, 3, dtype=torch.bool)
    model(input_ids=torch.tensor([[0, 0, 4], [6, 7, 8]]), past_key_values=_Cache(2),
          attention_mask={"sliding_attention": window, "full_attention": prepared})
    assert seen[0].shape[0] == 4
    model(input_ids=torch.tensor([[0, 0, 4], [6, 7, 8]]), past_key_values=_Cache(2), attention_mask=window)
    assert seen[1].shape[0] == 6  # fewer keys than the cache holds: read as real


def test_a_cache_that_takes_no_weak_reference_is_followed_by_its_own_session_only():
    """A cache object that cannot be weakly referenced is remembered by its id (`_unkeyed`): another such cache of
    the same length and batch (a second batch served in turn) starts a session of its own, not the first's."""
    predictor = _small_predictor()
    model = _Plain()
    seen = _attach(model, predictor)
    first, second = _Unreferenced(0), _Unreferenced(3)  # `second` holds 3 positions no session has followed
    model(input_ids=torch.tensor([[3, 4, 5]]), past_key_values=first)
    first.length = 3
    model(input_ids=torch.tensor([[9]]), past_key_values=second)
    np.testing.assert_allclose(seen[1][0], _teacher(predictor, [9], [9])[-1], rtol=0, atol=ATOL)


def test_beam_search_on_a_cache_that_cannot_be_reordered_is_refused_as_generate_refuses_it():
    """The beam-reorder stand-in keeps generate's refusal: with no `_reorder_cache` of the model's own and a cache
    without `reorder_cache`, beam search is refused (ValueError), never run on a cache left in the old row order."""
    model = _Plain()
    _attach(model)
    cache = _LengthOnly(0)
    model(input_ids=torch.tensor([[3, 4], [5, 6]]), past_key_values=cache)
    cache.length = 2
    with pytest.raises(ValueError, match="cannot use beam search with a cache currently"):
        model._reorder_cache(cache, torch.tensor([1, 0]))


def _reorder_of_its_own(cache, beam_idx):
    """A `_reorder_cache` set on a model instance (a user's patch)."""
    cache.reorder_cache(beam_idx)
    return cache


def test_unwrap_puts_back_a_reorder_cache_the_model_had_as_an_instance_attribute(tmp_path):
    """`attach` stands in for an instance `_reorder_cache` the model already had (and calls it meanwhile); `unwrap`
    puts that one back, not nothing."""
    model = make_tiny("mixtral")
    model._reorder_cache = _reorder_of_its_own
    expertflow.wrap(model, cache_slots=8, policy="expertflow", predictor=random_predictor(model, tmp_path),
                    device="cpu")
    assert model.__dict__["_reorder_cache"] is not _reorder_of_its_own
    expertflow.unwrap(model)
    assert model.__dict__.get("_reorder_cache") is _reorder_of_its_own


def test_unwrapping_a_stale_shallow_copy_puts_back_its_own_reorder_cache_too(tmp_path):
    """A shallow copy carries the stand-in in its own `__dict__`: unwrapping it after the original was unwrapped
    puts back the instance `_reorder_cache` it had before the wrap (`_uninstall_guards`)."""
    model = make_tiny("mixtral")
    model._reorder_cache = _reorder_of_its_own
    expertflow.wrap(model, cache_slots=8, policy="expertflow", predictor=random_predictor(model, tmp_path),
                    device="cpu")
    shallow = copy.copy(model)
    expertflow.unwrap(model)
    assert model.__dict__.get("_reorder_cache") is _reorder_of_its_own
    expertflow.unwrap(shallow)  # a stale copy: only its leftovers go
    assert shallow.__dict__.get("_reorder_cache") is _reorder_of_its_own


# ---- the predictor path -----------------------------------------------------------------------------------------

def test_a_predictor_path_that_is_not_a_directory_is_named_as_such(tmp_path):
    """`predictor=` must be a trained predictor directory: a missing path or a file gets that said, as a WrapError,
    with the model untouched."""
    model = make_tiny("mixtral")
    (tmp_path / "predictor.safetensors").write_bytes(b"")
    for path in (tmp_path / "missing", tmp_path / "predictor.safetensors"):
        with pytest.raises(WrapError, match="is not a directory; give a trained predictor directory"):
            expertflow.wrap(model, policy="expertflow", predictor=str(path), cache_slots=8, device="cpu")
        assert not hasattr(model, "_expertflow_runtime")


def test_a_predictor_directory_with_a_broken_config_is_a_wrap_error(tmp_path):
    """A predictor directory whose files cannot be read (config.json not JSON, or not a predictor's) is refused as a
    WrapError that names it, not with the loader's bare ValueError."""
    model = make_tiny("mixtral")
    path = random_predictor(model, tmp_path)
    (tmp_path / "predictor" / "config.json").write_text("not json")
    with pytest.raises(WrapError, match="could not be loaded .*expertflow predictor train"):
        expertflow.wrap(model, policy="expertflow", predictor=path, cache_slots=8, device="cpu")
    assert not hasattr(model, "_expertflow_runtime")


# ---- stats and guards -------------------------------------------------------------------------------------------

def test_stats_read_while_wrapped_include_the_device_waits_still_timing(monkeypatch):
    """On a GPU a wait's timing lands late (CUDA events): `expertflow.stats(model)` collects the ones still pending,
    so `stall_s` read while the model is wrapped already counts them (not only after unwrap)."""
    monkeypatch.setattr(emulated_cuda.FakeEvent, "elapsed_time", lambda self, other: 7.0)  # every wait: 7 ms
    model = make_tiny("mixtral")
    with emulate(monkeypatch, progress=0.0):
        expertflow.wrap(model, cache_slots=2, device="cpu")
        try:
            model.generate(**batch("mixtral"), max_new_tokens=2, do_sample=False)
            expertflow.stats(model).reset()
            pair = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            pair[0].record()
            pair[1].record()
            runtime_of(model).cache.engine._stalls.append(pair)  # a wait still timing on the device
            assert expertflow.stats(model).stall_s == pytest.approx(0.007)
        finally:
            expertflow.unwrap(model)


def test_loading_a_single_expert_tensor_is_refused_too():
    """`load_state_dict` refuses expert tensors whatever their number: one expert tensor in the dict (strict=False)
    is refused as a WrapError, not silently dropped."""
    model = make_tiny("mixtral")
    expertflow.wrap(model, cache_slots=2, device="cpu")
    try:
        key = next(k for k in model.state_dict() if ".experts." in k)
        with pytest.raises(WrapError, match=r"cannot load expert weights .* and 0 more"):
            model.load_state_dict({key: model.state_dict()[key].clone()}, strict=False)
    finally:
        expertflow.unwrap(model)
