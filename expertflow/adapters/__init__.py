"""Adapters: the only code that knows Hugging Face classes. `find_adapter(model)` picks the one that fits.

Owns: the list of adapters and the error for models none of them fits. Does not know: caching or transfers.
"""

from __future__ import annotations

import sys

from torch import nn

from expertflow.adapters.base import SUPPORTED_FAMILIES, Adapter, MoELayer, UnsupportedModelError
from expertflow.adapters.experts3d import Experts3DAdapter
from expertflow.adapters.switch import SwitchAdapter

__all__ = ["Adapter", "MoELayer", "UnsupportedModelError", "SUPPORTED_FAMILIES", "find_adapter"]

_ADAPTERS: tuple[type[Adapter], ...] = (SwitchAdapter, Experts3DAdapter)
_MOE_WORDS = ("expert", "sparse", "router", "moeblock", "moelayer", "moemlp")


def find_adapter(model: nn.Module) -> tuple[Adapter, list[MoELayer]]:
    """The adapter whose layers the model has, with those layers; UnsupportedModelError otherwise."""
    for cls in _ADAPTERS:
        adapter = cls()
        layers = adapter.find_layers(model)
        if layers:
            return adapter, layers
    raise UnsupportedModelError(_unsupported_message(model))


def _every_layer_dense(config) -> bool:
    """The config of a supported family leaves no layer sparse (`mlp_only_layers` naming them all, a
    `decoder_sparse_step` past the last one, or `first_k_dense_replace` covering them all), as transformers' own
    classes read it; a model whose experts some other code holds (remote code) is not called dense."""
    layers = getattr(config, "num_hidden_layers", None)
    if not isinstance(layers, int) or layers < 1:
        return False
    experts = [getattr(config, key, None) for key in ("num_experts", "num_local_experts", "n_routed_experts")]
    if any(type(count) is int and count == 0 for count in experts):  # no experts at all: every layer a plain MLP
        return True
    dense = set(getattr(config, "mlp_only_layers", None) or ())
    step = getattr(config, "decoder_sparse_step", None)
    first = getattr(config, "first_k_dense_replace", None)
    sparse = [i for i in range(layers) if i not in dense and (not isinstance(step, int) or step < 1
                                                               or (i + 1) % step == 0)
              and (not isinstance(first, int) or i >= first)]
    return not sparse


def _declares_experts_interface(model: nn.Module) -> bool:
    """Whether the modeling code of `model`'s class defines an experts class decorated with transformers'
    `use_experts_implementation` (its `__init__` closes over the decorator's layout flags): a model type the
    generic adapter serves, even when this model's config builds none of those experts."""
    module = sys.modules.get(type(model).__module__)
    for value in vars(module).values() if module is not None else ():
        init = getattr(value, "__init__", None) if isinstance(value, type) and issubclass(value, nn.Module) else None
        code = getattr(init, "__code__", None)
        if code is not None and {"has_gate", "is_transposed", "is_concatenated"} <= set(code.co_freevars):
            return True
    return False


def _unsupported_message(model: nn.Module) -> str:
    family = getattr(getattr(model, "config", None), "model_type", None) or type(model).__name__
    moe_like = sorted({type(m).__name__ for m in model.modules()
                       if any(w in type(m).__name__.lower() for w in _MOE_WORDS)
                       or type(m).__name__.lower().endswith("moe")})
    if _every_layer_dense(getattr(model, "config", None)) and (family in SUPPORTED_FAMILIES
                                                               or _declares_experts_interface(model)):
        supported = ("a supported family" if family in SUPPORTED_FAMILIES else
                     "a supported model type (its experts class uses transformers' experts interface)")
        return (f"{type(model).__name__} (model_type={family!r}) is {supported}, but this model has no layer "
                "with experts (its config makes every layer dense: mlp_only_layers, decoder_sparse_step, "
                "first_k_dense_replace or the like); expertflow offloads experts only, so it has nothing to do here")
    if type(model).__module__.startswith("transformers_modules") and family in SUPPORTED_FAMILIES:
        return (f"{type(model).__name__} (model_type={family!r}) runs the checkpoint's own code (loaded with "
                f"trust_remote_code=True), whose classes no expertflow adapter knows; {family} is a supported family: "
                "load the model without trust_remote_code so that transformers' own classes are used")
    if not moe_like:
        return (f"{type(model).__name__} (model_type={family!r}) has no Mixture-of-Experts layers; expertflow offloads "
                f"the experts of MoE models only. Supported families: {', '.join(SUPPORTED_FAMILIES)}.")
    return (f"{type(model).__name__} (model_type={family!r}) has MoE classes {', '.join(moe_like)} that no expertflow "
            f"adapter recognises. Supported: {', '.join(SUPPORTED_FAMILIES)}, and any model whose experts class uses "
            f"transformers' `use_experts_implementation`. To add a family, write an Adapter "
            f"(expertflow/adapters/base.py) that finds its experts modules, lists each expert's tensors (and the "
            f"parameters they are taken from) and computes the experts from slot views (its static method "
            f"`compute`), and add it to expertflow.adapters._ADAPTERS.")
