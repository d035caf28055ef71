"""Recency policies: `lru` (one global recency order over all layers) and `lru-layer` (a fixed equal share of the
slots per layer, each managed LRU: the mixtral-offloading / "Cache-MoE" baseline).

Owns: recency order and per-layer quotas. Does not know: slots, tensors or transfers.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from expertflow.policy.base import ExpertKey, Policy, register_policy


@register_policy
class LRUPolicy(Policy):
    """Evict the least recently needed evictable expert, over all layers."""

    name = "lru"

    def __init__(self, capacity: int, num_layers: int, num_experts: int) -> None:
        super().__init__(capacity, num_layers, num_experts)
        self._order: OrderedDict[ExpertKey, None] = OrderedDict()  # least recent first

    def on_access(self, key: ExpertKey) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def on_insert(self, key: ExpertKey) -> None:
        if key not in self._order:  # a prefetched expert, not needed yet, enters as most recent: evictable too
            self._order[key] = None

    def on_evict(self, key: ExpertKey) -> None:
        self._order.pop(key, None)

    def _oldest(self, evictable: Callable[[ExpertKey], bool], layer: int | None = None) -> ExpertKey | None:
        for key in self._order:
            if (layer is None or key[0] == layer) and evictable(key):
                return key
        return None

    def victim(self, key: ExpertKey, evictable: Callable[[ExpertKey], bool], free_slots: int) -> ExpertKey | None:
        if free_slots > 0:
            return None
        return self._oldest(evictable)


@register_policy
class LayerLRUPolicy(LRUPolicy):
    """Each layer owns `capacity // L` slots (the first `capacity % L` layers one more) and evicts its own LRU expert.

    When the cache is smaller than the number of layers some quotas are zero; such a layer borrows a free slot or,
    failing that, evicts the globally least recent evictable expert, so that any capacity down to one slot works.
    """

    name = "lru-layer"

    def __init__(self, capacity: int, num_layers: int, num_experts: int) -> None:
        super().__init__(capacity, num_layers, num_experts)
        base, extra = divmod(capacity, max(num_layers, 1))
        self.quota = [base + (1 if layer < extra else 0) for layer in range(num_layers)]
        self._count = [0] * num_layers

    def on_insert(self, key: ExpertKey) -> None:
        super().on_insert(key)
        self._count[key[0]] += 1

    def on_evict(self, key: ExpertKey) -> None:
        super().on_evict(key)
        self._count[key[0]] -= 1

    def victim(self, key: ExpertKey, evictable: Callable[[ExpertKey], bool], free_slots: int) -> ExpertKey | None:
        layer = key[0]
        if self._count[layer] >= self.quota[layer]:
            own = self._oldest(evictable, layer)
            if own is not None:
                return own
        if free_slots > 0:
            return None
        # Prefer taking back a slot from a layer that is over its quota, then any evictable expert.
        over = {l for l, (c, q) in enumerate(zip(self._count, self.quota)) if c > q}
        borrowed = self._oldest(lambda k: k[0] in over and evictable(k))
        return borrowed if borrowed is not None else self._oldest(evictable)
