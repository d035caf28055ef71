"""Accuracy of predicted routes: token-level top-k recall/precision and the paper's batch accuracy (b_acc).

Definitions (every function takes boolean expert sets [N, L, E]: `true` = the experts the router chose, `pred` = the
experts a predictor names, normally its top-k):

* A *cell* is one (token, layer) whose true route is known (at least one expert id >= 0; -1 ids are ignored).
* token_recall_at_k = mean over cells of |true ∩ pred| / |true|; token_precision_at_k = mean over cells with a
  non-empty prediction of |true ∩ pred| / |pred|, None when no cell has one (undefined, not 0: no guess was wrong).
  With k = the model's top-k both sets have k experts and the two numbers coincide; they differ for baselines that
  name fewer or more experts.
* A *batch* is the set of tokens that share a step of the trace. Evaluating "at batch size B" means the trace is first
  re-batched (`Trace.rebatch(B)`): B sequences decode together, so a decode step holds one token of each of the B
  sequences still running. For a batch b and layer l, R = OR of the true sets of its tokens, R̂ = OR of their
  predicted sets — of its tokens whose route at l is known: a guess for a missing route is not scored on either
  side —, and acc(b, l) = |R ∩ R̂| / |R| (layers with R empty are skipped). b_acc(b) = mean over layers;
  b_acc = mean over batches (each batch counts once); per_layer_b_acc[l] = mean over batches of acc(b, l).
* next_token_recall: the same token recall, but of a guess made at each token for a *later* token of its sequence
  (the next-token head's, `offset` tokens ahead), scored on that token's true routes; a later token whose route is
  unknown is not counted, and without any such token the recall is None (nothing measured, not 0).
* `phase` picks the tokens scored: "decode" (default: the batches above), "prefill" (one batch per group of B
  prompts) or "all".

Does not know: models, predictors or files.

Shape legend: N = tokens, L = MoE layers, E = experts per layer, K = top-k, S = batches (steps).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from expertflow.trace import DECODE, PREFILL, Trace

__all__ = ["route_sets", "top_k_sets", "token_scores", "batch_accuracy", "route_scores", "next_token_recall",
           "PHASES"]

PHASES = ("decode", "prefill", "all")


def route_sets(experts: np.ndarray, num_experts: int) -> np.ndarray:
    """[N, L, K] expert ids (-1 = none) -> [N, L, E] bool."""
    hot = np.zeros((*experts.shape[:-1], num_experts + 1), dtype=bool)
    np.put_along_axis(hot, np.where(experts >= 0, experts, num_experts).astype(np.int64), True, axis=-1)
    return hot[..., :num_experts]


def top_k_sets(scores: np.ndarray, k: int) -> np.ndarray:
    """[N, L, E] scores -> [N, L, E] bool marking each (token, layer)'s k highest (ties: lower id first)."""
    order = np.argsort(-scores, axis=-1, kind="stable")[..., :k]
    hot = np.zeros(scores.shape, dtype=bool)
    np.put_along_axis(hot, order, True, axis=-1)
    return hot


def token_scores(true: np.ndarray, pred: np.ndarray) -> dict[str, float | None]:
    """Token-level recall and precision over the known cells of [N, L, E] sets (precision None without a guess)."""
    both = (true & pred).sum(-1)  # [N, L]
    n_true, n_pred = true.sum(-1), pred.sum(-1)
    known, named = n_true > 0, n_pred > 0
    recall = float((both[known] / n_true[known]).mean()) if known.any() else 0.0
    precision = float((both[named & known] / n_pred[named & known]).mean()) if (named & known).any() else None
    return {"token_recall_at_k": recall, "token_precision_at_k": precision}


