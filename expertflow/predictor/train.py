"""Train a route predictor on recorded traces.

Owns: the training recipe: one example per sequence (encoder = its prompt tokens, decoder = all its tokens in order,
target = the multi-hot [L, E] route of each token), multi-label BCE over known (token, layer) cells with padding
masked, AdamW with linear warm-up and cosine decay, a validation split by sequence, early stopping on validation
top-k recall (the best epoch's weights are kept), and the expert counts of the training traces for the `frequency`
baseline. Deterministic for a given seed and thread count; `max_minutes` is the only exception (it stops early). A run
whose loss or weights stop being finite (too high a learning rate) is stopped with a ValueError, never saved.

Optionally (`init_embeddings`) each token also gets fixed features: the predicted model's own input embedding row,
stored with the predictor and read through a learned projection, next to the learned embedding (which then starts at
zero). A token that never occurs in the training traces is then still placed where the model itself places it,
which is what carries predictions across task families.

Then (`next_hidden` > 0, the default) `fit_next_head` fits the next-token head on the frozen network: each token's
decoder state → for each window of the tokens after it in its sequence (`next_windows`, by default t+1, t+2, t+3 … t+4
and t+5 … t+8), the experts at least one of them routes to; the epoch with the lowest validation loss is kept.
`max_minutes` bounds both parts together.
Does not know: the runtime, the CLI or evaluation reports.

Shape legend: B = sequences, T = tokens, L = MoE layers, E = experts per layer.
"""

from __future__ import annotations

import copy
import json
import numbers
import logging
import math
import os
import re
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from expertflow.errors import first_line
from expertflow.models import TINY_MOE_NAME, tiny_moe_path
from expertflow.predictor.baselines import expert_counts
from expertflow.predictor.data import (SequenceExample, concat_traces, length_batches, pad_batch, sequences,
                                       sequences_digest)
from expertflow.predictor.evaluate import check_fits
from expertflow.predictor.model import PredictorConfig, RouteNet, check_windows
from expertflow.predictor.session import RoutePredictor, check_predictor_dir
from expertflow.trace import Trace

__all__ = ["TrainConfig", "train", "fit_next_head", "with_overrides", "model_vocab_size", "load_embedding_table"]

log = logging.getLogger(__name__)

# windows of following tokens the next-token head predicts, by last offset: t+1, t+2, any of t+3 … t+4, any of
# t+5 … t+8. The same output size as one per token for t+1 … t+4, and it sees twice as far: at batch 1 a cache holds
# several steps' experts, so evictions need to know about uses well beyond the next few tokens.
NEXT_WINDOWS = (1, 2, 4, 8)
MAX_LR = 1e30  # larger learning rates overflow the optimizer's float32 step


@dataclass(frozen=True)
class TrainConfig:
    """Training settings; the network sizes are passed on to `PredictorConfig`."""

    seed: int = 0
    epochs: int = 36
    lr: float = 3e-3
    min_lr_ratio: float = 0.05
    warmup_fraction: float = 0.05
    weight_decay: float = 0.01
    batch_tokens: int = 1024  # padded decoder tokens per optimizer step
    val_fraction: float = 0.1
    patience: int = 4  # epochs without a better validation recall before stopping
    max_minutes: float | None = None  # wall-clock bound of the whole run, next-token head included
    d_model: int = 128
    d_ff: int = 512
    heads: int = 4
    encoder_layers: int = 1
    decoder_layers: int = 3
    dropout: float = 0.0
    vocab_size: int | None = None  # None: from the model's config.json (`model_vocab_size`)
    init_embeddings: str | None = None  # a model directory or safetensors file with its input embeddings
    next_hidden: int = 768  # width of the next-token head fitted after training (`fit_next_head`); 0 = none
    next_windows: tuple[int, ...] = NEXT_WINDOWS  # the head's windows of following tokens (`fit_next_head`)
    next_epochs: int = 20

    def __post_init__(self) -> None:
        _check_split(self.seed, self.val_fraction)
        if self.next_hidden < 0:
            raise ValueError(f"next_hidden={self.next_hidden} must not be negative (0 = no next-token head)")
        for name in ("epochs", "batch_tokens", "patience", "next_epochs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        object.__setattr__(self, "next_windows", check_windows(self.next_windows, training=True))
        _check_lr(self.lr)
        if self.max_minutes is not None and not 0 < self.max_minutes < math.inf:  # also refuses NaN
            raise ValueError(f"max_minutes={self.max_minutes} must be a finite number of minutes above 0; give None "
                             "for no time limit")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ValueError(f"vocab_size={self.vocab_size} must be at least 1")


def _check_lr(lr: float) -> None:
    """A learning rate the optimizer can use: positive, not NaN or inf, and within its float32 arithmetic."""
    if not 0 < lr <= MAX_LR:  # also refuses NaN
        raise ValueError(f"lr={lr} must be a positive number of at most {MAX_LR:g} (a finite float32 step)")


def _check_split(seed: int, val_fraction: float) -> None:
    """The seed and validation share of a training split (torch takes a seed of at most 64 bits)."""
    if seed < 0:
        raise ValueError(f"seed={seed} must not be negative")
    if seed >= 2**64:
        raise ValueError(f"seed={seed} must be below 2**64 (torch's seed range)")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction} must lie in [0, 1)")


