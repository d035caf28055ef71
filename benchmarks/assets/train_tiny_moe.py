"""Train the small Mixtral-style MoE shipped in ``expertflow/assets/tiny-moe``, and its tokenizer.

Owns: the tokenizer training, the token streams, the training loop with a per-layer load-balancing loss, held-out
early stopping, checkpoints under ``--out`` (resumed when present), the loss curve, and the export in bf16.
Does not know how routing is evaluated (``eval_tiny_moe.py``) or how the data files are read (``build_prompts.py``).

Why a per-layer balancing loss: transformers' ``load_balancing_loss_func`` pools the counts of all layers before it
normalises, so only the aggregate is balanced and single layers can still collapse onto a few experts. Here the
Switch loss is computed for every layer separately and the mean is added to the language-model loss.

Reproducible: every batch is a function of (seed, step) only and the model has no dropout, so a resumed run and a
fresh run with the same seed produce the same loss curve (one CPU thread; ``--max-minutes`` is the only exception).

Usage: python benchmarks/assets/train_tiny_moe.py [--out runs/tiny-moe] [--ship expertflow/assets/tiny-moe]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

import build_prompts

log = logging.getLogger("train_tiny_moe")

REPO = build_prompts.REPO
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")  # ids 0, 1, 2


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 0
    vocab_size: int = 3072
    layers: int = 6
    hidden: int = 128
    expert_hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    experts: int = 32
    top_k: int = 4
    seq_len: int = 512
    batch: int = 8
    steps: int = 1800
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    balance_coef: float = 0.05
    eval_every: int = 50
    eval_windows: int = 32
    ckpt_every: int = 50
    patience: int = 6  # evaluations without a new best held-out loss before stopping
    max_minutes: float = 40.0


def model_config(cfg: TrainConfig):
    from transformers import MixtralConfig

    return MixtralConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden,
        intermediate_size=cfg.expert_hidden,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        num_local_experts=cfg.experts,
        num_experts_per_tok=cfg.top_k,
        max_position_embeddings=4 * cfg.seq_len,
        tie_word_embeddings=True,
        router_aux_loss_coef=cfg.balance_coef,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


# ---- tokenizer and token streams ----


def train_tokenizer(texts: list[str], vocab_size: int, max_length: int):
    """A byte-level BPE over ``texts``; returns a transformers tokenizer that prepends ``<s>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", SPECIAL_TOKENS.index("<s>"))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", model_max_length=max_length
    )


def encode_documents(tokenizer, texts: list[str]) -> np.ndarray:
    """One stream ``<s> doc </s> <s> doc </s> ...``; uint16 because the vocabulary is small."""
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    encoded = tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
    pieces = [np.array([bos, *e.ids, eos], dtype=np.uint16) for e in encoded]
    return np.concatenate(pieces)


def prepare_data(out: Path, data: Path, cfg: TrainConfig):
    """Tokenizer and the train/test token streams, built once and cached in ``out``."""
    from transformers import AutoTokenizer

    tok_dir = out / "tokenizer"
    if not tok_dir.is_dir():
        log.info("training the tokenizer (vocab %d)", cfg.vocab_size)
        train_texts = [text for _, text in build_prompts.training_documents(data, "train")]
        train_tokenizer(train_texts, cfg.vocab_size, 4 * cfg.seq_len).save_pretrained(tok_dir)
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    streams = {}
    for split in ("train", "test"):
        path = out / f"tokens-{split}.npy"
        if not path.exists():
            texts = [text for _, text in build_prompts.training_documents(data, split)]
            np.save(path, encode_documents(tokenizer, texts))
        streams[split] = np.load(path)
    return tokenizer, streams


def batch_at(tokens: np.ndarray, step: int, cfg: TrainConfig) -> torch.Tensor:
    """Random windows for ``step``, a pure function of (seed, step) so that resuming replays the same batches."""
    rng = np.random.default_rng([cfg.seed, step])
    starts = rng.integers(0, len(tokens) - cfg.seq_len, size=cfg.batch)
    return torch.from_numpy(np.stack([tokens[s : s + cfg.seq_len] for s in starts]).astype(np.int64))


def eval_batches(tokens: np.ndarray, cfg: TrainConfig) -> list[torch.Tensor]:
    """Fixed, evenly spaced held-out windows."""
    starts = np.linspace(0, len(tokens) - cfg.seq_len - 1, cfg.eval_windows).astype(np.int64)
    windows = np.stack([tokens[s : s + cfg.seq_len] for s in starts]).astype(np.int64)
    return list(torch.from_numpy(windows).split(cfg.batch))


# ---- losses ----


