"""Host copies of every expert, packed so that one expert is one contiguous run of bytes (one copy per swap).

Owns: the packed host buffers (page-locked when the compute device is CUDA), the layout of one expert's tensors
inside its bytes, and rebuilding the original tensors from them. Does not know: models, slots, policies or transfers.

Page-locking: each layer's buffer is ordinary host memory, page-aligned, registered with CUDA (`cudaHostRegister`)
and unregistered by `close`. PyTorch's own pinned allocator (`pin_memory=True`) rounds every block up to a power of
two, which for a layer of Mixtral-8x7B's experts (2.8 GB) pins 4 GB, and keeps freed blocks pinned in its cache.

Layout: every expert of every layer occupies `slot_bytes` bytes (the largest expert, rounded up to 64); inside, each
named tensor starts at a 64-byte aligned offset so that typed views of a byte buffer are legal and kernel friendly.
"""

from __future__ import annotations

import logging
import mmap
import warnings
from dataclasses import dataclass

import torch

__all__ = ["TensorSpec", "ExpertLayout", "ExpertStore"]

_ALIGN = 64
log = logging.getLogger(__name__)


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
        self.pin_memory = pin_memory  # page-lock each layer's buffer (CUDA); False after a registration fails
        self.layouts: list[ExpertLayout] = []
        self.buffers: list[torch.Tensor] = []
        self._registered: list[int] = []  # addresses registered with CUDA, for `close`

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
        if self.pin_memory:
            buffer = self._page_locked(len(experts))
        else:
            buffer = torch.zeros(len(experts), self.slot_bytes, dtype=torch.uint8)
        for e, tensors in enumerate(experts):
            views = layout.views(buffer[e])
            for spec in layout.tensors:
                src = tensors[spec.name]
                assert tuple(src.shape) == spec.shape and src.dtype == spec.dtype, f"{spec.name}: layout mismatch"
                views[spec.name].copy_(src.detach())
        self.layouts.append(layout)
        self.buffers.append(buffer)
        return len(self.buffers) - 1

    def _page_locked(self, rows: int) -> torch.Tensor:
        """A zeroed `[rows, slot_bytes]` buffer on whole pages of its own, registered with CUDA (so that copies from
        it are asynchronous DMA); an ordinary one, with a warning, if the registration fails."""
        page = mmap.PAGESIZE
        length = -(-rows * self.slot_bytes // page) * page
        raw = torch.empty(length + page, dtype=torch.uint8)
        start = -raw.data_ptr() % page
        block = raw[start : start + length]  # no page shared with another allocation: each is registered once
        block.zero_()
        error = int(torch.cuda.cudart().cudaHostRegister(block.data_ptr(), length, 0))
        if error:
            self.pin_memory = False
            warnings.warn(f"page-locking the expert store failed (CUDA error {error}): its copies to the device will "
                          "be slower and will not overlap compute; free host memory, or pass pin_memory=False to "
                          "silence this", RuntimeWarning, stacklevel=4)
        else:
            self._registered.append(block.data_ptr())
        return block[: rows * self.slot_bytes].view(rows, self.slot_bytes)

    def close(self) -> None:
        """Unregister the page-locked buffers (idempotent). Only once no copy reads them any more."""
        while self._registered:
            address = self._registered.pop()
            error = int(torch.cuda.cudart().cudaHostUnregister(address))
            if error:
                log.warning("expertflow: unregistering the expert store's memory failed (CUDA error %d)", error)

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
