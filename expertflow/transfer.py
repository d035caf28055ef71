"""Host → device copies of packed experts, with two priorities: demand (HIGH) and prefetch (LOW).

Owns: every stream, event, copy thread and host sync of the runtime. Does not know: experts, layers or policies; it
moves byte buffers into byte buffers and hands back tickets.

Two backends behind one interface:
  * `CudaTransferEngine`: copies from pinned host memory on side streams (a high-priority stream for demand loads,
    a normal one for prefetches); each copy records an event; `Ticket.wait()` makes the *compute stream* wait on that
    event only, so a layer waits for the experts it needs and nothing else. Queued low-priority copies are held on the
    host and issued a few at a time, so they can still be cancelled. Stream priority orders kernels, not copies: a
    demand copy may still wait behind the few prefetches already issued (`MAX_LOW_IN_FLIGHT`), never behind the ones
    held on the host.
  * `CpuTransferEngine`: the CPU is the "device": one copy thread serves a high and a low priority queue (a queued
    HIGH job runs before any queued LOW job; a copy in flight is never pre-empted). With `bytes_per_s` set, each
    copy occupies the emulated link for `nbytes / bytes_per_s` seconds, so overlap and stalls show up in wall time.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

__all__ = ["HIGH", "LOW", "Gate", "Ticket", "TransferEngine", "CpuTransferEngine", "CudaTransferEngine",
           "make_engine", "interrupts_deferred"]

HIGH, LOW = 0, 1
_POLL_S = 0.05  # how often a deferred Ctrl-C is looked for during a wait, and an idle copy thread rechecks its queues


class _Deferral:
    """The main thread's Ctrl-C held back by `interrupts_deferred`: `held` while it is active, `pending` once one
    came."""

    held = False
    pending = False


FORKED = ("this wrapped model came into this process through a fork, and its copy thread did not (threads do not "
          "survive a fork), so its experts cannot be loaded here. A model wrapped with device='cpu' can be unwrapped "
          "here (expertflow.unwrap(model)) and wrapped again; a forked process cannot use CUDA at all. Or wrap the "
          "model in each worker process after it starts: wrap after forking, or use multiprocessing's 'spawn' or "
          "'forkserver' start method")


def _release_deferral_in_child() -> None:
    """In a child forked while a layer held Ctrl-C back: the code that gives Python's handler back may never run there
    (a worker process started from inside a layer, or a fork from another thread, which is the child's main thread).
    Give it back now; a layer the child goes on with then ends without holding it (and gives it back again)."""
    if _Deferral.held:
        _Deferral.held = _Deferral.pending = False
        signal.signal(signal.SIGINT, signal.default_int_handler)


if hasattr(os, "register_at_fork"):  # not on Windows, which has no fork
    os.register_at_fork(after_in_child=_release_deferral_in_child)


@contextlib.contextmanager
def interrupts_deferred():
    """Hold Ctrl-C back while the main thread changes the cache's and the copy queue's state (a layer, a step's plan).
    Python raises KeyboardInterrupt between any two bytecodes of the main thread: in the middle of that bookkeeping it
    could keep a lock, lose the copy thread's wake-up, or leave an expert resident in a slot no copy fills. Held back,
    it is raised where nothing is half-done: in a wait for a copy (`raise_deferred_interrupt`), or on leaving. Only
    on the main thread under Python's own SIGINT handler; a handler of the caller's is left as it is."""
    if (_Deferral.held or threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return

    def hold(signum, frame) -> None:
        _Deferral.pending = True

    _Deferral.pending = False
    signal.signal(signal.SIGINT, hold)
    _Deferral.held = True
    try:
        yield
    finally:
        _Deferral.held = False
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if _Deferral.pending:
            _Deferral.pending = False
            raise KeyboardInterrupt


def raise_deferred_interrupt() -> None:
    """Raise the Ctrl-C `interrupts_deferred` holds, if one came: a wait for a copy is a safe place for it."""
    if _Deferral.pending and threading.current_thread() is threading.main_thread():
        _Deferral.pending = False
        raise KeyboardInterrupt


@dataclass(eq=False)
class Gate:
    """Holds copies into slots that a running computation still reads (a slot hand-off) until it is opened.

    A gated ticket is not started before `TransferEngine.open_gate`; a gated ticket at the head of its queue holds
    that queue (copies start in order, as on a copy stream). On CUDA, opening adds the event recorded after the
    computation that read the slot, so the copy also waits for it on the device."""

    opened: bool = False
    event: object = None
    opened_at: float = 0.0  # perf_counter() when opened (the emulated link's clock)


@dataclass(eq=False)
class Ticket:
    """One submitted copy. `wait()` blocks (CPU) or orders the compute stream after it (CUDA)."""

    src: torch.Tensor
    dst: torch.Tensor
    priority: int
    tag: object = None
    state: str = "queued"  # queued → running → done | failed | cancelled
    done_event: threading.Event = field(default_factory=threading.Event)
    cuda_event: object = None
    after: list | None = None  # CUDA events the copy must wait for (last compute on the slot, an older copy)
    gate: Gate | None = None  # not started before the gate opens (see `Gate`)
    submit_time: float = 0.0
    # on the emulated link's clock, not startable before this either: when a held copy ahead of it in its queue
    # stopped holding it (it was promoted past that copy, or that copy was cancelled)
    freed_time: float = 0.0
    engine: "TransferEngine | None" = None
    error: BaseException | None = None  # why a failed copy failed (raised again by `wait`)

    def wait(self) -> float:
        """Wait until the bytes are in place; returns host seconds spent waiting (the stall). Raises RuntimeError
        when the copy failed or was cancelled (its bytes will never be in place)."""
        assert self.engine is not None
        return self.engine.wait(self)

    @property
    def nbytes(self) -> int:
        return self.src.numel() * self.src.element_size()

    @property
    def startable_at(self) -> float:
        """When, on the emulated link's clock, it could start but for the link being busy."""
        return max(self.submit_time, self.freed_time, self.gate.opened_at if self.gate is not None else 0.0)


class TransferEngine:
    """Interface shared by both backends."""

    bytes_copied: int = 0
    _closed: bool = False  # set by `close`: nothing may be submitted any more
    _forked: bool = False  # set in a child process forked after the engine was made (`after_fork`)

    def submit(self, src: torch.Tensor, dst: torch.Tensor, priority: int = HIGH, tag: object = None,
               after: object = None, gate: Gate | None = None) -> Ticket:
        raise NotImplementedError

    def open_gate(self, gate: Gate, event: object = None, first: Ticket | None = None) -> None:
        """Let the copies held by `gate` start (after `event` on CUDA: the end of the computation); `first`, a queued
        LOW one of them, goes at high priority (a demand load into a handed-off slot)."""
        gate.event, gate.opened = event, True
        if first is not None:
            self.promote(first)

    def wait(self, ticket: Ticket) -> float:
        raise NotImplementedError

    def promote(self, ticket: Ticket) -> None:
        """Raise a queued LOW ticket to HIGH (a prefetch that became a demand)."""

    def is_done(self, ticket: Ticket) -> bool:
        """Whether the copy has finished (no waiting)."""
        return ticket.state == "done"

    def cancel(self, ticket: Ticket) -> bool:
        """Cancel a queued ticket; False when it already started (then it completes normally). A cancelled ticket
        never moves its bytes: `wait` on it raises."""
        return False

    def slot_released(self) -> object:
        """Called after the compute that read some slots was issued; returns what a later copy into them must wait
        for (CUDA: an event on the compute stream; nothing on the CPU, where compute has finished by then)."""
        return None

    def collect_stall(self, block: bool = False) -> float:
        """Stall seconds that `wait` could not return itself, measured since the last call (CUDA: the compute stream's
        waits on copies, timed on the device once they are over; `block` waits for the last ones)."""
        return 0.0

    def busy_time(self) -> float | None:
        """Seconds the link has spent copying so far, the running copy's part included; None where copies are not
        timed one by one (CUDA, whose two streams may also copy at once)."""
        return None

    def close(self) -> None:
        pass

    def after_fork(self) -> None:
        """In a child process forked while this engine lived: no copy is served there. The copies waiting or running
        at the fork fail with `FORKED` (a forward the child goes on with raises it instead of waiting for good), so
        does any new one; `close` still works, without waiting for the parent's copy thread or device."""
        self._forked = True

    def _fail_forked(self, tickets) -> None:
        for ticket in tickets:
            if ticket.state in ("queued", "running"):
                ticket.state, ticket.error = "failed", RuntimeError(FORKED)
                ticket.done_event = threading.Event()  # the inherited one's lock may be held by a thread not here
                ticket.done_event.set()

    def _check_open(self) -> None:
        if self._forked:
            raise RuntimeError(FORKED)
        if self._closed:
            raise RuntimeError("the transfer engine is closed (the model was unwrapped or released)")

    def _check_landing(self, ticket: Ticket) -> None:
        """Raise for a copy whose bytes will never be in place: it failed, or it was cancelled before it ran."""
        if self._forked and ticket.state != "done":
            raise RuntimeError(FORKED)
        if ticket.state == "failed":
            raise RuntimeError(f"the copy of {ticket.tag} failed: {ticket.error}") from ticket.error
        if ticket.state == "cancelled":
            why = ("; the transfer engine is closed (the model was unwrapped or released, perhaps while a forward was "
                   "still running)") if self._closed else ""
            raise RuntimeError(f"the copy of {ticket.tag} was cancelled before it ran, so its bytes are not in "
                               f"place{why}")


class CpuTransferEngine(TransferEngine):
    """A copy thread with two priority queues and an optional emulated link bandwidth."""

    def __init__(self, bytes_per_s: float | None = None) -> None:
        self.bytes_per_s = bytes_per_s
        self.bytes_copied = 0
        self.busy_s = 0.0  # seconds spent by finished copies, on the emulated link's clock when there is one
        self._running_since: float | None = None  # when the running copy started, on the same clock
        self._running_until: float | None = None  # when it ends there, once its bytes are in place
        self._running: Ticket | None = None  # the copy the thread is making
        self._link_free = 0.0  # when the emulated link finished its last copy (perf_counter clock)
        self._queues: tuple[deque[Ticket], deque[Ticket]] = (deque(), deque())
        self._cv = threading.Condition()
        self._closed = False
        self._closing = threading.Event()  # ends the emulated link's wait for the running copy at `close`
        self._thread = threading.Thread(target=self._run, name="expertflow-copy", daemon=True)
        self._thread.start()

    def submit(self, src, dst, priority=HIGH, tag=None, after=None, gate=None) -> Ticket:
        ticket = Ticket(src, dst, priority, tag, gate=gate, submit_time=time.perf_counter(), engine=self)
        with self._cv:
            self._check_open()
            self._queues[priority].append(ticket)
            self._cv.notify()
        return ticket

    def open_gate(self, gate: Gate, event: object = None, first: Ticket | None = None) -> None:
        # One step under the (reentrant) lock: the copy thread never sees the gate open with `first` still low.
        with self._cv:
            gate.opened_at = time.perf_counter()
            super().open_gate(gate, event, first)
            self._cv.notify_all()

    def promote(self, ticket: Ticket) -> None:
        with self._cv:
            if self._forked:  # nothing is served here; a copy taken off its queue at the fork is in none
                return
            if ticket.state == "queued" and ticket.priority == LOW:
                # A held copy at the head of the HIGH queue would hold every demand copy behind it.
                assert ticket.gate is None or ticket.gate.opened, "a held copy is needed before its slot was released"
                self._free_behind_held(self._queues[LOW], ticket)
                self._queues[LOW].remove(ticket)
                ticket.priority = HIGH
                self._queues[HIGH].append(ticket)
                self._cv.notify()  # the copy thread may be waiting behind a held prefetch: this one can go now

    def cancel(self, ticket: Ticket) -> bool:
        with self._cv:
            if ticket.state != "queued" or self._forked:
                return False
            queue = self._queues[ticket.priority]
            if len(queue) > 1 and queue[0] is ticket:
                self._free_behind_held(queue, queue[1])
            queue.remove(ticket)
            ticket.state = "cancelled"
            ticket.done_event.set()
            self._cv.notify()  # it may have been a held copy at the head of its queue: the ones behind it can go now
            return True

    def wait(self, ticket: Ticket) -> float:
        if self._forked:  # no thread serves the copy here: done before the fork, or never
            self._check_landing(ticket)
            return 0.0
        start = time.perf_counter()
        while not ticket.done_event.wait(_POLL_S if _Deferral.held else None):
            raise_deferred_interrupt()  # Ctrl-C during a long wait: it ends the wait, as it would without deferral
        self._check_landing(ticket)
        return time.perf_counter() - start

    def busy_time(self) -> float:
        with self._cv:
            if self._running_since is None:
                return self.busy_s
            now = time.perf_counter()  # at most the copy's end: the thread may wake a little late to count it
            now = now if self._running_until is None else min(now, self._running_until)
            return self.busy_s + max(now - self._running_since, 0.0)

    @staticmethod
    def _free_behind_held(queue: deque[Ticket], ticket: Ticket) -> None:
        """`ticket` leaves its place behind `queue`'s head (or that head leaves): if the head is a held copy, `ticket`
        could not start until now, and the link's clock must not start it earlier."""
        if queue[0] is not ticket and queue[0].gate is not None and not queue[0].gate.opened:
            ticket.freed_time = time.perf_counter()

    def _startable(self) -> deque[Ticket] | None:
        """The queue whose head may start now: HIGH first; a head whose gate is shut holds its queue. On an emulated
        link, a LOW head that could start on the link's clock before the HIGH one came goes first: a DMA engine free
        since then would have started it before this thread got the interpreter."""
        ready = [queue for queue in self._queues
                 if queue and (queue[0].gate is None or queue[0].gate.opened or self._closed)]
        if len(ready) < 2 or not self.bytes_per_s:
            return ready[0] if ready else None
        # min keeps the first of equals: HIGH when both could start as the link came free
        return min(ready, key=lambda queue: max(queue[0].startable_at, self._link_free))

    def _next(self) -> Ticket | None:
        with self._cv:
            while (queue := self._startable()) is None:
                if self._closed:
                    return None
                self._cv.wait(_POLL_S)  # timed: a wake-up lost to an interrupted notify costs no more than this
            ticket = queue.popleft()
            ticket.state = "running"
            self._running = ticket  # for a forked child (`after_fork`), where this thread will not finish it
            return ticket

    def _run(self) -> None:
        while (ticket := self._next()) is not None:
            start = time.perf_counter()
            if self.bytes_per_s:
                # On the link's clock the copy starts when it was both startable and the link was free.
                start = min(start, max(ticket.startable_at, self._link_free))
            with self._cv:
                self._running_since = start
            try:
                ticket.dst.copy_(ticket.src)
            except Exception as exc:  # hand it to whoever waits; the thread keeps serving the queue
                with self._cv:  # the link was busy while it ran: counted, as reads while it ran did
                    now = time.perf_counter()
                    self.busy_s += max(now - start, 0.0)
                    self._link_free = max(self._link_free, now)  # the next copy starts after it on the clock
                    self._running_since = self._running_until = self._running = None
                ticket.error, ticket.state = exc, "failed"
                ticket.done_event.set()
                continue
            end = time.perf_counter()
            if self.bytes_per_s:
                end = self._link_free = max(start + ticket.nbytes / self.bytes_per_s, end)
            with self._cv:
                self._running_until = end
            remaining = end - time.perf_counter()  # only an emulated link's copy has time left
            if remaining > 0 and self._closing.wait(remaining):  # its bytes are in place: `close` need not wait
                end = min(end, time.perf_counter())  # the link's time up to the close, not what it did not wait out
            with self._cv:
                self.busy_s += end - start
                # the ticket is not kept: its views hold the bank and a store layer
                self._running_since = self._running_until = self._running = None
            self.bytes_copied += ticket.nbytes
            ticket.state = "done"
            ticket.done_event.set()

    def after_fork(self) -> None:
        # The copy thread is gone; a lock it held at the fork would stay held. Its thread object counts as stopped.
        super().after_fork()
        self._cv = threading.Condition()
        self._closing = threading.Event()
        self._running_since = self._running_until = None  # the link's clock stopped with the thread
        self._fail_forked([*self._queues[HIGH], *self._queues[LOW], *([self._running] if self._running else [])])
        for queue in self._queues:
            queue.clear()

    def close(self) -> None:
        """Cancel what has not started (nobody will use it), let the running copy finish, stop the thread."""
        with self._cv:
            for queue in self._queues:
                for ticket in queue:
                    ticket.state = "cancelled"
                    ticket.done_event.set()
                queue.clear()
            self._closed = True
            self._closing.set()
            self._cv.notify_all()
        if threading.current_thread() is not self._thread:  # a model collected on the copy thread closes it too
            self._thread.join(timeout=10)


class CudaTransferEngine(TransferEngine):
    """Side-stream copies from pinned memory; events order the compute stream after the copies it needs."""

    MAX_LOW_IN_FLIGHT = 4  # prefetches issued to the stream at once; the rest wait on the host, cancellable

    def __init__(self, device: torch.device) -> None:
        # An explicit index: stream and event calls with an index-less device look the current device up each time,
        # which cost ~15% of the host time of a wrapped step on a small model.
        self.device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        self.bytes_copied = 0
        self.high_stream = torch.cuda.Stream(device=device, priority=-1)
        self.low_stream = torch.cuda.Stream(device=device, priority=0)
        self._low_queue: deque[Ticket] = deque()
        self._low_in_flight: deque[Ticket] = deque()
        self._stalls: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque()  # around each compute-stream wait
        # Reentrant: `Event.query` runs Python code, where a signal handler may run and read the counts (collecting)
        self._stalls_lock = threading.RLock()

    def after_fork(self) -> None:
        super().after_fork()
        self._stalls_lock = threading.RLock()
        self._stalls.clear()  # their events belong to the parent's CUDA context
        self._fail_forked([*self._low_queue, *self._low_in_flight])
        self._low_queue.clear()
        self._low_in_flight.clear()

    def _issue(self, ticket: Ticket) -> None:
        stream = self.high_stream if ticket.priority == HIGH else self.low_stream
        for event in ticket.after or ():
            stream.wait_event(event)
        compute = torch.cuda.current_stream(self.device)
        caller = torch.cuda.current_stream()  # on the caller's current device, which set_stream may change
        torch.cuda.set_stream(stream)  # the copy is enqueued on `stream` (cheaper than the stream context manager)
        try:
            ticket.dst.copy_(ticket.src, non_blocking=True)
        except BaseException as exc:
            ticket.state, ticket.error = "failed", exc  # `wait` raises it; the cache loads the expert again
            raise
        finally:
            torch.cuda.set_stream(compute)
            if caller.device != compute.device:  # wrapped on another GPU than the current one: give it back
                torch.cuda.set_stream(caller)
        ticket.cuda_event = torch.cuda.Event()
        ticket.cuda_event.record(stream)
        ticket.state = "running"
        self.bytes_copied += ticket.nbytes

    def _issue_gated(self, ticket: Ticket) -> None:
        if ticket.gate is not None and ticket.gate.event is not None:
            ticket.after = list(ticket.after or ()) + [ticket.gate.event]
        self._issue(ticket)

    def _pump(self) -> None:
        while self._low_in_flight and self._low_in_flight[0].cuda_event.query():
            done = self._low_in_flight.popleft()
            done.state = "done"
        while self._low_queue and len(self._low_in_flight) < self.MAX_LOW_IN_FLIGHT:
            if self._low_queue[0].gate is not None and not self._low_queue[0].gate.opened:
                break  # in order: a held copy holds the ones behind it
            ticket = self._low_queue.popleft()
            try:
                self._issue_gated(ticket)
            except Exception:  # marked failed: whoever needs it gets the error from `wait`, not an unrelated call
                continue
            self._low_in_flight.append(ticket)

    def open_gate(self, gate: Gate, event: object = None, first: Ticket | None = None) -> None:
        # `first` goes on the high-priority stream, after `event`, before the pump could issue it as a prefetch
        super().open_gate(gate, event, first)
        self._pump()

    def submit(self, src, dst, priority=HIGH, tag=None, after=None, gate=None) -> Ticket:
        self._check_open()  # the slot bank may be freed once closed: no copy may write it any more
        ticket = Ticket(src, dst, priority, tag, after=after, gate=gate, submit_time=time.perf_counter(),
                        engine=self)
        assert gate is None or priority == LOW, "a copy into a handed-off slot is queued low until its gate opens"
        if priority == HIGH:
            self._issue(ticket)
        else:
            self._low_queue.append(ticket)
        self._pump()
        return ticket

    def is_done(self, ticket: Ticket) -> bool:
        return ticket.state != "queued" and ticket.cuda_event is not None and ticket.cuda_event.query()

    def promote(self, ticket: Ticket) -> None:
        if ticket.state == "queued":
            assert ticket.gate is None or ticket.gate.opened, "a held copy is needed before its slot was released"
            self._low_queue.remove(ticket)
            ticket.priority = HIGH
            self._issue_gated(ticket)

    def cancel(self, ticket: Ticket) -> bool:
        if ticket.state != "queued":
            return False
        self._low_queue.remove(ticket)
        ticket.state = "cancelled"
        return True

    def wait(self, ticket: Ticket) -> float:
        if ticket.state == "queued":
            self.promote(ticket)
        self._check_landing(ticket)
        if not ticket.cuda_event.query():
            # No host sync: the compute stream waits on the copy's event on the device. Timing events around the
            # wait measure the stall there (`collect_stall`).
            stream = torch.cuda.current_stream(self.device)
            before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            before.record(stream)
            stream.wait_event(ticket.cuda_event)
            after.record(stream)
            with self._stalls_lock:
                self._stalls.append((before, after))
        self._pump()
        return 0.0

    def collect_stall(self, block: bool = False) -> float:
        """Seconds the compute stream waited, from the waits whose timing has landed (all of them with `block`).
        Safe to call from another thread (`expertflow.stats` while a generate runs): each pair is taken once."""
        total = 0.0
        while True:
            with self._stalls_lock:
                if not self._stalls:
                    return total
                head = self._stalls[0]
                if not (block or head[1].query()):
                    return total
                if not self._stalls or self._stalls[0] is not head:  # taken by a handler on this thread meanwhile
                    continue
                before, after = self._stalls.popleft()
            after.synchronize()
            total += before.elapsed_time(after) / 1000.0

    def slot_released(self) -> object:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self._pump()  # after every computed part: prefetches held on the host advance even when no layer misses
        return event

    def close(self) -> None:
        """Drop the prefetches still held on the host and wait for the copies already on the streams: the slot bank
        may be freed right after, and the caching allocator would hand its memory out while they still write it."""
        self._closed = True
        for ticket in self._low_queue:
            ticket.state = "cancelled"
        self._low_queue.clear()
        if not self._forked:  # in a forked child no CUDA call works, and the parent's copies are not ours to wait for
            self.high_stream.synchronize()
            self.low_stream.synchronize()
        # Landed, as `_pump` would find them. Each one's dst and src are views of the whole slot bank and of a whole
        # store buffer: held here, they would keep both allocated for as long as anything still holds the engine.
        for ticket in self._low_in_flight:
            ticket.state = "done"
        self._low_in_flight.clear()


def make_engine(device: torch.device, bytes_per_s: float | None = None) -> TransferEngine:
    """The backend for a compute device."""
    if device.type == "cuda":
        return CudaTransferEngine(device)
    return CpuTransferEngine(bytes_per_s)
