"""`prev-step`: before layer l runs, prefetch the experts layer l needed in the previous step (temporal locality of
consecutive tokens), with LRU eviction.

Owns: the last request's experts per layer. Does not know: slots, timing or transfers.
"""

from __future__ import annotations

from collections.abc import Sequence

from expertflow.policy.base import ExpertKey, register_policy
from expertflow.policy.prefetching import PrefetchingLRU


@register_policy
class PrevStepPolicy(PrefetchingLRU):
    """Re-fetch the previous step's experts of the upcoming layer; LRU eviction."""

    name = "prev-step"

    def __init__(self, capacity: int, num_layers: int, num_experts: int) -> None:
        super().__init__(capacity, num_layers, num_experts)
        self._previous: list[tuple[int, tuple[int, ...]] | None] = [None] * num_layers  # (step, experts)

    def on_request(self, step: int, layer: int, experts: Sequence[int]) -> None:
        super().on_request(step, layer, experts)
        self._previous[layer] = (step, tuple(experts))

    def prefetches(self, step: int, layer: int) -> list[ExpertKey]:
        previous = self._previous[layer]
        if previous is None or previous[0] >= step:
            return []
        return self._offer((layer, e) for e in previous[1])
