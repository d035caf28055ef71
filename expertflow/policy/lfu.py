"""`lfu`: evict the resident expert needed least often so far (counts over the whole run, kept across evictions);
ties go to the least recently needed.

Owns: need counts, recency ticks and a heap of residents, cleaned lazily and compacted when stale entries pile
up. Does not know: slots, tensors or transfers.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from expertflow.policy.base import ExpertKey, Policy, register_policy


@register_policy
class LFUPolicy(Policy):
    """Least frequently needed first; among equals, least recently needed."""

    name = "lfu"

    def __init__(self, capacity: int, num_layers: int, num_experts: int) -> None:
        super().__init__(capacity, num_layers, num_experts)
        self._rank: dict[ExpertKey, tuple[int, int]] = {}  # key -> (need count, tick of last need)
        self._resident: set[ExpertKey] = set()
        self._heap: list[tuple[int, int, ExpertKey]] = []  # (count, last, key); stale entries skipped
        self._tick = 0

    def on_access(self, key: ExpertKey) -> None:
        self._tick += 1
        count = self._rank.get(key, (0, 0))[0] + 1
        self._rank[key] = (count, self._tick)
        if key in self._resident:
            heapq.heappush(self._heap, (count, self._tick, key))
            self._compact()

    def on_insert(self, key: ExpertKey) -> None:
        self._resident.add(key)
        heapq.heappush(self._heap, (*self._rank.get(key, (0, 0)), key))
        self._compact()

    def _compact(self) -> None:
        """Drop stale entries once they outnumber the live ones: without evictions nothing else removes them, and
        every need of a resident expert adds one. The live entries, and so every decision, stay the same."""
        if len(self._heap) > 2 * len(self._resident) + 64:
            self._heap = [(*self._rank.get(key, (0, 0)), key) for key in self._resident]
            heapq.heapify(self._heap)

    def on_evict(self, key: ExpertKey) -> None:
        self._resident.discard(key)

    def victim(self, key: ExpertKey, evictable: Callable[[ExpertKey], bool], free_slots: int) -> ExpertKey | None:
        if free_slots > 0:
            return None
        held: list[tuple[int, int, ExpertKey]] = []
        chosen = None
        while self._heap:
            entry = heapq.heappop(self._heap)
            count, last, candidate = entry
            if candidate not in self._resident or self._rank.get(candidate, (0, 0)) != (count, last):
                continue  # stale
            if evictable(candidate):
                chosen = candidate
                break
            held.append(entry)  # pinned by the current request
        for entry in held:
            heapq.heappush(self._heap, entry)
        return chosen
