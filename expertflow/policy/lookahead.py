"""`lookahead`: cross-layer speculative prefetching (the heuristic of Fate, HOBBIT and mixtral-offloading's
speculative loading), with LRU eviction.

While layer l of a step runs, it prefetches for layer l+1 the experts that the same tokens' layer-l experts most
often led to so far: it counts, online from `on_route`, how often a token routed to expert a at layer l went to
expert b at layer l+1. For each token of the step it scores b by the sum over its layer-l experts a of P(b | a) and
takes its top-k; the union over tokens is offered, best score first. No counts yet (the start of a run, or layer 0,
which has no previous layer in the same step) means no prefetch.

Owns: the transition counts and the last routes seen. Does not know: slots, timing or transfers.
"""

from __future__ import annotations

from collections.abc import Sequence

from expertflow.policy.base import ExpertKey, register_policy
from expertflow.policy.prefetching import PrefetchingLRU


@register_policy
class LookaheadPolicy(PrefetchingLRU):
    """Predict layer l+1 from layer l's routes of the same tokens; LRU eviction."""

    name = "lookahead"

    def __init__(self, capacity: int, num_layers: int, num_experts: int) -> None:
        super().__init__(capacity, num_layers, num_experts)
        # pairs[l][a][b]: tokens that chose a at layer l and b at layer l+1; totals[l][a] = sum over b
        self._pairs = [[[0] * num_experts for _ in range(num_experts)] for _ in range(max(num_layers - 1, 0))]
        self._totals = [[0] * num_experts for _ in range(max(num_layers - 1, 0))]
        self._last: tuple[int, int, Sequence[Sequence[int]]] | None = None  # (step, layer, routes)

    def on_route(self, step: int, layer: int, routes: Sequence[Sequence[int]]) -> None:
        last = self._last
        if last is not None and last[0] == step and last[1] == layer - 1 and len(last[2]) == len(routes):
            pairs, totals = self._pairs[layer - 1], self._totals[layer - 1]
            for before, after in zip(last[2], routes):
                chosen = [b for b in after if b >= 0]
                for a in before:
                    if a < 0:
                        continue
                    row = pairs[a]
                    for b in chosen:
                        row[b] += 1
                    totals[a] += len(chosen)
        self._last = (step, layer, routes)

    def prefetches(self, step: int, layer: int) -> list[ExpertKey]:
        last = self._last
        if last is None or last[0] != step or last[1] != layer - 1:
            return []
        pairs, totals = self._pairs[layer - 1], self._totals[layer - 1]
        score: dict[int, float] = {}
        for route in last[2]:
            sources = [a for a in route if a >= 0 and totals[a]]
            per_expert = [sum(pairs[a][b] / totals[a] for a in sources) for b in range(self.num_experts)]
            ranked = sorted((b for b in range(self.num_experts) if per_expert[b] > 0),
                            key=lambda b: (-per_expert[b], b))
            for b in ranked[:sum(1 for a in route if a >= 0)]:
                score[b] = score.get(b, 0.0) + per_expert[b]
        best = sorted(score, key=lambda b: (-score[b], b))
        return self._offer((layer, b) for b in best)
