"""Counters of the offloading runtime, readable by the user through `expertflow.stats(model)`.

Owns: the Stats dataclass and its invariants (hits + misses == needs). Does not know: how the counts are produced.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["Stats", "LayerStats"]


@dataclass
class LayerStats:
    needs: int = 0
    hits: int = 0
    misses: int = 0
    loads: int = 0


@dataclass
class Stats:
    """What the expert cache did since `wrap` (or the last `reset`; a prefetch issued before a reset is not counted
    after it, whether it is then used, wasted or cancelled).

    needs: expert uses requested by MoE layers (one per distinct expert per layer call);
    hits / misses: needs whose expert was / was not resident and fully loaded when the layer asked;
    loads: host→device expert copies issued (demand + prefetch), a copy cancelled before it ran (a prefetch, or a
        demand load that an interrupted request left queued) and a copy that failed included (neither moves bytes);
        on_demand_loads: loads issued because of a miss;
    prefetches / prefetch_hits: low-priority loads issued / later used; wasted_prefetches: evicted or cancelled unused;
    cancelled_prefetches: prefetches whose queued copy was cancelled before it ran (they count in `loads`,
        `prefetches` and `wasted_prefetches`, not in `bytes_to_device`);
    bytes_to_device: bytes copied host→device; evictions: experts that lost their slot;
    stall_s: seconds compute waited for copies (CPU device: host waits; CUDA: the compute stream's waits, timed on
        the device with events);
    link_busy_s: seconds the host→device link has spent copying, up to the moment it is read (CPU device: the copy
        thread's copies, the running one's part included, on the emulated link's clock when `link_bandwidth` is set;
        None on CUDA, where copies are not timed one by one); beside the wall time it shows how long the link sat
        idle;
    prefetch_precision = prefetch_hits / prefetches; on_demand_rate = on_demand_loads / needs (the "fallback" rate);
    async_load_fraction: the share of the copies that ran which were prefetches, (prefetches - cancelled_prefetches)
        / (loads - cancelled_prefetches) (a cancelled prefetch moved nothing; failed copies and the demand loads of an
        interrupted request that were cancelled still count below the line); wasted_prefetch_bytes: bytes of the
        wasted prefetches that were actually copied (a cancelled one moved none);
    slots_per_layer: resident experts per MoE layer at the start of each step (the last 4096 steps);
    predictor_s: seconds spent in the route predictor;
    waves: layer calls split because the needed experts exceeded the free slots or the policy answered `WAVE`; steps /
    tokens: forward calls and token positions the MoE layers processed (padding included, as the layers compute it);
    per_layer: needs, hits, misses and loads per MoE layer (`LayerStats`).

    `print(stats)` shows the totals and the derived rates on one line; `as_dict()` has everything, the per-layer rows
    and the `slots_per_layer` history included. Pickling or `copy.deepcopy` gives what `copy()` does: a snapshot
    (`link_busy_s` frozen at that moment), without the live object's lock, link clock and stall collector.
    """

    needs: int = 0
    hits: int = 0
    misses: int = 0
    loads: int = 0
    prefetches: int = 0
    prefetch_hits: int = 0
    wasted_prefetches: int = 0
    cancelled_prefetches: int = 0
    on_demand_loads: int = 0
    bytes_to_device: int = 0
    evictions: int = 0
    stall_s: float = 0.0
    waves: int = 0
    steps: int = 0
    tokens: int = 0
    predictor_s: float = 0.0
    wasted_prefetch_bytes: int = 0
    per_layer: list[LayerStats] = field(default_factory=list)
    slots_per_layer: list[list[int]] = field(default_factory=list)  # resident experts per layer at each step start

    def __post_init__(self) -> None:
        self._link_clock: Callable[[], float] | None = None  # the link's busy time since it started (`time_link`)
        self._link_mark = 0.0  # the clock's reading at the last reset
        self._link_frozen: float | None = None  # a snapshot's value (`copy`)
        self.resets = 0  # how many times `reset` was called: a copy issued before a reset is counted before it
        # Held by `reset` and by the counting code around each group of related counts, so that a reset from another
        # thread lands between two groups, never inside one; `expertflow.stats` may add device waits from another
        # thread. Reentrant: a signal handler runs on the counting thread, and may read or reset the counts
        self.lock = threading.RLock()
        self._pending_stalls: Callable[[bool], float] | None = None  # device waits still being timed (`time_stalls`)

    def add_stall(self, seconds: float) -> None:
        with self.lock:
            self.stall_s += seconds

    def time_stalls(self, collect: Callable[[bool], float]) -> None:
        """Device waits are timed late (CUDA events): `collect(block)` gives the seconds of those whose timing has
        landed. `reset` collects them all first and drops them, as they belong before it."""
        self._pending_stalls = collect

    def time_link(self, clock: Callable[[], float]) -> None:
        """Read `link_busy_s` from `clock` (seconds the link has been busy since it started), from now on."""
        self._link_clock, self._link_mark = clock, clock()

    @property
    def link_busy_s(self) -> float | None:
        if self._link_clock is None:
            return self._link_frozen
        return self._link_clock() - self._link_mark

    @property
    def hit_rate(self) -> float:
        return self.hits / self.needs if self.needs else 0.0

    @property
    def prefetch_precision(self) -> float:
        return self.prefetch_hits / self.prefetches if self.prefetches else 0.0

    @property
    def on_demand_rate(self) -> float:
        return self.on_demand_loads / self.needs if self.needs else 0.0

    @property
    def loads_per_token(self) -> float:
        return self.loads / self.tokens if self.tokens else 0.0

    @property
    def async_load_fraction(self) -> float:
        """Share of the copies that ran which were issued ahead of need (prefetches) rather than on a miss; a
        prefetch cancelled before its copy ran moved nothing and counts on neither side (a failed copy, or a demand
        load that an interrupted request left queued and that was then cancelled, counts as one that ran)."""
        ran = self.loads - self.cancelled_prefetches
        return (self.prefetches - self.cancelled_prefetches) / ran if ran > 0 else 0.0

    def __repr__(self) -> str:
        """The totals and the derived rates, not the per-layer rows or the per-step history (`as_dict` has them): a
        few hundred characters however long the model ran."""
        with self.lock:  # between two groups of related counts
            return self._repr()

    __str__ = __repr__

    def _repr(self) -> str:
        link = self.link_busy_s
        parts = [f"needs={self.needs}", f"hits={self.hits}", f"misses={self.misses}", f"hit_rate={self.hit_rate:.3f}",
                 f"loads={self.loads}", f"on_demand_loads={self.on_demand_loads}",
                 f"on_demand_rate={self.on_demand_rate:.3f}", f"prefetches={self.prefetches}",
                 f"prefetch_hits={self.prefetch_hits}", f"prefetch_precision={self.prefetch_precision:.3f}",
                 f"wasted_prefetches={self.wasted_prefetches}", f"cancelled_prefetches={self.cancelled_prefetches}",
                 f"wasted_prefetch_bytes={self.wasted_prefetch_bytes}",
                 f"async_load_fraction={self.async_load_fraction:.3f}", f"bytes_to_device={self.bytes_to_device}",
                 f"evictions={self.evictions}", f"stall_s={self.stall_s:.3f}",
                 f"link_busy_s={'None' if link is None else f'{link:.3f}'}", f"waves={self.waves}",
                 f"steps={self.steps}", f"tokens={self.tokens}", f"loads_per_token={self.loads_per_token:.2f}",
                 f"predictor_s={self.predictor_s:.3f}", f"layers={len(self.per_layer)}"]
        return f"Stats({', '.join(parts)})"

    def as_dict(self) -> dict:
        # field by field: dataclasses.asdict deep-copies recursively, ~16 ms for a few thousand steps of history
        with self.lock:  # between two groups of related counts
            out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
            out["per_layer"] = [dataclasses.asdict(layer) for layer in self.per_layer]
            out["slots_per_layer"] = [list(row) for row in self.slots_per_layer]
            for name in ("link_busy_s", "hit_rate", "prefetch_precision", "on_demand_rate", "loads_per_token",
                         "async_load_fraction"):
                out[name] = getattr(self, name)
        return out

    def reset(self) -> None:
        """Zero every counter. Safe while the model runs in another thread: a step running meanwhile is counted partly
        before the reset, partly after, each group of related counts (a load, a layer's needs) wholly on one side."""
        if self._pending_stalls is not None:
            self._pending_stalls(True)  # waits before the reset: not counted after it
        with self.lock:
            # the rows replaced in one step: a reader from another thread is never left an empty list to index
            self.per_layer = [LayerStats() for _ in self.per_layer]
            for f in dataclasses.fields(self):
                if f.name != "per_layer":
                    setattr(self, f.name, f.default_factory() if f.default_factory is not dataclasses.MISSING
                            else f.default)
            if self._link_clock is not None:
                self._link_mark = self._link_clock()
            elif self._link_frozen is not None:
                self._link_frozen = 0.0
            self.resets += 1

    def copy(self) -> "Stats":
        """A snapshot: later counting does not change it (taken between two groups of related counts)."""
        with self.lock:
            snapshot = dataclasses.replace(self, per_layer=[dataclasses.replace(p) for p in self.per_layer],
                                           slots_per_layer=[list(row) for row in self.slots_per_layer])
            snapshot._link_frozen = self.link_busy_s
        return snapshot

    def __getstate__(self) -> dict:
        """What pickle and `copy.deepcopy` keep: the counts and `link_busy_s` as `copy()` freezes it; not the lock,
        the link clock or the stall collector, which belong to the live runtime."""
        snapshot = self.copy()  # between two groups of related counts, rows copied
        state = {f.name: getattr(snapshot, f.name) for f in dataclasses.fields(snapshot)}
        state["_link_frozen"] = snapshot.link_busy_s
        return state

    def __setstate__(self, state: dict) -> None:
        self.__post_init__()  # a lock of its own, no clock, no collector
        self.__dict__.update(state)
