"""The host expert store: packing and unpacking, and page-locking for CUDA through `cudaHostRegister` (whole pages
per layer, released by `close`), checked here against a recording stand-in for the CUDA runtime."""

from __future__ import annotations

import gc
import mmap

import pytest
import torch

import expertflow
from expertflow.runtime import runtime_of
from expertflow import store as store_module
from expertflow.store import ExpertLayout, ExpertStore
from families import make_tiny


class _FakeCudart:
    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.registered: dict[int, int] = {}
        self.unregistered: list[int] = []

    def cudaHostRegister(self, address: int, length: int, flags: int) -> int:
        if self.fail:
            return 2  # cudaErrorMemoryAllocation
        assert not any(a < address + length and address < a + n for a, n in self.registered.items()), "overlap"
        self.registered[address] = length
        return 0

    def cudaHostUnregister(self, address: int) -> int:
        self.unregistered.append(address)
        return 0 if self.registered.pop(address, None) is not None else 1


def _layers(store: ExpertStore, layout: ExpertLayout) -> None:
    for layer in range(3):
        store.add_layer(layout, [{"w": torch.full((5, 7), float(10 * layer + e)), "b": torch.arange(3.0) + e}
                                 for e in range(4 + layer)])


def test_a_page_locked_store_registers_whole_pages_per_layer_and_releases_them(monkeypatch):
    cudart = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    layout = ExpertLayout.from_tensors([("w", (5, 7), torch.float32), ("b", (3,), torch.float32)])
    store = ExpertStore(layout.nbytes, pin_memory=True)
    _layers(store, layout)
    assert len(cudart.registered) == 3  # one block per layer, none overlapping (checked on registration)
    page = mmap.PAGESIZE
    for buffer in store.buffers:
        base = buffer.untyped_storage().data_ptr()  # what `is_pinned()` asks CUDA about
        assert base == buffer.data_ptr() and base in cudart.registered and base % page == 0
        length = cudart.registered[base]
        assert length % page == 0 and length >= buffer.numel()  # rounded to a page, not to a power of two
        assert length < buffer.numel() + page
    for layer in range(3):
        assert torch.equal(store.stacked(layer, "w")[:, 0, 0], torch.arange(4.0 + layer) + 10 * layer)
        assert torch.equal(store.stacked_view(layer, "b"), store.stacked(layer, "b"))
    store.close()
    store.close()  # idempotent
    assert not cudart.registered and len(cudart.unregistered) == 3


def test_a_page_locked_buffer_is_unregistered_when_it_is_freed_without_close(monkeypatch):
    cudart = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    unregister = store_module._unregister

    def still_mapped(address, device, memory=None):  # the range must not be unmapped (and reusable) before this
        assert memory is not None and not memory.closed and len(memory) >= cudart.registered[address]
        unregister(address, device, memory)

    monkeypatch.setattr(store_module, "_unregister", still_mapped)
    layout = ExpertLayout.from_tensors([("w", (5, 7), torch.float32), ("b", (3,), torch.float32)])
    store = ExpertStore(layout.nbytes, pin_memory=True)
    _layers(store, layout)
    view = store.expert_bytes(0, 1)  # a view keeps its layer's memory (and registration) alive
    del store
    gc.collect()
    assert len(cudart.registered) == 1 and view.data_ptr() - view.storage_offset() in cudart.registered
    del view
    gc.collect()
    assert not cudart.registered and len(cudart.unregistered) == 3


def test_a_forked_childs_store_forgets_the_parents_page_locking_and_keeps_its_bytes(monkeypatch):
    """A forked child can make no CUDA call: after `after_fork` neither `close` nor freeing the buffers unregisters
    anything, and the bytes stay readable."""
    cudart = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    layout = ExpertLayout.from_tensors([("w", (5, 7), torch.float32), ("b", (3,), torch.float32)])
    store = ExpertStore(layout.nbytes, pin_memory=True)
    _layers(store, layout)
    view = store.expert_bytes(2, 5)
    store.after_fork()
    store.close()
    assert torch.equal(store.stacked(2, "w")[:, 0, 0], torch.arange(6.0) + 20)
    del store
    gc.collect()
    assert torch.equal(layout.views(view)["b"], torch.arange(3.0) + 5)  # the mapping outlives the registration
    del view
    gc.collect()
    assert cudart.unregistered == []


def test_a_store_that_cannot_be_page_locked_warns_and_still_works(monkeypatch):
    cudart = _FakeCudart(fail=True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    layout = ExpertLayout.from_tensors([("w", (5, 7), torch.float32), ("b", (3,), torch.float32)])
    store = ExpertStore(layout.nbytes, pin_memory=True)
    with pytest.warns(RuntimeWarning, match="page-locking the expert store failed .* pin_memory=False"):
        _layers(store, layout)
    assert not store.pin_memory and torch.equal(store.stacked(2, "b")[5], torch.arange(3.0) + 5)
    store.close()
    assert cudart.unregistered == []


def test_unwrap_a_failed_wrap_and_a_dropped_model_close_the_store(monkeypatch):
    closed = []
    monkeypatch.setattr(ExpertStore, "close", lambda self: closed.append(self))
    model = make_tiny("mixtral")
    expertflow.wrap(model, cache_slots=2, device="cpu")
    store = runtime_of(model).store
    expertflow.unwrap(model)
    assert store in closed
    closed.clear()

    def no_engine(*args):
        raise RuntimeError("no copy engine")

    with monkeypatch.context() as patch:
        patch.setattr(expertflow.runtime, "make_engine", no_engine)  # fails once the experts are packed
        with pytest.raises(RuntimeError, match="no copy engine"):
            expertflow.wrap(model, cache_slots=2, device="cpu")
    assert len(closed) == 1 and not hasattr(model, "_expertflow_runtime")
    expertflow.wrap(model, cache_slots=2, device="cpu")
    store = runtime_of(model).store
    del model
    gc.collect()
    assert store in closed
