"""Host copies of every expert, packed so that one expert is one contiguous run of bytes (one copy per swap).

Owns: the packed host buffers (pinned when the compute device is CUDA), the layout of one expert's tensors inside
its bytes, and rebuilding the original tensors from them. Does not know: models, slots, policies or transfers.

Layout: every expert of every layer occupies `slot_bytes` bytes (the largest expert, rounded up to 64); inside, each
named tensor starts at a 64-byte aligned offset so that typed views of a byte buffer are legal and kernel friendly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["TensorSpec", "ExpertLayout", "ExpertStore"]

_ALIGN = 64


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


@dataclass(frozen=True)
class TensorSpec:
    """One named tensor of an expert: where its bytes sit inside the expert's packed bytes."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int

    @property
    def nbytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class ExpertLayout:
    """The tensors of one expert of one layer, in packing order."""

    tensors: tuple[TensorSpec, ...]

    @classmethod
    def from_tensors(cls, named: list[tuple[str, tuple[int, ...], torch.dtype]]) -> "ExpertLayout":
        specs, offset = [], 0
        for name, shape, dtype in named:
            spec = TensorSpec(name, tuple(shape), dtype, offset)
            specs.append(spec)
            offset = _align(offset + spec.nbytes)
        return cls(tuple(specs))

    @property
    def nbytes(self) -> int:
        last = self.tensors[-1]
        return _align(last.offset + last.nbytes)

    def views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed views of a 1-D uint8 buffer holding one expert."""
        out = {}
        for spec in self.tensors:
            raw = buffer[spec.offset : spec.offset + spec.nbytes]
            out[spec.name] = raw.view(spec.dtype).view(spec.shape)
        return out


class ExpertStore:
    """Packed host bytes of all experts: `buffers[layer]` is uint8 `[E, slot_bytes]`.

    Built layer by layer with `add_layer`, so that the caller can free each layer's original parameters right
    after its experts are packed and host memory never holds two copies of more than one layer.
    """

    def __init__(self, slot_bytes: int, pin_memory: bool = False) -> None:
        self.slot_bytes = _align(slot_bytes)
        self.pin_memory = pin_memory
        self.layouts: list[ExpertLayout] = []
        self.buffers: list[torch.Tensor] = []

    @property
    def num_layers(self) -> int:
        return len(self.buffers)

    def num_experts(self, layer: int) -> int:
        return self.buffers[layer].shape[0]

    @property
    def total_bytes(self) -> int:
        return sum(b.numel() for b in self.buffers)

    def add_layer(self, layout: ExpertLayout, experts: list[dict[str, torch.Tensor]]) -> int:
        """Pack one layer's experts (each a dict name → tensor matching `layout`); returns the layer index."""
        assert layout.nbytes <= self.slot_bytes, "slot_bytes must hold the largest expert"
        buffer = torch.zeros(len(experts), self.slot_bytes, dtype=torch.uint8, pin_memory=self.pin_memory)
        for e, tensors in enumerate(experts):
            views = layout.views(buffer[e])
            for spec in layout.tensors:
                src = tensors[spec.name]
                assert tuple(src.shape) == spec.shape and src.dtype == spec.dtype, f"{spec.name}: layout mismatch"
                views[spec.name].copy_(src.detach())
        self.layouts.append(layout)
        self.buffers.append(buffer)
        return len(self.buffers) - 1

    def expert_bytes(self, layer: int, expert: int) -> torch.Tensor:
        """The packed bytes of one expert: uint8 `[slot_bytes]` (a view, no copy)."""
        return self.buffers[layer][expert]

    def expert_tensors(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        """Typed views of one expert's tensors in host memory."""
        return self.layouts[layer].views(self.buffers[layer][expert])

    def stacked_view(self, layer: int, name: str) -> torch.Tensor:
        """All experts' tensor `name` of a layer as one `[E, ...]` view of the store (no copy: writing to it writes
        the store)."""
        spec = next(s for s in self.layouts[layer].tensors if s.name == name)
        raw = self.buffers[layer][:, spec.offset : spec.offset + spec.nbytes]  # rows slot_bytes apart, both aligned
        return raw.view(spec.dtype).view(raw.shape[0], *spec.shape)

    def stacked(self, layer: int, name: str) -> torch.Tensor:
        """All experts' tensor `name` of a layer stacked on a new leading dim (a fresh copy)."""
        return torch.stack([self.expert_tensors(layer, e)[name] for e in range(self.num_experts(layer))])