def model_vocab_size(trace: Trace, init_embeddings: str | Path | None = None, table_rows: int | None = None) -> int:
    """The traced model's vocabulary, at least the largest token id + 1. From the config.json of the model directory
    `init_embeddings` (the one whose embeddings the predictor reads) or else of `trace.model` (a relative name is
    looked up from the working directory); failing both, the embedding table's `table_rows`, else the largest id + 1
    (with a warning when `trace.model` is a path or a hub id such as org/name; not for a bare name without a "/",
    such as a class name)."""
    largest = int(trace.token_ids.max(initial=0)) + 1
    places = [Path(init_embeddings)] if init_embeddings and Path(init_embeddings).is_dir() else []
    if trace.model == TINY_MOE_NAME:  # the built-in model's short name (`--model tiny-moe`, the benchmarks' traces)
        places.append(tiny_moe_path())
    for place in places + ([Path(trace.model)] if trace.model else []):
        try:
            settings = json.loads((place / "config.json").read_text(encoding="utf-8"))
            return max(int(settings.get("vocab_size") or settings["text_config"]["vocab_size"]), largest)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
    if table_rows is not None:  # the table has a row per token of the model
        return max(table_rows, largest)
    # a path, relative or not, or a hub id (org/name) whose config cannot be read from here
    if trace.model.startswith((".", "~")) or "/" in trace.model or os.sep in trace.model:
        warnings.warn(f"the trace's model {trace.model!r} has no readable config.json from here: the "
                      f"predictor's vocabulary is taken as the largest token id + 1 ({largest}), and ids it never "
                      "saw share rows; give the model's vocabulary as vocab_size=V, or train where that name leads "
                      "to the model's directory (a trace of a model loaded from a local directory stores its "
                      "absolute path)", stacklevel=2)
    return largest


