"""Evaluate a route predictor on a trace: its top-k against the true routes, next to the heuristic baselines.

Owns: running the predictor over every sequence of a trace (teacher-forced: the prompt to the encoder, all tokens
to the decoder, which is what prefill + incremental decode compute) and the `predictor eval --json` document
`{"batch_size", "b_acc", "token_recall_at_k", "token_precision_at_k", "per_layer_b_acc", "baselines": {"prev_step",
"prev_layer", "frequency"}}` (a precision is None, JSON null, where no scored cell has a guess). Metric definitions
live in `metrics.py`, baselines in `baselines.py`.

Shape legend: N = trace tokens, L = MoE layers, E = experts per layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from expertflow.predictor import baselines
from expertflow.predictor.data import length_batches, pad_batch, same_model, sequences
from expertflow.predictor.metrics import route_scores, route_sets, top_k_sets
from expertflow.predictor.session import RoutePredictor
from expertflow.trace import Trace

__all__ = ["predict_trace", "evaluate", "evaluate_batch_sizes", "check_fits"]


def check_fits(predictor: RoutePredictor, trace: Trace) -> None:
    """Refuse a trace of another model than the predictor's: other layers, experts or top-k, or another name."""
    c = predictor.config
    fix = "train a predictor on this model's traces"
    if (trace.num_layers, trace.num_experts, trace.top_k) != (c.num_layers, c.num_experts, c.top_k):
        raise ValueError(f"the predictor predicts {c.num_layers} layers x {c.num_experts} experts, top-{c.top_k}; "
                         f"the trace has {trace.num_layers} x {trace.num_experts}, top-{trace.top_k}: {fix}")
    trained = str(predictor.info.get("model") or "")
    if not same_model(trained, trace.model):
        raise ValueError(f"the predictor was trained on traces of {trained!r}, the trace is of {trace.model!r}: {fix}")


def predict_trace(predictor: RoutePredictor, trace: Trace, max_tokens: int = 8192, with_next: bool = False,
                  progress: bool = False) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Probabilities [N, L, E] (float32) for every row of `trace`; with `with_next` also [N, K, L, E], those of the K
    tokens that follow each row in its sequence, as the next-token head guesses them without seeing them.
    `progress` shows a bar on stderr when it takes more than a second."""
    check_fits(predictor, trace)
    c = predictor.config
    examples = sequences(trace)
    out = np.zeros((trace.num_tokens, c.num_layers, c.num_experts), dtype=np.float32)
    nxt = np.zeros((trace.num_tokens, c.next_tokens, c.num_layers, c.num_experts), np.float32) if with_next else None
    groups = length_batches(examples, max_tokens)
    for group in tqdm(groups, desc="predicting", unit="batch", delay=1, disable=not progress):
        chosen = [examples[i] for i in group]
        probs = predictor.predict(pad_batch(chosen), with_next=with_next)
        probs, after = probs if with_next else (probs, None)
        probs = probs.float().cpu().numpy()  # [B, T, L, E]
        after = None if after is None else after.float().cpu().numpy()
        for row, example in enumerate(chosen):
            out[example.index] = probs[row, :len(example.tokens)]
            if nxt is not None:
                nxt[example.index] = after[row, :len(example.tokens)]
    return (out, nxt) if with_next else out


def evaluate_batch_sizes(predictor: RoutePredictor, trace: Trace, batch_sizes: Sequence[int],
                         phase: str = "decode", progress: bool = False) -> list[dict[str, Any]]:
    """One `predictor eval` document per batch size; the predictor runs once."""
    true = route_sets(trace.experts, trace.num_experts)
    pred = top_k_sets(predict_trace(predictor, trace, progress=progress), trace.top_k)
    guesses = {"prev_step": baselines.prev_step(trace, true),
               "prev_layer": baselines.prev_layer(trace, predictor.expert_counts, true),
               "frequency": baselines.frequency(trace, predictor.expert_counts)}
    reports = []
    for b in batch_sizes:
        report = {"batch_size": int(b), **route_scores(trace, pred, b, phase, true)}
        report["baselines"] = {name: route_scores(trace, guess, b, phase, true) for name, guess in guesses.items()}
        reports.append(report)
    return reports


def evaluate(predictor: RoutePredictor, trace: Trace, batch_size: int = 16, phase: str = "decode",
             progress: bool = False) -> dict[str, Any]:
    """The `predictor eval --json` document at one batch size."""
    return evaluate_batch_sizes(predictor, trace, [batch_size], phase, progress)[0]
