"""Adapter for Switch Transformers (encoder–decoder; experts are a `ModuleDict` of `expert_{i}` dense MLPs; top-1
routing with a per-sequence capacity, so some tokens reach no expert).

Owns: finding `SwitchTransformersExperts` modules, moving their `wi`/`wo` weights out and back, and computing the
experts forward from slot views exactly as transformers does (ascending expert order, `index_add_`). Does not know:
caching or transfers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.module import _global_forward_hooks, _global_forward_pre_hooks

from expertflow.adapters.base import Adapter, MoELayer, release_parameter, restore_parameter
from expertflow.store import ExpertLayout

__all__ = ["SwitchAdapter", "is_switch_experts"]

_NAMES = ("wi", "wo")


def is_switch_experts(module: nn.Module) -> bool:
    try:
        from transformers.models.switch_transformers.modeling_switch_transformers import SwitchTransformersExperts
    except ImportError:  # pragma: no cover - transformers without this family
        return False
    return isinstance(module, SwitchTransformersExperts)


class SwitchAdapter(Adapter):
    name = "switch_transformers"

    def find_layers(self, model: nn.Module) -> list[MoELayer]:
        layers = []
        for name, module in model.named_modules():
            if not is_switch_experts(module):
                continue
            first = module["expert_0"]
            layout = ExpertLayout.from_tensors(
                [(n, tuple(getattr(first, n).weight.shape), getattr(first, n).weight.dtype) for n in _NAMES])
            stack = name.split(".block.")[0]  # "encoder" / "decoder" (with any prefix)
            starts_pass = bool(layers) and layers[-1].name.split(".block.")[0] != stack
            layers.append(MoELayer(len(layers), name, module, len(module), layout, len(layers),
                                   starts_pass=starts_pass))
        return layers

    def expert_tensors(self, layer: MoELayer, expert: int) -> dict[str, torch.Tensor]:
        mlp = layer.module[f"expert_{expert}"]
        return {n: getattr(mlp, n).weight for n in _NAMES}

    def expert_names(self, layer: MoELayer) -> list[str]:
        return [f"expert_{e}.{n}.weight" for e in range(layer.num_experts) for n in _NAMES]

    def remove_experts(self, layer: MoELayer) -> None:
        layer.removed = []
        for e in range(layer.num_experts):
            mlp = layer.module[f"expert_{e}"]
            for n in _NAMES:
                linear = getattr(mlp, n)
                param = linear._parameters.pop("weight")
                layer.removed.append((e, n, param))
                release_parameter(param)

    def restore_experts(self, layer: MoELayer, tensors: dict[str, torch.Tensor]) -> None:
        for e, n, param in layer.removed:
            linear = getattr(layer.module[f"expert_{e}"], n)
            restore_parameter(param, tensors[n][e].clone())
            bias = linear._parameters.pop("bias", None)
            linear._parameters["weight"] = param  # the same object, keeping the original order: weight, bias
            linear._parameters["bias"] = bias
        layer.removed = []

    def expert_state(self, layer: MoELayer, store) -> dict[str, torch.Tensor]:
        return {f"expert_{e}.{n}.weight": store.expert_tensors(layer.index, e)[n]
                for e in range(layer.num_experts) for n in _NAMES}

    def make_forward(self, layer: MoELayer, run: Callable) -> Callable:
        def forward(hidden_states: torch.Tensor, selected_experts: torch.Tensor, routing_weights: torch.Tensor):
            # selected_experts: one-hot [T, 1, E] (all zero where capacity dropped the token) → ids [T, 1], -1 = none
            routed = selected_experts.sum(dim=-1) > 0
            top_k_index = torch.where(routed, selected_experts.argmax(dim=-1), -1)
            return run(layer, hidden_states, top_k_index, routing_weights)

        forward.__expertflow__ = True  # type: ignore[attr-defined]
        return forward

    @staticmethod
    def compute(module: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor, routing_weights: torch.Tensor,
                waves, plan) -> torch.Tensor:
        # T = tokens; top_k_index [T, 1]; routing_weights [T, 1]
        order, starts, counts = plan
        outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        mlps = {e: module[f"expert_{e}"] for e, count in enumerate(counts) if count}
        # Each routed expert's own `act` and `dropout` modules run on its activations as transformers runs them (the
        # whole model in train mode, or only its dropout modules for Monte Carlo dropout, or modules of other kinds,
        # hooks included). A dropout module that may draw random numbers runs from the random state its turn has
        # unwrapped (ascending id), recorded before the layer; one that cannot (`nn.Identity`, an `nn.Dropout` in eval
        # mode or with p = 0) runs only for its hooks, without touching the generator, and not at all without hooks.
        called = {e: mlp.dropout for e, mlp in mlps.items() if not _inert(mlp.dropout)}
        replayed = {e: dropout for e, dropout in called.items() if not _draws_nothing(dropout)}
        draws = _dropout_draws(replayed, hidden, counts, module["expert_0"].wi.out_features) if replayed else None
        try:
            for wave in waves:
                for expert, views in wave:
                    tokens = order[starts[expert]: starts[expert] + counts[expert]]  # ascending token ids
                    h = mlps[expert].act(F.linear(hidden[tokens], views["wi"]))
                    if expert in called:
                        if expert in replayed:
                            draws.set(expert)
                        h = called[expert](h)
                    if h.dtype != views["wo"].dtype and views["wo"].dtype != torch.int8:
                        h = h.to(views["wo"].dtype)
                    outputs[expert] = (tokens, F.linear(h, views["wo"]) * routing_weights[tokens, 0, None])
        finally:
            if draws is not None:
                draws.finish()
        final = torch.zeros_like(hidden)
        for expert in sorted(outputs):
            tokens, out = outputs[expert]
            final.index_add_(0, tokens, out.to(hidden.dtype))
        return final


class _DropoutDraws:
    """The random state at each routed expert's turn in transformers' order (ascending id), so that its dropout draws
    what it draws unwrapped although the experts are computed in the cache's order (waves); `finish` leaves the
    generator where the unwrapped layer leaves it. For dropout that draws from torch's default generator of the
    activations' device a number of values that does not depend on them, as `nn.Dropout` does."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.states: dict[int, torch.Tensor] = {}
        self.end: torch.Tensor | None = None

    def get(self) -> torch.Tensor:
        return torch.cuda.get_rng_state(self.device) if self.cuda else torch.get_rng_state()

    def put(self, state: torch.Tensor) -> None:
        if self.cuda:
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    def set(self, expert: int) -> None:
        self.put(self.states[expert])

    def finish(self) -> None:
        if self.end is not None:
            self.put(self.end)


