"""Shared base of the simple prefetching policies (`lookahead`, `prev-step`): LRU eviction plus a guarded way to
offer prefetch keys.

Owns: the rule for where a prefetch may go. Prefetches target the very next request, the soonest any expert can
be needed again. So a prefetch takes a free slot, or evicts the least recently used evictable expert that is not
itself among the keys being prefetched: by the prediction, that victim is not needed sooner than the prefetched
expert. That may be one of the running request's experts once it is in place (slot hand-off, `expertflow.slots`):
the copy then waits until the request has computed it. When no slot qualifies the policy answers None and the caller
drops the prefetch. Does not know: slots, timing or transfers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from expertflow.policy.base import ExpertKey
from expertflow.policy.lru import LRUPolicy

__all__ = ["PrefetchingLRU"]


class PrefetchingLRU(LRUPolicy):
    """LRU with prefetches. Subclasses compute keys and return `self._offer(keys)` from `prefetches`."""

    name = "prefetching-lru-base"  # not registered

    def __init__(self, capacity: int, num_layers: int, num_experts: int) -> None:
        super().__init__(capacity, num_layers, num_experts)
        self._targets: set[ExpertKey] = set()

    def _offer(self, keys: Iterable[ExpertKey]) -> list[ExpertKey]:
        """Remember the keys being prefetched (their allocations use the prefetch rule) and return them."""
        offered = list(dict.fromkeys(keys))
        self._targets = set(offered)
        return offered

    def on_request(self, step: int, layer: int, experts) -> None:
        self._targets = set()  # demand serving starts: later allocations are demand loads

    def victim(self, key: ExpertKey, evictable: Callable[[ExpertKey], bool], free_slots: int) -> ExpertKey | None:
        if key not in self._targets:
            return super().victim(key, evictable, free_slots)
        if free_slots > 0:
            return None
        return self._oldest(lambda k: k not in self._targets and evictable(k))
