"""An emulated `torch.cuda` for running the CUDA transfer engine on the CPU under the device's ordering rules.

Owns: fake streams and events, the interception of non-blocking copies, and a checker of read/write ordering on the
slot bank. Does not know: policies or models; it sees byte copies, event records, waits and slot reads.

What CUDA guarantees, and only that, is kept: a stream runs its own work in order, and a stream that waits on an
event runs nothing after the wait until the work recorded before the event has run. Side streams defer their work;
a seeded generator decides when each runs a little more, so copies land late and in varied orders. The compute
stream is the host itself (a layer computes when the host calls it): a compute-stream wait runs the side streams
until the event is done; a host query or synchronize is the only way the host learns that side work has finished.

Every operation carries a vector clock (per stream, how much of its work is known to have run before). So an
ordering that is missing is reported even when the random order happened to put the bytes right:
  * read after write: a slot handed to compute must be ordered after the last copy into it;
  * write after read: a copy into a slot must be ordered after the compute that last read it (a slot counts as read
    when the cache hands its views out and again when the cache resumes after them, by which time the compute
    reading them has been issued);
  * write after write: a copy into a slot must be ordered after the previous write into it: the previous copy, or
    the bank's zero-fill, which runs on the compute stream when the bank is made.
Wrong bytes also show up in the tokens, since the copies really run when their stream reaches them.
"""

from __future__ import annotations

import random
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode

from expertflow import cache as cache_module
from expertflow import runtime as runtime_module
from expertflow import transfer

COMPUTE = "compute"