def train(traces: Trace | Sequence[Trace], config: TrainConfig = TrainConfig(), out: str | Path | None = None,
          progress: bool = True) -> RoutePredictor:
    """Train on `traces` and return the predictor (also saved to `out` when given: a new or empty directory, or a
    predictor's, which is replaced; checked before training, see `check_predictor_dir`)."""
    if out is not None:
        check_predictor_dir(out)
    start = time.monotonic()
    deadline = None if config.max_minutes is None else start + 60 * config.max_minutes
    trace = concat_traces([traces] if isinstance(traces, Trace) else list(traces))
    examples = sequences(trace)
    if not examples:
        raise ValueError("the traces hold no tokens; record some with `expertflow trace record`")
    if not (trace.experts >= 0).any():
        raise ValueError("the traces hold no known routes (every expert id is -1): there is nothing to learn; record "
                         "traces with routes (`expertflow trace record`)")
    if config.next_hidden and max(len(e.tokens) for e in examples) < 2:
        raise ValueError("every sequence of the traces has one token: the next-token head has nothing to learn "
                         "from; record longer sequences or train without it (next_hidden=0)")
    largest = int(trace.token_ids.max(initial=0))
    if config.vocab_size is not None and config.vocab_size <= largest:
        warnings.warn(f"vocab_size={config.vocab_size}, but the traces hold token ids up to {largest}: ids past the "
                      "vocabulary share rows of the embedding table; give the traced model's vocabulary size",
                      stacklevel=2)
    torch.manual_seed(config.seed)
    rng = np.random.default_rng(config.seed)
    train_set, val_set = _split(examples, config.val_fraction, rng)
    if val_set and not any((e.experts >= 0).any() for e in val_set):  # a recall over no cell would score 0.0
        warnings.warn(f"the {len(val_set)} held-out sequences have no known routes (every expert id is -1): there is "
                      "nothing to validate on, so every epoch runs and the last is kept; choose another seed to hold "
                      "out others", stacklevel=2)
        val_set = []
    if config.next_hidden and max(len(e.tokens) for e in train_set) < 2:  # checked now, not after the training
        raise ValueError(f"the sequences of two or more tokens all fall in the validation split ({len(val_set)} held "
                         "out): the next-token head has nothing to learn from; hold out fewer (val_fraction=0 holds "
                         "out none), choose another seed, or train without the head (next_hidden=0)")
    table = load_embedding_table(Path(config.init_embeddings)) if config.init_embeddings else None
    largest = int(trace.token_ids.max(initial=-1))
    if table is not None and largest >= len(table):  # the traced model embeds every id it was fed
        raise ValueError(f"init_embeddings={config.init_embeddings} has {len(table)} token rows, but the trace holds "
                         f"token ids up to {largest}: it is not the traced model's; give that model's directory")
    vocab_size = config.vocab_size if config.vocab_size is not None else model_vocab_size(
        trace, config.init_embeddings, None if table is None else len(table))
    sizes = PredictorConfig(
        vocab_size=vocab_size, num_layers=trace.num_layers,
        num_experts=trace.num_experts, top_k=trace.top_k, d_model=config.d_model, d_ff=config.d_ff,
        heads=config.heads, encoder_layers=config.encoder_layers, decoder_layers=config.decoder_layers,
        dropout=config.dropout, token_features=0 if table is None else table.shape[1])
    net = _allocated(lambda: RouteNet(sizes), f"the network (d_model={config.d_model}, d_ff={config.d_ff})")
    if config.next_hidden:  # the head is made after the training: one of this size must fit now, or the run is lost
        outputs = len(config.next_windows) * trace.num_layers * trace.num_experts
        _new_head(config.d_model, config.next_hidden, outputs, "next_hidden")  # made and dropped
    if table is not None:
        _init_embeddings(net, table)
    run = _Run(net, config, train_set, val_set, rng, progress, deadline)
    history = run.fit()
    # the sequences, in order, identify the split: `fit_next_head` compares them to tell whether it redraws this one
    info = {"trained_on": trace.source, "sequences_digest": sequences_digest(examples), "model": trace.model,
            "tokens": trace.num_tokens, "train_sequences": len(train_set), "val_sequences": len(val_set),
            "parameters": run.parameters, "train_config": asdict(config), **history}
    predictor = RoutePredictor(net, expert_counts(trace), info)
    if config.next_hidden:
        left = None if deadline is None else max(0.0, deadline - time.monotonic()) / 60
        fit_next_head(predictor, trace, hidden=config.next_hidden, windows=config.next_windows,
                      epochs=config.next_epochs, seed=config.seed, val_fraction=config.val_fraction, progress=progress,
                      max_minutes=left)
    predictor.info["total_seconds"] = round(time.monotonic() - start, 1)  # `seconds`: the network's epochs alone
    if out is not None:
        predictor.save(out)
    return predictor