def per_layer_balance_loss(router_logits: tuple[torch.Tensor, ...], top_k: int) -> torch.Tensor:
    """Mean over layers of the Switch loss E * sum_e f_e * P_e (f: share of top-k picks, P: mean prob).

    Normalised like transformers' loss so that a perfectly balanced layer scores ``top_k``.
    """
    losses = []
    for logits in router_logits:  # [T, E] per layer
        probs = logits.float().softmax(dim=-1)
        num_experts = probs.shape[-1]
        picks = probs.topk(top_k, dim=-1).indices  # [T, k]
        counts = torch.zeros(num_experts, device=probs.device).index_add_(
            0, picks.reshape(-1), torch.ones(picks.numel(), device=probs.device)
        )
        share = counts / probs.shape[0]  # sums to top_k
        losses.append(num_experts * torch.sum(share * probs.mean(dim=0)))
    return torch.stack(losses).mean()


def lm_loss(model, batch: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    out = model(input_ids=batch, output_router_logits=True, use_cache=False)
    logits = out.logits[:, :-1].float()  # [B, S-1, V]
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
    return loss, out.router_logits


@torch.no_grad()
def heldout_stats(model, batches: list[torch.Tensor]) -> dict[str, float]:
    """Held-out LM loss and the median over layers of max/mean expert load, on the fixed windows."""
    model.eval()
    losses, counts = [], None
    for batch in batches:
        loss, router_logits = lm_loss(model, batch)
        losses.append(loss.item())
        k, num_experts = model.config.num_experts_per_tok, model.config.num_local_experts
        picks = [r.topk(k, dim=-1).indices.reshape(-1) for r in router_logits]  # [T*k] per layer
        layer_counts = torch.stack([torch.bincount(p, minlength=num_experts) for p in picks])  # [L, E]
        counts = layer_counts if counts is None else counts + layer_counts
    model.train()
    max_over_mean = (counts.max(dim=1).values / counts.float().mean(dim=1)).median().item()
    return {"heldout_loss": float(np.mean(losses)), "max_over_mean": max_over_mean}


def learning_rate(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


# ---- checkpoints, the loop, export ----


@dataclass
class RunState:
    step: int = 0
    elapsed_s: float = 0.0
    best_loss: float = math.inf
    best_step: int = -1
    bad_evals: int = 0
    stopped: str = ""  # why the loop ended: "", "steps", "early-stop" or "time"


def save_checkpoint(path: Path, model, optim, state: RunState, cfg: TrainConfig) -> None:
    tmp = path.with_suffix(".tmp")
    payload = {"model": model.state_dict(), "optim": optim.state_dict(), "state": asdict(state), "config": asdict(cfg)}
    torch.save(payload, tmp)
    os.replace(tmp, path)  # a crash mid-write leaves the previous checkpoint intact


def load_checkpoint(path: Path, model, optim, cfg: TrainConfig) -> RunState:
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    if ckpt["config"] != asdict(cfg):
        changed = {k: (v, ckpt["config"].get(k)) for k, v in asdict(cfg).items() if ckpt["config"].get(k) != v}
        raise SystemExit(f"{path} was written with other settings {changed} (now, then); choose another --out")
    model.load_state_dict(ckpt["model"])
    optim.load_state_dict(ckpt["optim"])
    return RunState(**ckpt["state"])


def read_log(path: Path, upto_step: int) -> list[dict]:
    """Log rows of steps already covered by the checkpoint; later rows are replayed after a resume."""
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r["step"] <= upto_step]


def train_step(model, optim, batch: torch.Tensor, lr: float, cfg: TrainConfig) -> dict:
    for group in optim.param_groups:
        group["lr"] = lr
    loss, router_logits = lm_loss(model, batch)
    balance = per_layer_balance_loss(router_logits, cfg.top_k)
    (loss + cfg.balance_coef * balance).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optim.step()
    optim.zero_grad(set_to_none=True)
    return {"loss": loss.item(), "balance": balance.item(), "lr": lr}


def evaluate_and_track(model, batches, state: RunState, out: Path) -> dict:
    """Held-out figures; keeps the best weights in ``best.pt`` and counts evaluations without improvement."""
    row = {"step": state.step, **heldout_stats(model, batches)}
    if row["heldout_loss"] < state.best_loss:
        state.best_loss, state.best_step, state.bad_evals = row["heldout_loss"], state.step, 0
        torch.save(model.state_dict(), out / "best.pt")
    else:
        state.bad_evals += 1
    return row


def train(model, optim, streams: dict, cfg: TrainConfig, state: RunState, out: Path) -> RunState:
    batches = eval_batches(streams["test"], cfg)
    rows = read_log(out / "log.jsonl", state.step)
    (out / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    clock = time.monotonic() - state.elapsed_s
    bar = tqdm(total=cfg.steps, initial=state.step, mininterval=5, desc="train")
    with (out / "log.jsonl").open("a") as logf:
        while not state.stopped:
            batch = batch_at(streams["train"], state.step, cfg)
            row = train_step(model, optim, batch, learning_rate(state.step, cfg), cfg)
            state.step += 1
            state.elapsed_s = time.monotonic() - clock
            logf.write(json.dumps({"step": state.step, **row}) + "\n")
            if state.step % cfg.eval_every == 0:
                ev = evaluate_and_track(model, batches, state, out)
                logf.write(json.dumps(ev) + "\n")
                bar.set_postfix(loss=row["loss"], heldout=ev["heldout_loss"], max_over_mean=ev["max_over_mean"])
            if state.step >= cfg.steps:
                state.stopped = "steps"
            elif state.bad_evals >= cfg.patience:
                state.stopped = "early-stop"
            elif state.elapsed_s > 60 * cfg.max_minutes:
                state.stopped = "time"
            if state.stopped or state.step % cfg.ckpt_every == 0:
                logf.flush()
                save_checkpoint(out / "ckpt.pt", model, optim, state, cfg)
            bar.update(1)
    bar.close()
    return state


def plot_loss_curve(log_path: Path, png: Path, best_step: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in log_path.read_text().splitlines()]
    train_rows = [r for r in rows if "loss" in r]
    eval_rows = [r for r in rows if "heldout_loss" in r]
    steps, loss = np.array([r["step"] for r in train_rows]), np.array([r["loss"] for r in train_rows])
    eval_steps = [r["step"] for r in eval_rows]
    fig, (ax_lm, ax_bal) = plt.subplots(1, 2, figsize=(10, 3.6))
    ax_lm.plot(steps, loss, color="0.8", lw=0.6, label="train (per step)")
    if len(loss) >= 25:
        mean25 = np.convolve(loss, np.ones(25) / 25, mode="valid")
        ax_lm.plot(steps[24:], mean25, color="C0", label="train (25-step mean)")
    ax_lm.plot(eval_steps, [r["heldout_loss"] for r in eval_rows], "o-", color="C3", ms=3, label="held-out")
    ax_lm.axvline(best_step, color="0.5", ls="--", lw=0.8, label=f"shipped (step {best_step})")
    top = float(loss[5:].max()) if len(loss) > 5 else None  # skip the first steps' ~log(vocab) losses
    ax_lm.set(xlabel="step", ylabel="cross-entropy (nats/token)", title="language-model loss", ylim=(None, top))
    ax_lm.legend(fontsize=8)
    balance = [r["balance"] for r in train_rows]
    ax_bal.plot(steps, balance, color="C2", lw=0.8, label="per-layer balance loss (top-k = even)")
    max_over_mean = [r["max_over_mean"] for r in eval_rows]
    ax_bal.plot(eval_steps, max_over_mean, "o-", color="C1", ms=3, label="held-out max/mean load (median layer)")
    ax_bal.set(xlabel="step", title="routing balance")
    ax_bal.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def export(model, tokenizer, out: Path, ship: Path, state: RunState) -> None:
    """The best weights in bf16, the tokenizer and the loss curve, into ``ship``."""
    model.load_state_dict(torch.load(out / "best.pt", map_location="cpu", weights_only=True))
    ship.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(ship)
    tokenizer.save_pretrained(ship)
    plot_loss_curve(out / "log.jsonl", ship / "loss_curve.png", state.best_step)
    for path in ship.iterdir():
        path.chmod(0o644)  # the weights file is written owner-only; installed package data must be readable by all


def parse_args() -> tuple[argparse.Namespace, TrainConfig]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=build_prompts.DEFAULT_DATA, help="the shared/data/text folder")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "tiny-moe", help="checkpoints; resumed if present")
    parser.add_argument("--ship", type=Path, default=REPO / "expertflow" / "assets" / "tiny-moe", help="export folder")
    parser.add_argument("--no-export", action="store_true", help="train only (e.g. for a reproducibility check)")
    for field, default in asdict(TrainConfig()).items():
        parser.add_argument(f"--{field.replace('_', '-')}", type=type(default), default=default)
    args = parser.parse_args()
    cfg = TrainConfig(**{f: getattr(args, f) for f in asdict(TrainConfig())})
    return args, cfg


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    os.environ.setdefault("RAYON_NUM_THREADS", "1")  # the tokenizer's trainer and encoder, also one core
    torch.set_num_threads(1)
    args, cfg = parse_args()
    from transformers import MixtralForCausalLM

    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer, streams = prepare_data(args.out, args.data, cfg)
    log.info("tokens: train %d, held-out %d", len(streams["train"]), len(streams["test"]))
    torch.manual_seed(cfg.seed)
    model = MixtralForCausalLM(model_config(cfg))
    model.set_experts_implementation("eager")  # fastest of the built-in ones on one CPU thread
    optim = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    ckpt = args.out / "ckpt.pt"
    state = load_checkpoint(ckpt, model, optim, cfg) if ckpt.exists() else RunState()
    if state.step:
        log.info("resuming at step %d (%s)", state.step, state.stopped or "running")
    if not state.stopped:
        state = train(model, optim, streams, cfg, state, args.out)
    if not args.no_export:
        export(model, tokenizer, args.out, args.ship, state)
    summary = {**asdict(state), "best_heldout_ppl": math.exp(state.best_loss), "params": model.num_parameters()}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
