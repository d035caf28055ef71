"""Heuristic route predictors the learned one is compared with. Each returns predicted sets [N, L, E] (bool) for the
rows of a trace, scored by `metrics.route_scores` exactly like the predictor's top-k.

* prev_step: a token's guess at layer l is the route its sequence's previous token (by position) took at layer l —
  what a cache that keeps the last step's experts bets on. A sequence's first token has no guess (empty set).
* prev_layer: the guess for layer l is the same token's route at layer l - 1, read as expert ids (expert e of layer
  l - 1 stands for expert e of layer l); layer 0 has no previous layer and falls back to `frequency`.
* frequency: every token's guess at layer l is the k experts chosen most often at layer l in the training traces
  (`expert_counts`, stored in the predictor directory); ties go to the lower id.

Does not know: the network, files or batching.

Shape legend: N = tokens, L = MoE layers, E = experts per layer.
"""

from __future__ import annotations

import numpy as np

from expertflow.predictor.metrics import route_sets
from expertflow.trace import Trace

__all__ = ["expert_counts", "prev_step", "prev_layer", "frequency", "BASELINES"]

BASELINES = ("prev_step", "prev_layer", "frequency")


def expert_counts(trace: Trace) -> np.ndarray:
    """[L, E] int64: how many tokens chose each expert at each layer (-1 ids ignored)."""
    return route_sets(trace.experts, trace.num_experts).sum(0).astype(np.int64)


def prev_step(trace: Trace, true: np.ndarray | None = None) -> np.ndarray:
    true = route_sets(trace.experts, trace.num_experts) if true is None else true
    order = np.lexsort((trace.steps, trace.positions, trace.seq_ids))
    pred = np.zeros_like(true)
    same = trace.seq_ids[order][1:] == trace.seq_ids[order][:-1]
    pred[order[1:][same]] = true[order[:-1][same]]
    return pred


def frequency(trace: Trace, counts: np.ndarray) -> np.ndarray:
    counts = np.asarray(counts)
    if counts.shape != (trace.num_layers, trace.num_experts):
        raise ValueError(f"expert counts have shape {counts.shape}; the trace needs "
                         f"({trace.num_layers}, {trace.num_experts}): was the predictor trained for this model?")
    order = np.argsort(-counts, axis=-1, kind="stable")[:, :trace.top_k]  # [L, k]
    hot = np.zeros(counts.shape, dtype=bool)
    np.put_along_axis(hot, order, True, axis=-1)
    if counts.sum() == 0:
        hot[:] = False  # no training counts: no guess
    return np.broadcast_to(hot, (trace.num_tokens, *hot.shape)).copy()


def prev_layer(trace: Trace, counts: np.ndarray, true: np.ndarray | None = None) -> np.ndarray:
    true = route_sets(trace.experts, trace.num_experts) if true is None else true
    pred = np.empty_like(true)
    pred[:, 1:] = true[:, :-1]
    pred[:, 0] = frequency(trace, counts)[:, 0]
    return pred
