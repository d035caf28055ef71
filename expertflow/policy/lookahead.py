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

import numpy as np

from expertflow.policy.base import ExpertKey, register_policy, routes_array
from expertflow.policy.prefetching import PrefetchingLRU


_MAX_TABLE_BYTES = 4 << 30  # the dense transition table's limit


@register_policy
class LookaheadPolicy(PrefetchingLRU):
    """Predict layer l+1 from layer l's routes of the same tokens; LRU eviction."""

    name = "lookahead"

    def __init__(self, capacity: int, num_layers: int, num_experts: int) -> None:
        super().__init__(capacity, num_layers, num_experts)
        size = max(num_layers - 1, 0) * num_experts * num_experts * 8
        if size > _MAX_TABLE_BYTES:  # dense: fine for any model's few hundred experts, not for a damaged count
            raise ValueError(f"policy 'lookahead' keeps (layers - 1) x experts x experts transition counts: "
                             f"{size / 2**30:.1f} GiB for {num_layers} layers of {num_experts} experts (at most "
                             f"{_MAX_TABLE_BYTES // 2**30} GiB); choose another policy")
        # pairs[l, a, b]: tokens that chose a at layer l and b at layer l+1; totals[l, a] = sum over b
        self._pairs = np.zeros((max(num_layers - 1, 0), num_experts, num_experts), dtype=np.int64)
        self._totals = np.zeros((max(num_layers - 1, 0), num_experts), dtype=np.int64)
        self._last: tuple[int, int, np.ndarray] | None = None  # (step, layer, routes [T, K], -1 = none)

    def on_route(self, step: int, layer: int, routes: Sequence[Sequence[int]]) -> None:
        ids = routes_array(routes, self.num_experts)
        last = self._last
        if last is not None and last[0] == step and last[1] == layer - 1 and len(last[2]) == len(ids):
            before, after = last[2], ids  # [T, K]
            pairs, totals = self._pairs[layer - 1], self._totals[layer - 1]
            if before.size * after.shape[1] <= _FEW_PAIRS:
                for row_before, row_after in zip(before.tolist(), after.tolist()):
                    chosen = [b for b in row_after if b >= 0]
                    for a in row_before:
                        if a >= 0:
                            for b in chosen:
                                pairs[a, b] += 1
                            totals[a] += len(chosen)
            else:
                pair = (before[:, :, None] >= 0) & (after[:, None, :] >= 0)  # [T, K, K]: a token's (a, b) pairs
                a = np.broadcast_to(before[:, :, None], pair.shape)[pair]
                b = np.broadcast_to(after[:, None, :], pair.shape)[pair]
                e = self.num_experts
                pairs += np.bincount(a * e + b, minlength=e * e).reshape(e, e)
                totals += np.bincount(a, minlength=e)
        self._last = (step, layer, ids)

    def prefetches(self, step: int, layer: int) -> list[ExpertKey]:
        last = self._last
        if last is None or last[0] != step or last[1] != layer - 1:
            return []
        routes = last[2]  # [T, K]
        if not len(routes):
            return self._offer(())
        pairs, totals = self._pairs[layer - 1], self._totals[layer - 1]
        if routes.size * self.num_experts <= _FEW:  # a decode step of a small batch: a few numbers, plain Python
            return self._offer((layer, b) for b in _best_few(routes.tolist(), pairs, totals.tolist()))
        seen = totals > 0
        table = np.divide(pairs, totals[:, None], out=np.zeros(pairs.shape), where=seen[:, None])  # P(b | a)
        # per token, the sum of P(b | a) over its experts a (in route order, as floats add), [T, E]
        per_expert = np.zeros((len(routes), self.num_experts))
        for column in routes.T:
            use = (column >= 0) & seen[np.maximum(column, 0)]
            per_expert += np.where(use[:, None], table[np.maximum(column, 0)], 0.0)
        # each token offers its top-k (k = its experts), best score first, ties to the lower id, positive only
        rank = np.argsort(-per_expert, axis=1, kind="stable")  # [T, E]
        k = (routes >= 0).sum(axis=1)
        chosen = np.zeros(per_expert.shape, dtype=bool)
        np.put_along_axis(chosen, rank, np.arange(self.num_experts)[None, :] < k[:, None], axis=1)
        chosen &= per_expert > 0
        score = np.where(chosen, per_expert, 0.0).sum(axis=0)  # summed over tokens in order
        offered = np.flatnonzero(chosen.any(axis=0))
        best = offered[np.lexsort((offered, -score[offered]))]
        return self._offer((layer, int(b)) for b in best)


# below these sizes plain Python beats numpy's per-call overhead (a decode step of a small batch)
_FEW = 1024  # (token, k) cells x experts, for scoring
_FEW_PAIRS = 64  # (a, b) pairs, for counting


def _best_few(routes: list[list[int]], pairs: np.ndarray, totals: list[int]) -> list[int]:
    """The numpy path's answer, computed in Python for a few tokens: per token the sum of P(b | a) over its experts
    a, its top-k positive b (ties to the lower id), scores summed over tokens in order, best first."""
    num_experts = len(totals)
    rows: dict[int, list[int]] = {}
    score: dict[int, float] = {}
    for route in routes:
        sources = [a for a in route if a >= 0 and totals[a]]
        for a in sources:
            if a not in rows:
                rows[a] = pairs[a].tolist()
        per_expert = [sum(rows[a][b] / totals[a] for a in sources) for b in range(num_experts)]
        ranked = sorted((b for b in range(num_experts) if per_expert[b] > 0), key=lambda b: (-per_expert[b], b))
        for b in ranked[:sum(1 for a in route if a >= 0)]:
            score[b] = score.get(b, 0.0) + per_expert[b]
    return sorted(score, key=lambda b: (-score[b], b))