def batch_accuracy(true: np.ndarray, pred: np.ndarray, steps: np.ndarray) -> tuple[float, list[float | None]]:
    """b_acc and per-layer b_acc of [N, L, E] sets grouped into batches by `steps` [N] (see module docstring)."""
    if not len(steps):
        return 0.0, [None] * true.shape[1]
    pred = pred & true.any(-1, keepdims=True)  # a guess for a cell whose route is missing counts on neither side
    order = np.argsort(steps, kind="stable")
    starts = np.flatnonzero(np.r_[True, np.diff(steps[order]) != 0])
    r_true = np.logical_or.reduceat(true[order], starts, axis=0)  # [S, L, E]
    r_pred = np.logical_or.reduceat(pred[order], starts, axis=0)
    size = r_true.sum(-1)  # [S, L]
    valid = size > 0
    acc = np.where(valid, (r_true & r_pred).sum(-1) / np.maximum(size, 1), np.nan)  # [S, L]
    per_batch = np.nanmean(acc[valid.any(1)], axis=1)  # batches with at least one known layer
    per_layer = [None if not valid[:, l].any() else float(np.nanmean(acc[:, l])) for l in range(acc.shape[1])]
    return (float(per_batch.mean()) if len(per_batch) else 0.0), per_layer


def route_scores(trace: Trace, pred: np.ndarray, batch_size: int, phase: str = "decode",
                 true: np.ndarray | None = None) -> dict[str, Any]:
    """All metrics of predicted sets `pred` [N, L, E] (rows = trace rows) at `batch_size`, rounded for reports."""
    if phase not in PHASES:
        raise ValueError(f"phase={phase!r}; choose one of {PHASES}")
    if true is None:
        true = route_sets(trace.experts, trace.num_experts)
    keep = np.ones(trace.num_tokens, dtype=bool) if phase == "all" else trace.phase == (
        DECODE if phase == "decode" else PREFILL)
    if not trace.num_tokens:
        raise ValueError("the trace has no tokens: nothing to score; evaluate on a trace recorded from prompts "
                         "(`expertflow trace record`)")
    if not keep.any():
        raise ValueError(f"the trace has no {phase} tokens to score; score another phase (prefill, decode or all)")
    if not true[keep].any():  # b_acc and recall would read 0.0, as if every guess were wrong
        raise ValueError(f"the trace's {phase} tokens have no known routes (every expert id is -1): nothing to "
                         "score; evaluate on a trace with routes (`expertflow trace record`)")
    steps = trace.rebatch(batch_size).steps[keep]
    b_acc, per_layer = batch_accuracy(true[keep], pred[keep], steps)
    out: dict[str, Any] = {"b_acc": b_acc, **token_scores(true[keep], pred[keep]), "per_layer_b_acc": per_layer}
    return _rounded(out)


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    return value


def next_token_recall(trace: Trace, after: np.ndarray, phase: str = "decode",
                      offset: int = 1) -> dict[str, float | None]:
    """Top-k recall of `after` [N, L, E] (per token: a guess of the routes of the token `offset` places after it in
    its sequence) against those routes, over such tokens of `phase` whose route is known (`tokens` counts them);
    beside it the recall of the simplest guess, the current token's own true routes (`current_routes`). Both are None
    when no such token exists."""
    if phase not in PHASES:
        raise ValueError(f"phase={phase!r}; choose one of {', '.join(PHASES)}")
    if offset < 1:
        raise ValueError(f"offset={offset} must be at least 1")
    order = np.lexsort((trace.steps, trace.positions, trace.seq_ids))
    same = trace.seq_ids[order[offset:]] == trace.seq_ids[order[:-offset]]
    before, following = order[:-offset][same], order[offset:][same]
    keep = (trace.experts[following] >= 0).any((-2, -1))  # a token without a known route has nothing to score
    if phase != "all":
        keep &= trace.phase[following] == (DECODE if phase == "decode" else PREFILL)
    before, following = before[keep], following[keep]
    if len(following) == 0:  # nothing to measure: not a recall of 0
        return {"next_token_head": None, "current_routes": None, "tokens": 0}
    true = route_sets(trace.experts[following], trace.num_experts)
    head = token_scores(true, top_k_sets(after[before], trace.top_k))["token_recall_at_k"]
    current = token_scores(true, route_sets(trace.experts[before], trace.num_experts))["token_recall_at_k"]
    return {"next_token_head": head, "current_routes": current, "tokens": int(len(following))}
