"""Measure the shipped tiny MoE on held-out text: perplexity against a unigram baseline, and routing realism.

Owns: small reference computations of three routing figures (temporal overlap of consecutive tokens' experts,
max/mean expert load per layer, demand-LRU hit rate with half of all experts cached), for the trained model and for
a random-initialised model of the same config. Prints one JSON object.
Does not know the project's cache or simulator; these functions are deliberately plain and self-contained.

Usage: python benchmarks/assets/eval_tiny_moe.py [--model expertflow/assets/tiny-moe] [--windows 128]
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import build_prompts
import train_tiny_moe

TARGETS = {
    "ppl_vs_unigram_min": 3.0,
    "temporal_overlap_max": 0.5,
    "max_over_mean_median_max": 3.5,
    "lru_half_hit_rate_range": [0.45, 0.80],
}


# ---- routing figures. Shapes: W = windows, S = tokens per window, T = all tokens, L = layers, k = top-k ----


def temporal_overlap(picks: np.ndarray, num_experts: int) -> np.ndarray:
    """Per layer, mean of |A_t ∩ A_{t+1}| / k over consecutive tokens of the same window. picks: [W, S, L, k]."""
    w, s, layers, k = picks.shape
    mask = np.zeros((w, s, layers, num_experts), dtype=bool)
    np.put_along_axis(mask, picks, True, axis=-1)
    shared = (mask[:, 1:] & mask[:, :-1]).sum(-1) / k  # [W, S-1, L]
    return shared.mean(axis=(0, 1))


def max_over_mean_load(picks: np.ndarray, num_experts: int) -> np.ndarray:
    """Per layer, the busiest expert's share of picks divided by the mean share. picks: [W, S, L, k]."""
    layers = picks.shape[2]
    per_layer = picks.transpose(2, 0, 1, 3).reshape(layers, -1)  # [L, W*S*k]
    counts = np.stack([np.bincount(row, minlength=num_experts) for row in per_layer])  # [L, E]
    return counts.max(axis=1) / counts.mean(axis=1)


def lru_hit_rate(picks: np.ndarray, capacity: int) -> float:
    """Demand LRU over (layer, expert) slots shared by all layers, batch size 1.

    Requests come in (token, layer) order; a request is the token's top-k experts at that layer. Its hits are
    refreshed before its misses are loaded, so the least recently used slot evicted is never one of the request's own
    experts (they are pinned while the request is served). Returns hits / expert lookups. picks: [W, S, L, k].
    """
    assert capacity >= picks.shape[-1], "a request must fit in the cache"
    cache: OrderedDict[tuple[int, int], None] = OrderedDict()
    hits = lookups = 0
    for token in picks.reshape(-1, *picks.shape[2:]):  # [L, k] per token
        for layer, experts in enumerate(token.tolist()):
            request = [(layer, e) for e in experts]
            missing = [key for key in request if key not in cache]
            hits += len(request) - len(missing)
            lookups += len(request)
            for key in request:
                if key in cache:
                    cache.move_to_end(key)
            for key in missing:
                cache[key] = None
                if len(cache) > capacity:
                    cache.popitem(last=False)
    return hits / lookups


# ---- model side ----


def heldout_windows(tokens: np.ndarray, windows: int, seq_len: int) -> torch.Tensor:
    """``windows`` non-overlapping windows spread evenly over the held-out stream. [W, S]"""
    available = len(tokens) // seq_len
    chosen = np.linspace(0, available - 1, min(windows, available)).astype(np.int64)
    return torch.from_numpy(np.stack([tokens[i * seq_len : (i + 1) * seq_len] for i in chosen]).astype(np.int64))