def _draws_nothing(dropout: nn.Module) -> bool:
    """Its own forward returns its input and draws nothing: an `nn.Identity`, or an `nn.Dropout` in eval mode or with
    p = 0 (these exact types, their forward not replaced on the module)."""
    if "forward" in vars(dropout):
        return False
    return type(dropout) is nn.Identity or type(dropout) is nn.Dropout and (not dropout.training or dropout.p == 0)


def _inert(dropout: nn.Module) -> bool:
    """Returns its input, draws nothing and has no hooks to run: it need not be called."""
    hooked = dropout._forward_hooks or dropout._forward_pre_hooks or _global_forward_hooks or _global_forward_pre_hooks
    return not hooked and _draws_nothing(dropout)


def _dropout_draws(replayed: dict[int, nn.Module], hidden: torch.Tensor, counts: list[int],
                   width: int) -> _DropoutDraws:
    """Advance the generator through each routed expert's dropout module in ascending id (those in `replayed`; the
    others draw nothing of their own), called on zeros of the shape, dtype and device of its activations (the draws
    must not depend on the values), keeping the state before each. The module is called with its hooks, so that what
    they draw is replayed too: they run twice, once here on zeros and once on the activations."""
    draws = _DropoutDraws(hidden.device)
    for expert in sorted(replayed):
        draws.states[expert] = draws.get()
        replayed[expert](hidden.new_zeros(counts[expert], width))
    draws.end = draws.get()
    return draws
