"""Slot bookkeeping shared by the live cache and the simulator: which expert sits in which slot, pins, readiness,
and how one layer's request for experts is served in waves.

Owns: the expert→slot table, pin counts, the free list, and the request protocol (hits, misses, waves). Does not
know: tensors, devices, transfers or time. Moving bytes is the caller's job: it is told through a `load` callback
which expert goes into which slot, and it marks the slot ready when the bytes have arrived.

Request protocol for R(step, layer) with experts E (ascending ids):
  1. every expert of E that is resident is pinned first (so serving the request never evicts its own experts);
     a need is a *hit* when the expert is resident and ready (fully loaded) when the request starts;
  2. the other experts are handled in ascending id order: each gets a slot (a free one or a policy victim among
     unpinned residents) and a load is issued; an expert already resident but still loading (an in-flight
     prefetch) is a miss that needs no second load;
  3. when no slot can be had because every slot is pinned by this request, the experts gathered so far form a
     *wave*: the caller computes it, its pins are released, and serving continues. So any capacity ≥ 1 works.
     Once a wave is ready, before it computes, the caller calls `Wave.start_next`: the next missing expert takes the
     slot of one of the wave's experts by hand-off (below), the one the policy would evict once the wave is done, so
     its copy runs while the rest of the wave computes instead of after it.

Slot hand-off: a prefetch may take the slot of an expert that the running request has pinned, once that expert is
ready (`allocate(key, handoff=True)`). The expert leaves the table at once (later requests miss on it), the running
request keeps computing from the slot's bytes, and the caller must start the copy into the slot only after that
request has computed the expert (`Allocation.busy`; callers compute handed-off experts first). So a layer's slots
are reused by later layers' experts while the layer is still computing, without waiting for the next request to
ask.
"""

from __future__ import annotations

import contextlib
import heapq
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from expertflow.policy.base import WAVE, ExpertKey, Policy, PolicyError, check_capacity

__all__ = ["SlotTable", "Allocation", "Wave", "serve_request"]


class Allocation(NamedTuple):
    """A slot given to an expert: `evicted` is the expert that held it (or None for a free slot); `busy` is True
    when `evicted` was pinned by the running request (a hand-off): the copy must wait until that request has
    computed `evicted`."""

    slot: int
    evicted: ExpertKey | None
    busy: bool = False


