"""What an adapter tells the runtime about one MoE layer, and the errors for models we cannot wrap.

Owns: the `MoELayer` record and the `Adapter` interface. Does not know: caching, policies or transfers. Adapters are
the only code that names Hugging Face classes; the runtime sees layers, expert tensors and a compute function.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from expertflow.errors import WrapError
from expertflow.store import ExpertLayout

__all__ = ["MoELayer", "Adapter", "UnsupportedModelError", "SUPPORTED_FAMILIES"]

SUPPORTED_FAMILIES = (
    "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "olmoe", "phimoe", "granitemoe", "gpt_oss",
    "switch_transformers",
)

# Waves of (expert id, {tensor name: view in its device slot}) handed to a compute function by the runtime.
WaveSource = Callable[[list[int]], Iterator[list[tuple[int, dict[str, torch.Tensor]]]]]


class UnsupportedModelError(WrapError):
    """The model has no MoE layers we know how to offload (a `WrapError`: `wrap` refuses it)."""


@dataclass
class MoELayer:
    """One MoE layer as the runtime sees it."""

    index: int  # 0..L-1 over the model's MoE layers, in execution order
    name: str  # module path of the experts module
    module: nn.Module  # the experts module whose forward the runtime replaces
    num_experts: int
    layout: ExpertLayout
    layer_id: int  # the model's own layer index (decoder layer number; encoder/decoder stacks numbered in order)
    removed: list = field(default_factory=list)  # adapter-private record of the parameters taken out
    starts_pass: bool = False  # first MoE layer of another stack (a decoder after its encoder): a new forward pass


class Adapter:
    """Finds MoE layers, moves their expert tensors out and back, and computes experts from slot views."""

    name = "base"

    def find_layers(self, model: nn.Module) -> list[MoELayer]:
        raise NotImplementedError

    def expert_tensors(self, layer: MoELayer, expert: int) -> dict[str, torch.Tensor]:
        """The expert's tensors as they are in the model (before removal)."""
        raise NotImplementedError

    def remove_experts(self, layer: MoELayer) -> None:
        """Drop the model's own expert parameters (their bytes now live in the store)."""
        raise NotImplementedError

    def restore_experts(self, layer: MoELayer, tensors: dict[str, torch.Tensor]) -> None:
        """Put the expert parameters back; `tensors[name]` is stacked over experts `[E, ...]`."""
        raise NotImplementedError

    def make_forward(self, layer: MoELayer, run: Callable) -> Callable:
        """A replacement for the experts module's forward that routes through `run(layer, ...)`."""
        raise NotImplementedError
