"""A wrapped model dropped without `unwrap` is freed by reference counting alone, as an unwrapped one is: its
experts modules and its host expert store (a copy of every expert) go with it, not at some later cyclic garbage
collection (never, in a process that runs with the collector disabled or frozen)."""

from __future__ import annotations

import contextlib
import copy
import gc
import weakref

import pytest
import torch

import expertflow
from expertflow.runtime import WrapError, runtime_of
from families import batch, make_tiny, random_predictor


@contextlib.contextmanager
def _reference_counting_only():
    """Objects are freed by reference counting alone meanwhile."""
    gc.collect()  # what earlier code left to the collector (a first import's traceback keeps its frames)
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _experts_modules(model) -> list[torch.nn.Module]:
    """A wrapped model's experts modules."""
    return [layer.module for layer in runtime_of(model).layers]


def _wrap_and_generate(model, family: str, policy: str, tmp_path) -> torch.Tensor:
    options = dict(cache_slots=3, device="cpu", policy=policy)
    if policy == "expertflow" and family != "switch_transformers":  # an encoder-decoder model plans without one
        options["predictor"] = random_predictor(model, tmp_path)
    expertflow.wrap(model, **options)
    return model.generate(**batch(family), max_new_tokens=3, do_sample=False)


@pytest.mark.parametrize("family, policy", [("mixtral", "lru"), ("mixtral", "expertflow"),
                                            ("switch_transformers", "expertflow")])
def test_a_wrapped_model_dropped_without_unwrap_frees_its_experts_and_store_at_once(family, policy, tmp_path):
    model = make_tiny(family)
    reference = model.generate(**batch(family), max_new_tokens=3, do_sample=False)
    with _reference_counting_only():
        assert torch.equal(_wrap_and_generate(model, family, policy, tmp_path), reference)
        refs = {"model": weakref.ref(model), "store": weakref.ref(runtime_of(model).store)}
        refs.update({f"experts module {i}": weakref.ref(m) for i, m in enumerate(_experts_modules(model))})
        del model
        assert [name for name, ref in refs.items() if ref() is not None] == []


def test_a_kept_experts_module_of_a_dropped_model_refuses_to_run_and_still_gives_its_experts():
    """The rest of the model goes at once; the kept module keeps the store (its state_dict reads its experts from
    it) until it goes too."""
    model = make_tiny("mixtral")
    experts = model.model.layers[0].mlp.experts
    originals = {k: v.clone() for k, v in experts.state_dict().items()}
    with _reference_counting_only():
        expertflow.wrap(model, cache_slots=2, device="cpu", policy="lru")
        model.generate(**batch("mixtral"), max_new_tokens=2, do_sample=False)
        model_ref, store = weakref.ref(model), weakref.ref(runtime_of(model).store)
        del model
        assert model_ref() is None
        hidden, index, weights = torch.randn(3, 32), torch.tensor([[0, 1], [2, 3], [4, 5]]), torch.full((3, 2), 0.5)
        with pytest.raises(WrapError, match="was dropped without expertflow.unwrap.*keep the wrapped model"):
            experts(hidden, index, weights)
        state = experts.state_dict()
        assert list(state) == list(originals) and all(torch.equal(state[k], v) for k, v in originals.items())
        assert store() is not None
        del experts, state
        assert store() is None


def test_a_shallow_copy_works_after_the_original_is_dropped_and_frees_everything_when_dropped_too(tmp_path):
    model = make_tiny("mixtral")
    inputs = batch("mixtral")
    reference = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    with _reference_counting_only():
        assert torch.equal(_wrap_and_generate(model, "mixtral", "expertflow", tmp_path), reference)
        shallow = copy.copy(model)
        refs = {"model": weakref.ref(model), "store": weakref.ref(runtime_of(model).store)}
        refs.update({f"experts module {i}": weakref.ref(m) for i, m in enumerate(_experts_modules(shallow))})
        del model
        assert refs["model"]() is None
        assert torch.equal(shallow.generate(**inputs, max_new_tokens=3, do_sample=False), reference)
        with pytest.raises(WrapError, match="cannot be copied or pickled"):
            copy.deepcopy(shallow.model.layers[0].mlp.experts)
        del shallow
        assert [name for name, ref in refs.items() if ref() is not None] == []


def test_unwrap_restores_the_model_bit_for_bit_and_a_rewrapped_copy_works(tmp_path):
    model = make_tiny("mixtral")
    inputs = batch("mixtral")
    reference = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    snapshot = {k: v.clone() for k, v in model.state_dict().items()}
    with _reference_counting_only():
        assert torch.equal(_wrap_and_generate(model, "mixtral", "expertflow", tmp_path), reference)
        store, experts = weakref.ref(runtime_of(model).store), _experts_modules(model)
        assert expertflow.unwrap(model) is model
        assert store() is None
        assert all("forward" not in vars(m) for m in experts)
        now = model.state_dict()
        assert list(now) == list(snapshot) and all(torch.equal(now[k], v) for k, v in snapshot.items())
        shallow = copy.copy(model)
        expertflow.wrap(shallow, cache_slots=3, device="cpu", policy="lru")
        assert torch.equal(shallow.generate(**inputs, max_new_tokens=3, do_sample=False), reference)
        expertflow.unwrap(shallow)
        assert torch.equal(model.generate(**inputs, max_new_tokens=3, do_sample=False), reference)
