"""The expert cache: a bank of device slots shared by all MoE layers, filled from the host store on demand.

Owns: the slot bank tensor and its typed views, the slot table (via `expertflow.slots`), in-flight copy tickets, and
the cache counters in `Stats`. Does not know: Hugging Face models or how experts compute. It asks a policy which
expert to evict and the transfer engine to move bytes; the compute path receives slot views, never host tensors.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence

import torch

from expertflow.policy.base import ExpertKey, Policy, policy_keys
from expertflow.slots import RequestCounts, SlotTable, serve_request
from expertflow.counters import LayerStats, Stats
from expertflow.store import ExpertStore
from expertflow.transfer import HIGH, LOW, Gate, Ticket, TransferEngine

__all__ = ["SlotBank", "ExpertCache"]

logger = logging.getLogger(__name__)


class SlotBank:
    """uint8 `[num_slots, slot_bytes]` on the compute device, with cached typed views per (slot, layout)."""

    def __init__(self, num_slots: int, slot_bytes: int, device: torch.device) -> None:
        self.data = torch.zeros(num_slots, slot_bytes, dtype=torch.uint8, device=device)
        self._views: dict[tuple[int, int], dict[str, torch.Tensor]] = {}

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def views(self, slot: int, layout_id: int, layout) -> dict[str, torch.Tensor]:
        key = (slot, layout_id)
        if key not in self._views:
            # Kept for the whole wrap: made under a caller's inference mode they would be inference tensors, which
            # a later forward with autograd on may not use
            with torch.inference_mode(False):
                self._views[key] = layout.views(self.data[slot])
        return self._views[key]


def _unissued(ticket: Ticket | None) -> bool:
    """Whether `ticket`'s copy never moved its bytes and never will: cancelled, or failed to issue."""
    return ticket is not None and ticket.state in ("cancelled", "failed")