def fit_next_head(predictor: RoutePredictor, traces: Trace | Sequence[Trace], hidden: int = 768,
                  windows: Sequence[int] = NEXT_WINDOWS, epochs: int = 20, seed: int | None = None,
                  val_fraction: float | None = None, lr: float = 3e-3, batch: int = 1024, progress: bool = True,
                  max_minutes: float | None = None) -> dict[str, Any]:
    """Fit (or refit) the predictor's next-token head in place and return its training facts (also stored in
    `predictor.info["next_head"]`).

    The head is a small MLP on the decoder's output state of each token, trained to give, for each window of the
    tokens that follow it in its sequence (`windows`, by last offset: (1, 2, 4, 8) = t+1, t+2, any of t+3 … t+4, any
    of t+5 … t+8), which experts at least one of them routes to: BCE over known cells, a window whose first token
    lies past the sequence's end masked. The rest of the network is frozen, so the predictions for the tokens
    themselves do not change. The validation split is by sequence, as in `train`: `seed` and `val_fraction` default
    to those the network was trained with (`info["train_config"]`; 0 and 0.1 when not recorded), so that with the
    same traces in the same order the head is validated on sequences the network was not trained on. The epoch with
    the lowest validation loss is kept (the cache engine reads the head's output as probabilities). Its weights are
    then rounded to fp16, the precision `RoutePredictor.save` stores them in. With `max_minutes`, no epoch starts
    after that many minutes (the first always runs). A loss or weights that stop being finite raise a ValueError.
    """
    windows = check_windows(windows, training=True)
    if hidden < 1:
        raise ValueError(f"hidden={hidden} must be at least 1")
    _check_lr(lr)
    trained = predictor.info.get("train_config")
    trained = trained if isinstance(trained, dict) else {}
    seed = trained.get("seed", 0) if seed is None else seed
    val_fraction = trained.get("val_fraction", 0.1) if val_fraction is None else val_fraction
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or isinstance(val_fraction, bool) \
            or not isinstance(val_fraction, numbers.Real):  # a damaged config.json
        raise ValueError(f"seed {seed!r} or val_fraction {val_fraction!r} is not an integer and a number (read from "
                         "the predictor's train_config unless given); give both, or train the predictor again")
    _check_split(seed, val_fraction)
    start = time.monotonic()
    trace = concat_traces([traces] if isinstance(traces, Trace) else list(traces))
    check_fits(predictor, trace)
    examples = sequences(trace)
    digest = sequences_digest(examples)
    trained_on, trained_digest = predictor.info.get("trained_on"), predictor.info.get("sequences_digest")
    other = None
    if trained_digest is not None and trained_digest != digest:
        other = (f"these traces' sequences (digest {digest}) are not the ones the predictor was trained on, in that "
                 f"order ({trained_digest})")
    elif trained_digest is None and trained_on not in (None, trace.source):  # saved before the digest was recorded
        other = f"the predictor was trained on {trained_on!r}, these traces are {trace.source!r}"
    if trained.get("seed") == seed and other:  # the training split, redrawn
        warnings.warn(f"{other}: its validation split is drawn again, so the head may be validated on sequences the "
                      "network was trained on; give the same traces in the same order", stacklevel=2)
    net, c = predictor.net, predictor.config
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    train_set, val_set = _split(examples, val_fraction, rng)
    x, y, known = _next_pairs(net, train_set, windows)
    vx, vy, vknown = _next_pairs(net, val_set, windows)
    if len(vx) and not vknown.any():  # a loss over no cell would be 0.0, and the first epoch kept for good
        warnings.warn(f"the {len(vx)} held-out token pairs have no known next routes (every expert id is -1): there "
                      "is nothing to validate the next-token head on, so its last epoch is kept; choose another seed "
                      "to hold out others", stacklevel=2)
        vx, vy, vknown = vx[:0], vy[:0], vknown[:0]
    if not (torch.isfinite(x).all() and torch.isfinite(vx).all()):
        raise ValueError("the predictor's network gives decoder states that are not finite (its weights hold NaN or "
                         "inf: its training diverged): train the predictor again with a lower learning rate")
    if not len(x):
        if len(vx):
            raise ValueError(f"the sequences of two or more tokens all fall in the validation split ({len(val_set)} "
                             "held out): the next-token head has nothing to learn from; hold out fewer "
                             "(val_fraction=0 holds out none) or choose another seed")
        raise ValueError("the traces have no sequence of two or more tokens to learn the next token's routes from")
    head = _new_head(c.d_model, hidden, len(windows) * c.num_layers * c.num_experts, "hidden")
    optimizer = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.01)
    steps = epochs * math.ceil(len(x) / batch)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps, eta_min=lr * 0.05)
    best: dict[str, Any] = {"loss": math.inf, "epoch": -1, "state": None, "by_window": []}
    history = []
    stop_reason = "epochs"
    for epoch in tqdm(range(epochs), desc="next-token head", unit="epoch", disable=not progress):
        head.train()
        total = torch.zeros(())  # the epoch's summed loss, read once: a NaN stays NaN
        for rows in torch.randperm(len(x)).split(batch):
            loss = _masked_bce(head(x[rows]), y[rows].float(), known[rows].float())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            total += loss.detach()
        head.eval()
        with torch.no_grad():
            logits = head(vx).view(-1, len(windows), c.num_layers, c.num_experts) if len(vx) else None
            val_loss = float(_masked_bce(logits, vy.float(), vknown.float())) if len(vx) else None  # no val pairs
            by_window = [_recall_at_k(logits[:, k], vy[:, k].float(), vknown[:, k].float(), c.top_k)
                         for k in range(len(windows))] if len(vx) else []
        history.append({"epoch": epoch, "val_loss": None if val_loss is None else round(val_loss, 5),
                        "val_recall_by_window": [round(r, 4) for r in by_window]})
        _check_finite([float(total)] + ([] if val_loss is None else [val_loss]), head,
                      f"the next-token head's training diverged at epoch {epoch}", f"its learning rate ({lr})")
        if val_loss is None or val_loss < best["loss"]:
            best = {"loss": val_loss, "epoch": epoch, "state": copy.deepcopy(head.state_dict()),
                    "by_window": by_window}
        if max_minutes is not None and time.monotonic() - start > 60 * max_minutes:
            stop_reason = "time limit"
            break
    if best["state"] is None:  # no finite validation loss (the checks above stop such a run first)
        raise ValueError("no epoch of the next-token head had a finite validation loss, so there is no head to keep; "
                         f"lower its learning rate ({lr})")
    head.load_state_dict(best["state"])
    with torch.no_grad():  # files store the head in fp16: round it now, so a reloaded predictor gives the same output
        for p in head.parameters():
            p.copy_(p.half().float())
    net.config = replace(net.config, next_hidden=hidden, next_windows=windows)
    net.next_head = head.to(predictor.device).eval()
    facts = {"hidden": hidden, "windows": list(windows), "seed": seed, "val_fraction": val_fraction,
             "pairs": len(x), "val_pairs": len(vx),
             "best_epoch": best["epoch"], "best_val_loss": None if best["loss"] is None else round(best["loss"], 5),
             "best_val_recall_by_window": [round(r, 4) for r in best["by_window"]],
             "stopped_by": stop_reason, "seconds": round(time.monotonic() - start, 1), "trained_on": trace.source,
             "sequences_digest": digest, "history": history}
    predictor.info["next_head"] = facts
    log.info("next-token head: validation loss %s after %d epochs", facts["best_val_loss"], len(history))
    return facts