def _join(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    out = dict(a)
    for name, seq in b.items():
        out[name] = max(out.get(name, 0), seq)
    return out


class Device:
    """The emulated device: its streams, the host's knowledge of finished work, and the slot-ordering checker."""

    def __init__(self, seed: int = 0, progress: float = 0.3) -> None:
        self.rng = random.Random(seed)
        self.progress_p = progress  # chance that a side stream runs one more operation at each CUDA call
        self.streams: list[FakeStream] = []
        self.host: dict[str, int] = {}  # side work the host has seen finish (query, synchronize)
        self.compute = FakeStream(self, name=COMPUTE)
        self.current = self.compute
        self.hazards: list[str] = []
        self.copies = 0  # non-blocking copies issued so far
        self.fail_copies: set[int] = set()  # ordinals of the copies that fail to issue (as a CUDA error would)
        self.failed_on: list[int] = []  # priority of the stream of each failed copy
        self.bank: torch.Tensor | None = None  # the slot bank `[slots, slot_bytes]` being checked
        self._last_copy: dict[int, tuple[str, int]] = {}  # slot → (stream, seq) of the last write into it
        self._last_read: dict[int, int] = {}  # slot → compute seq of the last read

    # the side streams run a little, at random, whenever the host touches CUDA
    def advance(self) -> None:
        for stream in self.streams:
            while stream.ops and self.rng.random() < self.progress_p and stream.step():
                pass

    def run_until(self, done) -> None:
        while not done():
            if not any(stream.step() for stream in self.streams):
                raise RuntimeError("deadlock: no stream can run and the awaited work has not finished")

    # slot ordering checks
    def slot_of(self, dst: torch.Tensor) -> int | None:
        if self.bank is None:
            return None
        offset, row = dst.data_ptr() - self.bank.data_ptr(), self.bank.shape[1]
        if 0 <= offset < self.bank.numel() and offset % row == 0:
            return offset // row
        return None

    def copy_enqueued(self, slot: int, clock: dict[str, int], stream: str) -> None:
        if slot in self._last_read and clock.get(COMPUTE, 0) < self._last_read[slot]:
            self.hazards.append(f"write after read: a copy into slot {slot} on {stream} may land while compute "
                                f"still reads it")
        if slot in self._last_copy:
            name, seq = self._last_copy[slot]
            if clock.get(name, 0) < seq:
                self.hazards.append(f"write after write: a copy into slot {slot} on {stream} may land before the "
                                    f"earlier write into it on {name}")
        self._last_copy[slot] = (stream, clock[stream])

    def slot_read(self, slot: int) -> None:
        clock = self.compute.tick()
        if slot in self._last_copy:
            name, seq = self._last_copy[slot]
            if clock.get(name, 0) < seq:
                self.hazards.append(f"read after write: compute reads slot {slot} before waiting for the copy "
                                    f"into it on {name}")
        self._last_read[slot] = clock[COMPUTE]

    def forget_bank(self, bank: torch.Tensor) -> None:
        """A new bank `[slots, slot_bytes]`, made and zero-filled on the compute stream: a write into every slot."""
        self.bank = bank
        self._last_copy.clear()
        self._last_read.clear()
        filled = self.compute.tick()[COMPUTE]
        self._last_copy.update((slot, (COMPUTE, filled)) for slot in range(bank.shape[0]))


class FakeEvent:
    def __init__(self, enable_timing: bool = False, **_) -> None:
        self.device = DEVICE
        self.enable_timing = enable_timing
        self.recorded = False
        self.done = False
        self.clock: dict[str, int] | None = None

    def record(self, stream: "FakeStream | None" = None) -> None:
        self.recorded, self.done = True, False
        (stream or self.device.current).enqueue(("record", self))
        self.device.advance()

    def finished(self) -> bool:
        return self.done or not self.recorded  # an event never recorded counts as complete, as in CUDA

    def query(self) -> bool:
        self.device.advance()
        if self.finished() and self.clock is not None:
            self.device.host = _join(self.device.host, self.clock)
        return self.finished()

    def synchronize(self) -> None:
        self.device.run_until(self.finished)
        if self.clock is not None:
            self.device.host = _join(self.device.host, self.clock)

    def elapsed_time(self, other: "FakeEvent") -> float:
        assert self.enable_timing and other.enable_timing, "elapsed_time needs events made with enable_timing=True"
        assert self.finished() and other.finished(), "elapsed_time on an event that has not completed"
        return 0.0


class FakeStream:
    def __init__(self, device: "Device | torch.device | None" = None, priority: int = 0, name: str | None = None):
        self.owner = device if isinstance(device, Device) else DEVICE
        self.device = None  # every stream is on the one emulated GPU
        self.priority = priority
        self.name = name or f"side{len(self.owner.streams)}"
        self.ops: list[tuple] = []
        self.clock: dict[str, int] = {}
        if self.name != COMPUTE:
            self.owner.streams.append(self)

    def tick(self) -> dict[str, int]:
        """One more operation on this stream, ordered after everything the host has seen finish."""
        self.clock = _join(self.clock, self.owner.host)
        self.clock[self.name] = self.clock.get(self.name, 0) + 1
        return dict(self.clock)

    def enqueue(self, op: tuple) -> None:
        kind = op[0]
        if kind == "wait" and op[1].clock is not None:
            self.clock = _join(self.clock, op[1].clock)
        clock = self.tick()
        if kind == "record":
            op[1].clock = clock
        elif kind == "copy" and (slot := self.owner.slot_of(op[1])) is not None:
            self.owner.copy_enqueued(slot, clock, self.name)
        if self.name == COMPUTE:  # the host is the compute stream: it does the work now
            if kind == "wait":
                self.owner.run_until(op[1].finished)
            elif kind == "record":
                op[1].done = True
            elif kind == "copy":
                op[1].copy_(op[2])
            return
        self.ops.append(op)

    def wait_event(self, event: FakeEvent) -> None:
        self.enqueue(("wait", event))
        self.owner.advance()

    def synchronize(self) -> None:
        self.owner.run_until(lambda: not self.ops)
        self.owner.host = _join(self.owner.host, self.clock)

    def step(self) -> bool:
        """Run the next operation if it may run; False when the stream is empty or held by a wait."""
        if not self.ops:
            return False
        kind, *args = self.ops[0]
        if kind == "wait" and not args[0].finished():
            return False
        if kind == "copy":
            args[0].copy_(args[1])  # a blocking copy: not intercepted again
        elif kind == "record":
            args[0].done = True
        self.ops.pop(0)
        return True


class _DeferCopies(TorchFunctionMode):
    """Non-blocking copies issued on a side stream join that stream's queue instead of running now."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_ and kwargs.get("non_blocking") and DEVICE.current is not DEVICE.compute:
            DEVICE.copies += 1
            if DEVICE.copies in DEVICE.fail_copies:
                DEVICE.failed_on.append(DEVICE.current.priority)
                raise RuntimeError(f"emulated failure of copy {DEVICE.copies}")
            DEVICE.current.enqueue(("copy", args[0], args[1]))
            return args[0]
        return func(*args, **kwargs)


DEVICE: Device = None  # type: ignore[assignment]  # set by `emulate`


@contextmanager
def emulate(monkeypatch, seed: int = 0, progress: float = 0.3):
    """Within the block, `torch.cuda` streams and events are emulated and `expertflow.wrap(..., device="cpu")` gets
    a `CudaTransferEngine`; yields the `Device`, whose `hazards` list the ordering errors found."""
    global DEVICE
    DEVICE = Device(seed, progress)
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: DEVICE.current)
    monkeypatch.setattr(torch.cuda, "set_stream", lambda stream: setattr(DEVICE, "current", stream))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(runtime_module, "make_engine",
                        lambda device, bytes_per_s=None: transfer.CudaTransferEngine(torch.device("cuda", 0)))
    bank_init, bank_views = cache_module.SlotBank.__init__, cache_module.SlotBank.views

    def init(self, *args, **kwargs):
        bank_init(self, *args, **kwargs)
        DEVICE.forget_bank(self.data)

    def views(self, slot, layout_id, layout):
        DEVICE.slot_read(slot)  # what the bank hands out is read by the compute that follows
        return bank_views(self, slot, layout_id, layout)

    request = cache_module.ExpertCache.request

    def stamped_request(self, *args, **kwargs):
        """The cache's request, with each part's slots read again when the cache resumes after handing it out: the
        compute reading them has been issued by then, so a copy ordered only before that compute is caught."""
        parts = request(self, *args, **kwargs)
        bank = self.bank.data
        try:
            part = next(parts)
            while True:
                sent = yield part
                for _, handed in part:
                    view = next(iter(handed.values()))
                    DEVICE.slot_read((view.data_ptr() - bank.data_ptr()) // bank.shape[1])
                part = parts.send(sent)
        except StopIteration:
            return
        finally:
            parts.close()

    monkeypatch.setattr(cache_module.SlotBank, "__init__", init)
    monkeypatch.setattr(cache_module.SlotBank, "views", views)
    monkeypatch.setattr(cache_module.ExpertCache, "request", stamped_request)
    with _DeferCopies():
        yield DEVICE