class ExpertCache:
    """Serves each MoE layer's request for experts from device slots, loading misses from the host store."""

    def __init__(self, store: ExpertStore, num_slots: int, policy: Policy, device: torch.device,
                 engine: TransferEngine, stats: Stats) -> None:
        self.store = store
        self.device = device
        self.engine = engine
        self.stats = stats
        self.bank = SlotBank(num_slots, store.slot_bytes, device)
        self.table = SlotTable(num_slots, policy)
        self._tickets: dict[ExpertKey, Ticket] = {}
        # Loaded by prefetch and not used yet, and each expert's last copy → `Stats.resets` when issued: a copy from
        # before a reset is not counted after it (as used, wasted or cancelled)
        self._prefetched: dict[ExpertKey, int] = {}
        self._issued_in: dict[ExpertKey, int] = {}
        # slot → events a copy into it must wait for (CUDA): the last compute that read it, and an older copy into it
        # that may still be landing (kept when the copy that waited for it is cancelled). At first the bank's
        # zero-fill, issued on the compute stream, which no copy on a side stream may overtake.
        filled = engine.slot_released()
        self._slot_after: dict[int, list] = {} if filled is None else {slot: [filled] for slot in range(num_slots)}
        self._gates: dict[int, Gate] = {}  # expert of the running request → gate of the copy into its handed-off slot
        self._early: dict[int, ExpertKey] = {}  # such an expert → the demand load into its slot (`Wave.start_next`)
        self._warned: set[str] = set()  # kinds of failed copies ("prefetch", "demand load") logged as a warning
        if not stats.per_layer:
            stats.per_layer = [LayerStats() for _ in range(store.num_layers)]

    @property
    def num_slots(self) -> int:
        return self.table.capacity

    def forget_copies(self) -> None:
        """Drop the tickets of copies never awaited, once the engine is closed (nothing waits for them any more): each
        holds a view of its store layer."""
        self._tickets.clear()
        self._gates.clear()
        self._early.clear()

    @property
    def policy(self) -> Policy:
        return self.table.policy

    def _copy(self, key: ExpertKey, slot: int, evicted: ExpertKey | None, priority: int,
              gate: Gate | None = None, prefetch: bool = False) -> None:
        stale = None
        after = list(self._slot_after.get(slot, ()))  # what a copy into the slot must wait for
        try:
            if evicted is not None:
                stale = self._tickets.pop(evicted, None)
                if stale is not None and stale.gate is not None and not stale.gate.opened:
                    gate = stale.gate  # a slot the running request still reads: the new copy waits as the old did
                if self._leaves(evicted, stale) or _unissued(stale):
                    after += [e for e in stale.after or () if e not in after]  # what it waited for still holds
                elif stale is not None and stale.cuda_event is not None:
                    after.append(stale.cuda_event)  # the old copy into this slot must land before the new one
            src = self.store.expert_bytes(*key)
            ticket = self.engine.submit(src, self.bank.data[slot], priority, tag=key, after=after, gate=gate)
        except BaseException:
            try:
                if stale is not None:  # the evicted expert's copy, no longer tracked
                    if stale.state == "queued":  # `_leaves` did not get to cancel it: it would land over the slot's
                        self.engine.cancel(stale)  # next occupant
                    # The next copy into the slot waits for what this one would have: the evicted copy if it may
                    # still be landing, else what that copy waited for (an older copy still running, on CUDA)
                    held = list(stale.after or ()) if _unissued(stale) else [stale.cuda_event]
                    after += [e for e in held if e is not None and e not in after]
                if after:
                    self._slot_after[slot] = after
            finally:
                self._not_resident(key)  # nothing will fill the slot
            raise
        self._tickets[key] = ticket
        s = self.stats
        with s.lock:  # one group: a reset from another thread counts this load wholly before or wholly after it
            self._issued_in[key] = s.resets
            s.loads += 1
            s.bytes_to_device += ticket.nbytes
            s.per_layer[key[0]].loads += 1
            if prefetch:
                self._prefetched[key] = s.resets
                s.prefetches += 1
            else:
                s.on_demand_loads += 1

    def _not_resident(self, key: ExpertKey) -> None:
        """`key`'s slot holds no copy of it after all: out of the table, even if the policy's `on_evict` raises (the
        expert must not look resident, or a hit would compute from the slot's other bytes)."""
        try:
            self.table.evict(key)
        finally:
            if self.table.resident(key):
                self.table.discard(key)

    def _demand_load(self, key: ExpertKey, slot: int, evicted: ExpertKey | None, busy: bool = False) -> None:
        if busy:  # into the slot of an expert of the wave about to compute (`Wave.start_next`): held until it has
            # computed, queued with the prefetches meanwhile, and raised to high priority once it may go
            gate = self._gates[evicted[1]] = Gate()
            self._early[evicted[1]] = key
            self._copy(key, slot, evicted, LOW, gate)
        else:
            self._copy(key, slot, evicted, HIGH)

    def prefetch(self, keys: Sequence[ExpertKey]) -> int:
        """Issue low-priority loads for experts not yet resident; returns how many were issued.

        A prefetch may take a slot that the running request still reads (hand-off, see `expertflow.slots`): its
        copy is held by a gate, which opens once the request has computed the expert it displaced (handed-off
        experts are computed first, in the order of their copies, see `_handed_off_first`)."""
        issued = 0
        for key in policy_keys(self.policy, keys, "prefetches", self.store.num_layers, self.store.num_experts,
                               "the model"):
            if self.table.resident(key):
                continue
            got = self.table.allocate(key, handoff=True)
            if got is None:
                break
            gate = None
            if got.busy:  # only while a request runs (it holds the pins); see `_handed_off_first`
                gate = self._gates[got.evicted[1]] = Gate()
            self._copy(key, got.slot, got.evicted, LOW, gate, prefetch=True)
            issued += 1
        return issued

    def cancel(self, keys: Sequence[ExpertKey]) -> None:
        """Drop prefetches the policy no longer wants, if their copy has not finished and nobody uses them."""
        for key in policy_keys(self.policy, keys, "cancellations", self.store.num_layers, self.store.num_experts,
                               "the model"):
            ticket = self._tickets.get(key)
            if ticket is None or self.engine.is_done(ticket) or self.table.pinned(key) or not self.table.resident(key):
                continue
            slot = self.table.evict(key)
            del self._tickets[key]
            if self._leaves(key, ticket) or _unissued(ticket):
                self._keep_waits(slot, ticket)
            elif ticket.cuda_event is not None:
                self._slot_after[slot] = [ticket.cuda_event]  # the running copy still writes this slot

    def _keep_waits(self, slot: int, ticket: Ticket) -> None:
        """`ticket`'s copy into `slot` never moved its bytes (cancelled, or it failed to issue): the slot's next copy
        still waits for what it waited for (on CUDA, an older copy into the slot that may still be landing)."""
        kept = self._slot_after.get(slot, [])
        extra = [e for e in ticket.after or () if e not in kept]
        if extra:
            self._slot_after[slot] = kept + extra

    def _leaves(self, key: ExpertKey, ticket: Ticket | None) -> bool:
        """`key` leaves its slot; `ticket` is its copy if nobody has awaited it yet. Cancels the copy if it has not
        started and counts what left (the eviction; what was issued since the last reset); returns whether it was
        cancelled."""
        failed = ticket is not None and ticket.state == "failed"
        cancelled = not failed and ticket is not None and self.engine.cancel(ticket)
        prefetched = None if failed else self._prefetched.pop(key, None)
        s = self.stats
        with s.lock:  # one group, as in `_copy`
            s.evictions += 1
            if cancelled and self._issued_in.get(key) == s.resets:
                # It never moves its bytes: a prefetch, or a demand load left queued by an interrupted request
                s.bytes_to_device -= ticket.nbytes
            if prefetched == s.resets:  # a prefetch that leaves unused is wasted
                s.wasted_prefetches += 1
                if cancelled:
                    s.cancelled_prefetches += 1
                else:  # its copy has run, or runs to the end (a started copy is never stopped): bytes moved for nothing
                    s.wasted_prefetch_bytes += self.store.slot_bytes
        if failed:
            self._failed(key, ticket)
        return cancelled

    def _failed(self, key: ExpertKey, ticket: Ticket) -> None:
        """The copy of `key` failed: it moved no bytes, and a prefetch whose copy failed is neither used nor wasted.
        Whoever waited for it got the error; a prefetch's error would go unseen, so it is logged."""
        with self.stats.lock:
            if self._issued_in.get(key) == self.stats.resets:
                self.stats.bytes_to_device -= ticket.nbytes
        kind = "prefetch" if self._prefetched.pop(key, None) is not None else "demand load"
        if kind in self._warned:
            logger.debug("the %s of expert %s failed: %s", kind, key, ticket.error)
            return
        self._warned.add(kind)
        logger.warning("the %s of expert %s failed: %s; the expert is loaded again when it is needed (later failures "
                       "of this kind are logged at DEBUG level)", kind, key, ticket.error)

    def occupancy(self) -> list[int]:
        """How many slots each layer holds now."""
        counts = [0] * self.store.num_layers
        for layer, _ in self.table.residents():
            counts[layer] += 1
        return counts

    def snapshot_occupancy(self, limit: int = 4096, counts: list[int] | None = None) -> None:
        """Record `counts` (by default how many slots each layer holds now) for `Stats.slots_per_layer`."""
        history = self.stats.slots_per_layer
        history.append(self.occupancy() if counts is None else counts)
        if len(history) > limit:
            del history[: len(history) - limit]

    def request(self, step: int, layer: int, experts: Sequence[int],
                upcoming: tuple[int, int] | None = None) -> Iterator[list[tuple[int, dict]]]:
        """Yield waves of `(expert, tensor views in its slot)`, ready to compute; `experts` ascending, distinct.

        `upcoming` = (step, layer) of the next request: the policy's prefetches for it are issued once this
        request's last wave has its slots and its copies have been waited for, before it computes (the simulator
        does the same), so that they may take the slots of experts this request reads (hand-off). The experts whose
        slots were handed off are then yielded first, one at a time, and the copy into each one's slot may start as
        soon as it is computed.
        """
        counts = RequestCounts()
        layout = self.store.layouts[layer]
        for expert in experts:  # an expert whose copy has finished is ready: a hit
            key = (layer, expert)
            self._poll(key)
            if key not in self._tickets:
                self._used(key)  # resident (a prefetch still loading counts once its bytes are in place: `_await`)
        for expert in experts:  # every queued prefetch this request needs jumps the queue now, as in the simulator
            ticket = self._tickets.get((layer, expert))
            if ticket is not None:
                self.engine.promote(ticket)
        server = serve_request(self.table, step, layer, experts, self._demand_load, counts)
        reading: list[int] = []  # slots of the part being computed
        try:
            served = 0
            for wave in server:
                served += len(wave.experts)
                for expert in wave.experts:
                    self._await((layer, expert))
                if served == len(experts) and upcoming is not None:  # ready now: its slots may be handed off
                    self.prefetch(self.policy.prefetches(*upcoming))
                elif wave.more:  # ready now: the next wave's first expert may take one of its slots
                    wave.start_next()
                for part in self._handed_off_first(wave):
                    reading = [s for _, s in part]
                    yield [(e, self.bank.views(s, layer, layout)) for e, s in part]
                    reading = []
                    after = self.engine.slot_released()  # one event for the part just computed
                    for expert, slot in part:
                        if after is not None:
                            self._slot_after[slot] = [after]
                        if expert in self._gates:  # computed: the copy into its slot may go (after `after`)
                            early = self._tickets.get(self._early.get(expert))  # a demand load: it goes first
                            self.engine.open_gate(self._gates[expert], after, early)  # then forgotten: an error
                            del self._gates[expert]  # in between leaves it to be opened when the request ends
                            self._early.pop(expert, None)
            if not experts and upcoming is not None:
                self.prefetch(self.policy.prefetches(*upcoming))
        finally:
            server.close()  # cut short (an error, Ctrl-C, `close()`): unpin now, not when a traceback is freed
            if self._gates or reading:  # cut short: copies into these slots go after what was launched
                after = self.engine.slot_released()
                for slot in reading:
                    if after is not None:
                        self._slot_after[slot] = [after]
                for gate in self._gates.values():
                    self.engine.open_gate(gate, after)
                self._gates.clear()
                self._early.clear()
            self._count(layer, counts.hits + counts.misses, counts)  # = len(experts) unless cut short
            self.stats.add_stall(self.engine.collect_stall())

    def _handed_off_first(self, wave) -> list[list[tuple[int, int]]]:
        """The wave's (expert, slot) pairs as parts to compute in turn: each expert whose slot a prefetch took, alone
        and in the order of the copies (a held copy holds the prefetch queue), then all the others. So the copies
        start while the rest of the layer computes."""
        slot_of = dict(zip(wave.experts, wave.slots))
        first = [[(e, slot_of[e])] for e in self._gates if e in slot_of]
        rest = [(e, s) for e, s in slot_of.items() if e not in self._gates]
        return first + ([rest] if rest else [])

    def _used(self, key: ExpertKey) -> None:
        issued = self._prefetched.pop(key, None)
        if issued is not None:  # a prefetched expert is used
            with self.stats.lock:
                if issued == self.stats.resets:
                    self.stats.prefetch_hits += 1

    def _poll(self, key: ExpertKey) -> None:
        ticket = self._tickets.get(key)
        if ticket is not None and ticket.state == "failed":
            del self._tickets[key]
            self._keep_waits(self.table.slot(key), ticket)
            self._not_resident(key)  # the next need loads it again
            self._failed(key, ticket)
            return
        if ticket is not None and self.engine.is_done(ticket):
            del self._tickets[key]
            self.table.mark_ready(key)

    def _await(self, key: ExpertKey) -> None:
        ticket = self._tickets.get(key)
        if ticket is not None:
            self.engine.promote(ticket)  # a queued prefetch that is needed now jumps the queue
            # The ticket is dropped only once its bytes are in place: if the wait raises (a failed copy, Ctrl-C),
            # the next request finds it again and waits for it, or loads the expert again.
            self.stats.add_stall(ticket.wait())
            del self._tickets[key]
            if ticket.cuda_event is not None:  # on CUDA the wait is the compute stream's: until the slot's part has
                # computed (its release event, recorded after that wait), the next copy into the slot goes after this
                # one, or a request cut short before that part would let it land first from the other stream
                self._slot_after[self.table.slot(key)] = [ticket.cuda_event]
            self.table.mark_ready(key)
            self._used(key)

    def _count(self, layer: int, needs: int, counts: RequestCounts) -> None:
        s = self.stats
        with s.lock:  # one group, as in `_copy`
            per = s.per_layer[layer]
            s.needs += needs
            s.hits += counts.hits
            s.misses += counts.misses
            s.waves += max(counts.waves - 1, 0)
            per.needs += needs
            per.hits += counts.hits
            per.misses += counts.misses
