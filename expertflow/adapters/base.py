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

__all__ = ["MoELayer", "Adapter", "UnsupportedModelError", "SUPPORTED_FAMILIES", "release_parameter",
           "restore_parameter"]

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

    def expert_names(self, layer: MoELayer) -> list[str]:
        """Names, relative to `layer.module`, of the parameters `remove_experts` takes out (all of them, over all
        experts); whatever else the module holds stays on the device."""
        raise NotImplementedError

    def remove_experts(self, layer: MoELayer) -> None:
        """Take the model's own expert parameters out (their bytes now live in the store) and free their memory with
        `release_parameter`, keeping the objects for `restore_experts` (which uses `restore_parameter`)."""
        raise NotImplementedError

    def restore_experts(self, layer: MoELayer, tensors: dict[str, torch.Tensor]) -> None:
        """Put the same expert parameter objects back, with these values; `tensors[name]` is stacked over experts
        `[E, ...]`."""
        raise NotImplementedError

    def expert_state(self, layer: MoELayer, store) -> dict[str, torch.Tensor]:
        """The layer's expert tensors as the model's `state_dict` names them, relative to `layer.module` (views of
        the store's host bytes, as `state_dict` gives references, not copies)."""
        raise NotImplementedError

    def make_forward(self, layer: MoELayer, run: Callable) -> Callable:
        """A replacement for the experts module's forward that routes through `run(layer, hidden, top_k_index,
        top_k_weights)`."""
        raise NotImplementedError

    @staticmethod
    def compute(module: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                waves: Iterator[list[tuple[int, dict[str, torch.Tensor]]]],
                plan: tuple[torch.Tensor, list[int], list[int]]) -> torch.Tensor:
        """The experts module's output for one call, `[T, H]` like `hidden`, computed from slot views. A static
        method: the runtime calls it on the adapter's class (`wrap` refuses an adapter that does not define it),
        with what `make_forward` passed to `run`: `hidden` `[T, H]`, `top_k_index` and `top_k_weights` `[T, K]`
        (an index < 0 or ≥ the layer's number of experts E names no expert).

        `plan` = `(order, starts, counts)`: `order` `[T*K]` holds the flat (token, k) row numbers (`token * K + k`)
        sorted by expert, stably, rows naming no expert last; expert `e`'s rows are `order[starts[e]: starts[e] +
        counts[e]]` (`starts` and `counts`: Python lists of E ints).

        `waves` (`WaveSource`'s iterator) yields lists of `(expert, views)`, `views` mapping each tensor name of the
        layer's layout to that expert's tensor in its device slot. Together they name each expert that has rows
        once, in no set order (an expert whose slot a waiting copy takes next comes first, alone). Compute a list's
        experts before asking for the next one, and keep none of its views: once the next list is asked for, their
        slots may be reused. The runtime closes `waves` after `compute` returns or raises."""
        raise NotImplementedError


def release_parameter(param: nn.Parameter) -> None:
    """Free a removed expert parameter's memory but keep the object (its attributes, and every reference to it, an
    optimizer's say) for `restore_parameter`. A gradient it holds waits in host memory meanwhile."""
    if param.grad is not None:
        param._expertflow_grad = param.grad.to("cpu")
        param.grad = None
    if not param.is_contiguous() and _dense(param.shape, param.stride()):  # a layout of its own (a transposed copy)
        param._expertflow_stride = param.stride()
    param.data = torch.empty(0, dtype=param.dtype, device=param.device)


def restore_parameter(param: nn.Parameter, values: torch.Tensor) -> nn.Parameter:
    """Give a parameter taken out by `release_parameter` its values (and gradient) back, in the memory layout it had
    (kernels take other paths by layout, so the last bits of what the model computes depend on it); returns it."""
    stride = param.__dict__.pop("_expertflow_stride", None)
    if stride is not None and len(stride) == values.dim():
        values = torch.empty_strided(values.shape, stride, dtype=values.dtype, device=values.device).copy_(values)
    param.data = values
    grad = param.__dict__.pop("_expertflow_grad", None)
    if grad is not None:
        param.grad = grad.to(values.device)
    return param


def _dense(shape: torch.Size, stride: tuple[int, ...]) -> bool:
    """Whether a tensor of `shape` and `stride` covers its memory without gaps or overlaps, in some order of its
    dimensions (a permuted contiguous tensor), so that a tensor of that layout can be made anew."""
    expected = 1
    for step, size in sorted((st, sz) for sz, st in zip(shape, stride) if sz != 1):
        if step != expected:
            return False
        expected *= size
    return True
