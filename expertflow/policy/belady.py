"""`belady`: demand-only MIN, the offline optimum for pinned requests. Evict the resident expert whose next need lies
furthest in the future (never needed again counts as infinitely far; ties go to the smallest (layer, expert) key).

Owns: the next-need index of every resident expert. Does not know: slots or timing. It needs the whole future need
sequence, so only the simulator can run it: `make_policy("belady", C, L, E, future=needs)` where `needs` lists every
expert key in the order the requests access them (requests in (step, layer) order, experts ascending in each).

Its loads are the minimum for policies that keep each request's experts resident until the request ends: every
request fits in the cache, no request is served in waves and no prefetch takes a computed expert's slot. A policy
that uses either (waves, or the simulator's slot hand-off) may load less, even when every request fits; only
`sim.loads_lower_bound` bounds those. When one request needs more experts than there are slots it is served in
waves itself, and its own later waves force evictions this rule does not plan for.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

from expertflow.policy.base import ExpertKey, Policy, register_policy

_NEVER = 1 << 62


@register_policy
class BeladyPolicy(Policy):
    """Furthest next need first. Its loads are the fewest of any policy that keeps each request's experts pinned."""

    name = "belady"
    needs_future = True

    def __init__(self, capacity: int, num_layers: int, num_experts: int,
                 future: Sequence[ExpertKey] | None = None) -> None:
        super().__init__(capacity, num_layers, num_experts)
        if future is None:
            raise ValueError("belady is an offline oracle: it needs `future=` (the whole need sequence); "
                             "use it in the simulator (`expertflow simulate`), not in the live runtime")
        self._future = list(future)
        self._next_at = _next_occurrences(self._future)
        self._pos = 0
        self._next: dict[ExpertKey, int] = {}
        self._resident: set[ExpertKey] = set()
        self._heap: list[tuple[int, ExpertKey]] = []  # (-next need, key), stale entries skipped lazily

    def on_access(self, key: ExpertKey) -> None:
        if self._pos >= len(self._future) or self._future[self._pos] != key:
            raise ValueError(f"belady was given a future that differs from the requests served: need #{self._pos} "
                             f"is {key}, the future says "
                             f"{self._future[self._pos] if self._pos < len(self._future) else 'nothing'}")
        self._next[key] = self._next_at[self._pos]
        self._pos += 1
        if key in self._resident:
            heapq.heappush(self._heap, (-self._next[key], key))

    def on_insert(self, key: ExpertKey) -> None:
        self._resident.add(key)
        heapq.heappush(self._heap, (-self._next.get(key, _NEVER), key))

    def on_evict(self, key: ExpertKey) -> None:
        self._resident.discard(key)

    def victim(self, key: ExpertKey, evictable: Callable[[ExpertKey], bool], free_slots: int) -> ExpertKey | None:
        if free_slots > 0:
            return None
        chosen, held = self._furthest_evictable(evictable)
        for entry in held:
            heapq.heappush(self._heap, entry)
        return chosen

    def _furthest_evictable(self, evictable: Callable[[ExpertKey], bool]
                            ) -> tuple[ExpertKey | None, list[tuple[int, ExpertKey]]]:
        """Pop the heap down to the evictable resident needed furthest ahead: (it or None, the valid entries popped
        before it, all pinned, furthest first). The caller pushes back what should stay; stale entries are dropped."""
        held: list[tuple[int, ExpertKey]] = []
        while self._heap:
            entry = heapq.heappop(self._heap)
            neg_next, candidate = entry
            if candidate not in self._resident or -neg_next != self._next.get(candidate, _NEVER):
                continue  # stale
            if evictable(candidate):
                return candidate, held
            held.append(entry)  # pinned now; keep it for later decisions
        return None, held


def _next_occurrences(future: Sequence[ExpertKey]) -> list[int]:
    """For each position i, the next position j > i holding the same key (or _NEVER)."""
    next_at = [_NEVER] * len(future)
    seen: dict[ExpertKey, int] = {}
    for i in range(len(future) - 1, -1, -1):
        next_at[i] = seen.get(future[i], _NEVER)
        seen[future[i]] = i
    return next_at