class SlotTable:
    """Expert ↔ slot mapping for `capacity` slots shared by all layers."""

    def __init__(self, capacity: int, policy: Policy) -> None:
        capacity = check_capacity(capacity)
        if getattr(policy, "_adopted", False):
            raise ValueError(f"policy object {policy.name!r} has already run; its state would carry over into this "
                             "run: build a fresh one with make_policy(name, capacity, num_layers, num_experts)")
        policy._adopted = True
        self.capacity = capacity
        self.policy = policy
        self._slot_of: dict[ExpertKey, int] = {}
        self._key_of: list[ExpertKey | None] = [None] * capacity
        self._pins: dict[ExpertKey, int] = {}
        self._ready: set[ExpertKey] = set()
        self._free: list[int] = list(range(capacity))  # min-heap: lowest free slot first, for determinism
        heapq.heapify(self._free)
        self._handed_off: dict[ExpertKey, int] = {}  # evicted while pinned: pins the running request still holds

    # -- queries ----------------------------------------------------------------------------------------------------
    def resident(self, key: ExpertKey) -> bool:
        return key in self._slot_of

    def ready(self, key: ExpertKey) -> bool:
        return key in self._ready

    def slot(self, key: ExpertKey) -> int:
        return self._slot_of[key]

    def key_at(self, slot: int) -> ExpertKey | None:
        return self._key_of[slot]

    def pinned(self, key: ExpertKey) -> bool:
        return self._pins.get(key, 0) > 0

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def residents(self) -> list[ExpertKey]:
        return list(self._slot_of)

    # -- mutations --------------------------------------------------------------------------------------------------
    def pin(self, key: ExpertKey) -> None:
        assert key in self._slot_of, f"pin of non-resident {key}"
        self._pins[key] = self._pins.get(key, 0) + 1

    def unpin(self, key: ExpertKey) -> None:
        if key in self._handed_off:  # the pin belonged to a slot that was handed off (see `allocate`)
            left = self._handed_off[key] - 1
            if left:
                self._handed_off[key] = left
            else:
                del self._handed_off[key]
            return
        count = self._pins[key] - 1
        if count:
            self._pins[key] = count
        else:
            del self._pins[key]

    def mark_ready(self, key: ExpertKey) -> None:
        if key in self._slot_of:
            self._ready.add(key)

    def allocate(self, key: ExpertKey, handoff: bool = False) -> Allocation | None:
        """Give `key` a slot, or None when no slot can be had (every slot pinned).

        With `handoff` (prefetches, and `Wave.start_next`) the policy may also choose a pinned expert that is ready;
        the caller must then delay the copy until the running request has computed the victim (`Allocation.busy`)."""
        assert key not in self._slot_of, f"{key} is already resident"
        evictable = self._handoff_evictable if handoff else self._evictable
        victim = self.policy.victim(key, evictable, len(self._free))
        if victim is WAVE:  # the policy wants the running request computed first
            return None
        if victim is None and not self._free:
            return None
        if victim is not None and not isinstance(victim, tuple):
            raise PolicyError(f"policy {self.policy.name!r} returned {victim!r} as the victim for {key}; return a "
                              "(layer, expert) tuple, or None to take a free slot")
        if victim is not None and not evictable(victim):
            why = "is not resident" if victim not in self._slot_of else "is pinned by the running request"
            raise PolicyError(f"policy {self.policy.name!r} chose {victim!r} to make room for {key}, but it {why}; "
                              "victim() must return a key for which evictable(key) is true, or None to take a free "
                              "slot")
        # The policy hears of the change before the table makes it: if a hook raises, the table is as it was (no
        # expert is left looking resident with no copy behind it), and the policy is told the victim stayed.
        if victim is not None:
            self.policy.on_evict(victim)
        try:
            self.policy.on_insert(key)
        except BaseException:
            if victim is not None:
                with contextlib.suppress(Exception):  # the error to report is the first one
                    self.policy.on_insert(victim)
            raise
        busy = False
        if victim is None:
            slot = heapq.heappop(self._free)
        else:
            pins = self._pins.pop(victim, 0)
            if pins:
                busy = True
                self._handed_off[victim] = self._handed_off.get(victim, 0) + pins
            slot = self._drop(victim)
        self._slot_of[key] = slot
        self._key_of[slot] = key
        return Allocation(slot, victim, busy)

    def evict(self, key: ExpertKey) -> int:
        """Remove an unpinned resident (e.g. a cancelled prefetch); returns its freed slot."""
        assert self._evictable(key), f"cannot evict {key}"
        self.policy.on_evict(key)  # first: if it raises, the table is unchanged
        slot = self._drop(key)
        heapq.heappush(self._free, slot)
        return slot

    def discard(self, key: ExpertKey) -> None:
        """Remove a resident whose slot will not be filled after all, when `evict` failed in the policy's `on_evict`:
        the table must not keep it resident with nothing copied into its slot."""
        heapq.heappush(self._free, self._drop(key))

    def _evictable(self, key: ExpertKey) -> bool:
        return key in self._slot_of and not self._pins.get(key)

    def _handoff_evictable(self, key: ExpertKey) -> bool:
        return key in self._slot_of and (not self._pins.get(key) or key in self._ready)

    def _drop(self, key: ExpertKey) -> int:
        slot = self._slot_of.pop(key)
        self._key_of[slot] = None
        self._ready.discard(key)
        return slot


