"""Host copies of every expert, packed so that one expert is one contiguous run of bytes (one copy per swap).

Owns: the packed host buffers (page-locked when the compute device is CUDA), the layout of one expert's tensors
inside its bytes, and rebuilding the original tensors from them. Does not know: models, slots, policies or transfers.

Page-locking: each layer's buffer is an anonymous memory mapping of its own (page-aligned, zeroed, committed only as
it is written) registered with CUDA (`cudaHostRegister`), and unregistered by `close` or, at the latest, when the
mapping is freed. PyTorch's own pinned allocator (`pin_memory=True`) rounds every block up to a power of two, which
for a layer of Mixtral-8x7B's experts (2.8 GB) pins 4 GB, and keeps freed blocks pinned in its cache.

Layout: every expert of every layer occupies `slot_bytes` bytes (the largest expert, rounded up to 64); inside, each
named tensor starts at a 64-byte aligned offset so that typed views of a byte buffer are legal and kernel friendly.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import warnings
import weakref
from dataclasses import dataclass

import torch

__all__ = ["TensorSpec", "ExpertLayout", "ExpertStore"]

_ALIGN = 64
log = logging.getLogger(__name__)


def _on(device: torch.device | None):
    """The CUDA runtime calls on `device`, so that none of them opens a context on another GPU."""
    return torch.cuda.device(device) if device is not None else contextlib.nullcontext()


def _clear_cuda_error(device: torch.device | None) -> None:
    """A failed runtime call leaves its error pending on this thread, where the next kernel launch would raise it.
    PyTorch's launch check reads (and so clears) it: launch one and drop what it raises (not while a CUDA graph is
    being captured on this thread, where a launch would join the graph)."""
    try:
        if torch.cuda.is_current_stream_capturing():
            return
        torch.zeros(1, device=device if device is not None else "cuda")
    except Exception:  # the pending error itself (a RuntimeError), or no CUDA at all
        pass


def _unregister(address: int, device: torch.device | None, memory: mmap.mmap | None = None) -> None:
    """Unregister `address`; `memory`, the mapping it lies in, is held until then."""
    try:
        with _on(device):
            error = int(torch.cuda.cudart().cudaHostUnregister(address))
    except Exception as exc:  # e.g. at interpreter exit, with CUDA already shut down
        log.warning("expertflow: unregistering the expert store's memory failed (%s)", exc)
        return
    if error:
        _clear_cuda_error(device)
        log.warning("expertflow: unregistering the expert store's memory failed (CUDA error %d)", error)


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

    def __init__(self, slot_bytes: int, pin_memory: bool = False, device: torch.device | str | None = None) -> None:
        """`pin_memory`: page-lock each layer's buffer for copies to CUDA `device` (None: the current one)."""
        self.slot_bytes = _align(slot_bytes)
        self.pin_memory = pin_memory  # False again after a registration fails
        self.device = torch.device(device) if device is not None else None
        self.layouts: list[ExpertLayout] = []
        self.buffers: list[torch.Tensor] = []
        self._registrations: list[weakref.finalize] = []  # each unregisters one buffer (`close`, or when it is freed)

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
            # on the host whatever the default device (a `with torch.device(...)` block around `wrap`)
            buffer = torch.zeros(len(experts), self.slot_bytes, dtype=torch.uint8, device="cpu")
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
        """A zeroed `[rows, slot_bytes]` buffer on an anonymous mapping of its own, registered with CUDA (so that
        copies from it are asynchronous DMA, and `is_pinned()` is true); an ordinary one, with a warning, if the
        registration fails."""
        length = max(-(-rows * self.slot_bytes // mmap.PAGESIZE), 1) * mmap.PAGESIZE
        memory = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE)  # pages committed as written; not shared on fork
        view = memoryview(memory)  # the tensor keeps the view alive, and the finalizer below keeps the mapping
        block = torch.frombuffer(view, dtype=torch.uint8)
        address = block.data_ptr()
        with _on(self.device):
            error = int(torch.cuda.cudart().cudaHostRegister(address, length, 0))
        if error:
            _clear_cuda_error(self.device)
            self.pin_memory = False
            warnings.warn(f"page-locking the expert store failed (CUDA error {error}): its copies to the device will "
                          "be slower and will not overlap compute; free host memory, or pass pin_memory=False to "
                          "silence this", RuntimeWarning, stacklevel=5)
        else:
            # on the view: when it goes, the mapping (an argument here) is still there to unregister
            self._registrations.append(weakref.finalize(view, _unregister, address, self.device, memory))
        return block[: rows * self.slot_bytes].view(rows, self.slot_bytes)

    def after_fork(self) -> None:
        """In a child process forked after the store was made: the page-locking belongs to the parent's CUDA context,
        and a forked child cannot call CUDA; the child's copy of the bytes is ordinary memory. Forget the
        registrations (the mappings stay alive through the buffers' views)."""
        while self._registrations:
            self._registrations.pop().detach()

    def close(self) -> None:
        """Unregister the page-locked buffers now (idempotent); only once no copy reads them any more. Their bytes
        stay readable."""
        while self._registrations:
            self._registrations.pop()()

    def release_layer(self, layer: int) -> None:
        """Free a layer's bytes (its experts are back in the model; nothing reads them any more): the layer keeps its
        index, with no experts."""
        self.buffers[layer] = torch.empty(0, self.slot_bytes, dtype=torch.uint8, device="cpu")  # not a view

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