def _new_head(d_model: int, hidden: int, outputs: int, setting: str) -> nn.Module:
    """The next-token head's MLP, decoder state [.., D] → `outputs` logits; a size that cannot be allocated is a
    ValueError naming `setting`, the hidden width's name."""
    return _allocated(lambda: nn.Sequential(nn.Linear(d_model, hidden), nn.GELU(), nn.Linear(hidden, outputs)),
                      f"the next-token head ({setting}={hidden})")


def _allocated(make: Callable[[], nn.Module], what: str) -> nn.Module:
    """`make()`, with a failed allocation (sizes too large for this machine's memory) as a one-line ValueError."""
    try:
        return make()
    except (RuntimeError, MemoryError) as exc:  # torch's allocators raise RuntimeError, Python's MemoryError
        asked = re.search(r"tried to allocate ([\d.]+ ?\w+)", str(exc), re.IGNORECASE)
        detail = f"{asked.group(1)} asked for" if asked else (str(exc).splitlines() or [type(exc).__name__])[0][:120]
        raise ValueError(f"{what} cannot be allocated ({detail}): give smaller sizes") from None


@torch.no_grad()
def _next_pairs(net: RouteNet, examples: Sequence[SequenceExample], windows: tuple[int, ...],
                max_tokens: int = 8192) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(decoder state of each token [N, D], multi-hot routes of each window of the tokens after it [N, W, L, E]
    (uint8: any token of the window), known cells [N, W, L] (bool; False when the window's first token lies past the
    sequence's end)), over every token of `examples` with a successor."""
    net.eval()
    device = net.head.weight.device
    xs, ys, ks = [], [], []
    for group in length_batches(examples, max_tokens):
        batch = pad_batch([examples[i] for i in group], net.config.num_experts)
        states = net.decode_states(batch["decoder_ids"].to(device), batch["decoder_mask"].to(device),
                                   net.cross_kv(net.encode(batch["encoder_ids"].to(device),
                                                           batch["encoder_mask"].to(device))),
                                   batch["encoder_mask"].to(device)).float().cpu()
        targets = batch["targets"].to(torch.uint8)
        known = batch["known"].bool() & batch["decoder_mask"][..., None].bool()
        t = targets.shape[1]
        shown = targets * known[..., None]  # [B, T, L, E]: the routes of known cells
        win_t = torch.zeros(*targets.shape[:2], len(windows), *targets.shape[2:], dtype=torch.uint8)  # [B, T, W, L, E]
        win_k = torch.zeros(*known.shape[:2], len(windows), known.shape[2], dtype=torch.bool)  # [B, T, W, L]
        for w, (a, b) in enumerate(zip((0,) + windows[:-1], windows)):  # offsets a+1 … b, those within the batch
            for k in range(a + 1, min(b, t - 1) + 1):  # never more than the batch's tokens, however far b is
                win_t[:, :t - k, w] |= shown[:, k:]
            if a + 1 < t:  # a window's cells are known where its first token's are
                win_k[:, :t - a - 1, w] = known[:, a + 1:]
        pair = (batch["decoder_mask"][:, :-1] * batch["decoder_mask"][:, 1:]).bool()  # [B, T-1]: has a successor
        xs.append(states[:, :-1][pair])
        ys.append(win_t[:, :-1][pair])
        ks.append(win_k[:, :-1][pair])
    if not xs:
        return torch.zeros(0, net.config.d_model), torch.zeros(0), torch.zeros(0)
    return torch.cat(xs), torch.cat(ys), torch.cat(ks)


def _check_finite(losses: Sequence[float], net: nn.Module, what: str, setting: str) -> None:
    """Stop a run whose losses or weights are no longer finite: every later epoch would be NaN too, and NaN weights
    would otherwise be kept and saved."""
    for loss in losses:
        if not math.isfinite(loss):
            raise ValueError(f"{what} (loss {loss}); lower {setting}")
    if not all(bool(torch.isfinite(p).all()) for p in net.parameters()):
        raise ValueError(f"{what} (weights not finite); lower {setting}")


def _masked_bce(logits: torch.Tensor, targets: torch.Tensor, known: torch.Tensor) -> torch.Tensor:
    """Mean BCE over known (token, layer) cells; logits of any shape holding targets' elements, targets [..., L, E],
    known [..., L]."""
    bce = F.binary_cross_entropy_with_logits(logits.reshape(targets.shape), targets, reduction="none").mean(-1)
    return (bce * known).sum() / known.sum().clamp(min=1)


def _recall_at_k(logits: torch.Tensor, targets: torch.Tensor, known: torch.Tensor, k: int) -> float:
    top = logits.reshape(targets.shape).topk(k, dim=-1).indices
    found = targets.gather(-1, top).sum(-1) / targets.sum(-1).clamp(min=1)
    return float((found * known).sum() / known.sum().clamp(min=1))


def load_embedding_table(path: Path) -> torch.Tensor:
    """[V, H] input embeddings of a model directory (every *.safetensors in it) or of one safetensors file."""
    from safetensors import SafetensorError, safe_open

    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    if name.endswith(_EMBEDDING_NAMES):
                        return f.get_tensor(name).float()
        except SafetensorError as exc:
            if path.is_dir():  # one of the model's own weights files
                raise ValueError(f"{file} cannot be read ({first_line(exc)}); a weights file of {path} is damaged "
                                 "or incomplete: download or save the model again") from exc
            raise ValueError(f"{file} is not a safetensors file ({exc}); pass the model's directory") from exc
    raise ValueError(f"no input embedding table ({', '.join(_EMBEDDING_NAMES)}) in {path}")


_EMBEDDING_NAMES = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight")


@torch.no_grad()
def _init_embeddings(net: RouteNet, table: torch.Tensor) -> None:
    """Fill `net.features` [rows, F] from the model's embeddings [V, F] (ids that share a row average theirs)."""
    c = net.config
    if len(table) > c.vocab_size:
        raise ValueError(f"the embedding table has {len(table)} tokens but the predictor's vocabulary is "
                         f"{c.vocab_size}: is it the traced model's?")
    rows = net.embedding_rows(torch.arange(len(table)))
    summed = torch.zeros(c.embeddings, table.shape[1]).index_add_(0, rows, table)
    counts = torch.zeros(c.embeddings).index_add_(0, rows, torch.ones(len(table)))
    net.features.copy_(summed / counts.clamp(min=1)[:, None])


def _split(examples: list[SequenceExample], fraction: float, rng: np.random.Generator
           ) -> tuple[list[SequenceExample], list[SequenceExample]]:
    order = rng.permutation(len(examples))
    n_val = min(int(math.ceil(fraction * len(examples))), len(examples) - 1) if fraction > 0 else 0
    val = set(order[:n_val].tolist())
    return ([e for i, e in enumerate(examples) if i not in val], [e for i, e in enumerate(examples) if i in val])


class _Run:
    """One training run: optimizer, schedule, epochs, validation and the best weights."""

    def __init__(self, net: RouteNet, config: TrainConfig, train_set: list[SequenceExample],
                 val_set: list[SequenceExample], rng: np.random.Generator, progress: bool,
                 deadline: float | None = None) -> None:
        self.net, self.config, self.train_set, self.val_set, self.rng = net, config, train_set, val_set, rng
        self.progress, self.deadline = progress, deadline  # deadline: time.monotonic() after which no epoch starts
        self.parameters = sum(p.numel() for p in net.parameters())
        decay = [p for n, p in net.named_parameters() if p.dim() >= 2 and "bias." not in n]
        rest = [p for n, p in net.named_parameters() if not (p.dim() >= 2 and "bias." not in n)]
        self.optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": config.weight_decay},
                                            {"params": rest, "weight_decay": 0.0}], lr=config.lr)
        # the schedule's length, planned from un-jittered batches; an epoch's jittered ones may be a few more (the
        # progress bar follows them), and the schedule keeps its floor for those
        self.steps_per_epoch = len(length_batches(train_set, config.batch_tokens))
        self.total_steps = self.steps_per_epoch * config.epochs
        self.warmup = max(1, int(config.warmup_fraction * self.total_steps))
        self.step = 0

    def lr_at(self, step: int) -> float:
        c = self.config
        if step < self.warmup:
            return c.lr * (step + 1) / self.warmup
        done = min(1.0, (step - self.warmup) / max(1, self.total_steps - self.warmup))
        return c.lr * (c.min_lr_ratio + (1 - c.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * done)))

    def fit(self) -> dict[str, Any]:
        c = self.config
        start = time.monotonic()
        best = {"val_recall": -1.0, "epoch": -1, "state": None}
        epochs: list[dict[str, float]] = []
        bar = tqdm(total=self.total_steps, desc="training predictor", unit="step", disable=not self.progress)
        stop_reason = "epochs"
        try:
            for epoch in range(c.epochs):
                loss = self.train_epoch(bar, epoch)
                val_loss, val_recall = self.validate() if self.val_set else (float("nan"), float("nan"))
                scored = bool(self.val_set)  # no validation set: None in the history (JSON null), not NaN
                # a diverged epoch is never kept (its recall may still beat the best: top-k of NaN logits); without a
                # validation set, one training batch tells whether the epoch's last step left a finite network
                _check_finite([loss, val_loss if scored else self.probe()], self.net,
                              f"training diverged at epoch {epoch}", f"lr={c.lr}")
                epochs.append({"epoch": epoch, "train_loss": round(loss, 5),
                               "val_loss": round(val_loss, 5) if scored else None,
                               "val_recall_at_k": round(val_recall, 4) if scored else None,
                               "lr": self.lr_at(self.step - 1)})
                bar.set_postfix(loss=f"{loss:.4f}", val_recall=f"{val_recall:.3f}")
                log.info("epoch %d: train loss %.4f, val loss %.4f, val recall@k %.4f", epoch, loss, val_loss,
                         val_recall)
                if not self.val_set or val_recall > best["val_recall"]:
                    best = {"val_recall": val_recall, "epoch": epoch, "state": copy.deepcopy(self.net.state_dict())}
                elif epoch - best["epoch"] >= c.patience:
                    stop_reason = "early stop"
                    break
                if self.deadline is not None and time.monotonic() > self.deadline:
                    stop_reason = "time limit"
                    break
        finally:
            bar.close()
        self.net.load_state_dict(best["state"])
        self.net.eval()
        recall = best["val_recall"] if self.val_set else None
        return {"epochs_run": len(epochs), "best_epoch": best["epoch"], "best_val_recall_at_k": recall,
                "stopped_by": stop_reason, "seconds": round(time.monotonic() - start, 1), "history": epochs}

    def train_epoch(self, bar: tqdm, epoch: int) -> float:
        """The epoch's mean training loss; a step whose loss is not finite ends it early (and `fit` the run)."""
        self.net.train()
        total, count = 0.0, 0
        groups = length_batches(self.train_set, self.config.batch_tokens, self.rng)
        # jittered lengths can take a batch or two more than planned: the bar counts this epoch's own, and the
        # plan for the epochs still to come (the learning-rate schedule keeps its planned length)
        bar.total = self.step + len(groups) + (self.config.epochs - epoch - 1) * self.steps_per_epoch
        bar.refresh()
        for group in groups:
            batch = pad_batch([self.train_set[i] for i in group], self.net.config.num_experts)
            for g in self.optimizer.param_groups:
                g["lr"] = self.lr_at(self.step)
            loss = _loss(self.net, batch)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.net.parameters(), 1.0)
            self.optimizer.step()
            self.step += 1
            value = loss.item()  # host sync once per step, for the running mean
            total, count = total + value, count + 1
            bar.update(1)
            if not math.isfinite(value):
                return value
        return total / max(count, 1)

    @torch.no_grad()
    def probe(self) -> float:
        """The loss of the training set's first (un-jittered) batch under the current weights."""
        self.net.eval()
        group = length_batches(self.train_set, self.config.batch_tokens)[0]
        return float(_loss(self.net, pad_batch([self.train_set[i] for i in group], self.net.config.num_experts)))

    @torch.no_grad()
    def validate(self) -> tuple[float, float]:
        self.net.eval()
        k = self.net.config.top_k
        loss_sum = hits = cells = 0.0
        for group in length_batches(self.val_set, self.config.batch_tokens):
            batch = pad_batch([self.val_set[i] for i in group], self.net.config.num_experts)
            logits = self.net(batch["encoder_ids"], batch["encoder_mask"], batch["decoder_ids"],
                              batch["decoder_mask"])
            known = batch["known"] * batch["decoder_mask"][..., None]  # [B, T, L]
            loss_sum += float(_masked_bce(logits, batch["targets"], known)) * float(known.sum())
            hits += _recall_at_k(logits, batch["targets"], known, k) * float(known.sum())
            cells += float(known.sum())
        return loss_sum / max(cells, 1), hits / max(cells, 1)


def _loss(net: RouteNet, batch: dict[str, torch.Tensor], logits: torch.Tensor | None = None) -> torch.Tensor:
    """Mean BCE over the experts of known, unpadded (token, layer) cells."""
    if logits is None:
        logits = net(batch["encoder_ids"], batch["encoder_mask"], batch["decoder_ids"], batch["decoder_mask"])
    return _masked_bce(logits, batch["targets"], batch["known"] * batch["decoder_mask"][..., None])


def with_overrides(config: TrainConfig, **overrides: Any) -> TrainConfig:
    """`config` with the given fields replaced (None values are ignored)."""
    return replace(config, **{k: v for k, v in overrides.items() if v is not None})