@dataclass
class Wave:
    """Experts of one request that are pinned together and computed together."""

    experts: list[int] = field(default_factory=list)  # ascending within hits, then misses in handling order
    slots: list[int] = field(default_factory=list)
    loaded: list[int] = field(default_factory=list)  # experts whose load was issued while building this wave
    pending: list[int] = field(default_factory=list)  # experts resident but not ready (loads issued earlier)
    more: bool = False  # the request has experts left over for a next wave
    _start_next: Callable[[], None] | None = field(default=None, repr=False)

    def start_next(self) -> None:
        """Call once this wave's experts are ready, before it computes, when `more` is set: the request's next
        missing expert may take the slot of one of them (hand-off; the policy chooses which, as it would once the
        wave is done), so that its copy starts as soon as that expert has computed instead of after the whole wave.
        The load is issued through `load(key, slot, evicted, True)`: the caller holds the copy until the displaced
        expert has computed and computes handed-off experts first."""
        if self._start_next is not None:
            self._start_next()
            self._start_next = None


@dataclass
class RequestCounts:
    hits: int = 0
    misses: int = 0
    loads: int = 0
    waves: int = 0


def serve_request(
    table: SlotTable,
    step: int,
    layer: int,
    experts: Sequence[int],
    load: Callable[..., None],
    counts: RequestCounts | None = None,
) -> Iterator[Wave]:
    """Serve R(step, layer): yield waves; the caller computes each before resuming the generator.

    `experts` must be ascending and distinct. `load(key, slot, evicted)` is called for every load issued
    (`load(key, slot, evicted, True)` for one into a handed-off slot, see `Wave.start_next`).
    Pins are released after each wave is consumed and when the generator is closed.
    """
    policy = table.policy
    counts = counts if counts is not None else RequestCounts()
    policy.on_request(step, layer, experts)
    wave = Wave()
    pinned: list[ExpertKey] = []
    missing: list[int] = []
    early: list[ExpertKey] = []  # loaded by `Wave.start_next` into a slot of the wave computing now
    early_wave = Wave()

    def take(got: Allocation, into: Wave, keys: list[ExpertKey]) -> None:
        """Load the next missing expert into `got`'s slot, as part of `into`."""
        key = (layer, missing.pop(0))
        counts.misses += 1
        counts.loads += 1
        load(key, got.slot, got.evicted, *((True,) if got.busy else ()))
        table.pin(key)
        keys.append(key)
        into.experts.append(key[1])
        into.slots.append(got.slot)
        into.loaded.append(key[1])

    def start_next() -> None:
        got = table.allocate((layer, missing[0]), handoff=True)
        if got is not None:
            take(got, early_wave, early)

    try:  # from the first pin on: whatever raises (a policy hook, Ctrl-C), no pin is left behind
        for expert in experts:  # 1. pin what is resident; decide hits at request start
            key = (layer, expert)
            policy.on_access(key)
            if table.resident(key):
                table.pin(key)
                pinned.append(key)
                wave.experts.append(expert)
                wave.slots.append(table.slot(key))
                if table.ready(key):
                    counts.hits += 1
                else:
                    counts.misses += 1
                    wave.pending.append(expert)
            else:
                missing.append(expert)
        while missing:  # 2. load the rest, in waves when the cache is too small
            key = (layer, missing[0])
            got = table.allocate(key)
            if got is None:
                if not pinned:  # nothing of this request holds a slot, so some resident is evictable
                    raise PolicyError(f"policy {policy.name!r} returned no victim (or WAVE) for {key} while the "
                                      "request holds no slot; return a resident for which evictable(key) is true, or "
                                      "None when a slot is free")
                counts.waves += 1
                wave.more, wave._start_next = True, start_next
                yield wave
                wave._start_next = None
                for k in pinned:
                    table.unpin(k)
                pinned, wave = early[:], early_wave
                early.clear()
                early_wave = Wave()
                continue
            take(got, wave, pinned)
        if wave.experts:
            counts.waves += 1
            yield wave
    finally:
        for k in pinned + early:
            table.unpin(k)
        policy.on_request_end(step, layer, experts)