@torch.no_grad()
def run_model(model, windows: torch.Tensor) -> tuple[float, np.ndarray]:
    """Mean next-token cross-entropy over the windows, and the routing picks [W, S, L, k]."""
    model.eval()
    k = model.config.num_experts_per_tok
    losses, picks = [], []
    for window in windows.split(1):  # batch size 1, like decoding one request
        out = model(input_ids=window, output_router_logits=True, use_cache=False)
        logits = out.logits[0, :-1].float()
        losses.append(F.cross_entropy(logits, window[0, 1:], reduction="sum").item())
        picks.append(torch.stack([r.topk(k, dim=-1).indices for r in out.router_logits], dim=1))  # [S, L, k]
    tokens = windows.shape[0] * (windows.shape[1] - 1)
    return sum(losses) / tokens, torch.stack(picks).numpy()


def unigram_cross_entropy(train_tokens: np.ndarray, windows: torch.Tensor, vocab_size: int) -> float:
    """Cross-entropy of an add-one smoothed unigram model fitted on the training stream, same targets as the LM."""
    counts = np.bincount(train_tokens.astype(np.int64), minlength=vocab_size) + 1.0
    log_prob = np.log(counts / counts.sum())
    return float(-log_prob[windows[:, 1:].numpy()].mean())


def figures(model, windows: torch.Tensor, unigram_ce: float) -> dict:
    ce, picks = run_model(model, windows)
    cfg = model.config
    num_experts, layers = cfg.num_local_experts, cfg.num_hidden_layers
    overlap = temporal_overlap(picks, num_experts)
    load = max_over_mean_load(picks, num_experts)
    return {
        "heldout_ppl": round(math.exp(ce), 2),
        "ppl_vs_unigram": round(math.exp(unigram_ce - ce), 3),
        "temporal_overlap": round(float(overlap.mean()), 4),
        "temporal_overlap_per_layer": [round(float(x), 4) for x in overlap],
        "max_over_mean_median": round(float(np.median(load)), 3),
        "max_over_mean_per_layer": [round(float(x), 3) for x in load],
        "lru_half_hit_rate": round(lru_hit_rate(picks, layers * num_experts // 2), 4),
    }


def passes(fig: dict) -> dict:
    low, high = TARGETS["lru_half_hit_rate_range"]
    return {
        "ppl_vs_unigram": fig["ppl_vs_unigram"] >= TARGETS["ppl_vs_unigram_min"],
        "temporal_overlap": fig["temporal_overlap"] <= TARGETS["temporal_overlap_max"],
        "max_over_mean_median": fig["max_over_mean_median"] <= TARGETS["max_over_mean_median_max"],
        "lru_half_hit_rate": low <= fig["lru_half_hit_rate"] <= high,
    }


def _display_path(path: Path) -> str:
    """The model path relative to the repository when it lies inside it, so results read the same everywhere."""
    try:
        return str(path.resolve().relative_to(build_prompts.REPO))
    except ValueError:
        return str(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=build_prompts.REPO / "expertflow" / "assets" / "tiny-moe")
    parser.add_argument("--data", type=Path, default=build_prompts.DEFAULT_DATA, help="the shared/data/text folder")
    parser.add_argument("--windows", type=int, default=128, help="held-out windows of --seq-len tokens")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0, help="seed of the random-initialised comparison model")
    args = parser.parse_args()
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    streams = {}
    for split in ("train", "test"):
        texts = [text for _, text in build_prompts.training_documents(args.data, split)]
        streams[split] = train_tiny_moe.encode_documents(tokenizer, texts)
    windows = heldout_windows(streams["test"], args.windows, args.seq_len)
    trained = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    unigram_ce = unigram_cross_entropy(streams["train"], windows, trained.config.vocab_size)
    torch.manual_seed(args.seed)
    random_init = AutoModelForCausalLM.from_config(trained.config, dtype=torch.float32)
    result = {
        "model": _display_path(args.model),
        "heldout_tokens": int(windows.shape[0] * (windows.shape[1] - 1)),
        "unigram_ppl": round(math.exp(unigram_ce), 2),
        "chance_overlap": trained.config.num_experts_per_tok / trained.config.num_local_experts,
        "trained": figures(trained, windows, unigram_ce),
        "random_init": figures(random_init, windows, unigram_ce),
        "targets": TARGETS,
    }
    result["trained_passes"] = passes(result["trained"])
    print(json.dumps(result))


if __name__ == "__main__":
    main()
