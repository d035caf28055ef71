"""What wrapping costs when every expert fits: the built-in tiny MoE generating held-out prompts unwrapped and
wrapped with a slot for every expert (no link emulation; after the warm-up nothing is copied), side by side, per
policy and batch size.

What remains is the runtime's own work per MoE layer: reading the routes back, slot bookkeeping, the policy's
decisions, one expert at a time instead of transformers' all-experts kernel, and for `expertflow` the route
predictor. Each configuration is timed `--repeats` times a side after a warm-up generation, alternating between an
unwrapped copy of the model and the wrapped model so that a slow stretch of the machine hits both; the medians are
reported. Prints one JSON object per (batch, policy) and exits 1 if any wrapped run's tokens (the warm-up's included)
differ from the unwrapped model's.
Usage: python benchmarks/overhead.py [--batch 1,16] [--policy lru,lfu,expertflow] [--max-new-tokens 32]
                                     [--repeats 9] [--threads 1]
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import time

import torch

import expertflow
from expertflow.commands import batch_sizes, check_positive, check_threads
from expertflow.config import POLICIES
from expertflow.demo import load_demo_model
from expertflow.models import load_prompts

DEFAULT_POLICIES = ("lru", "lru-layer", "lfu", "lookahead", "prev-step", "expertflow")


def _policies(text: str) -> list[str]:
    policies = list(dict.fromkeys(p.strip() for p in text.split(",") if p.strip()))
    if not policies:
        raise ValueError(f"--policy {text!r}: give at least one policy, e.g. --policy lru,expertflow")
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise ValueError(f"--policy {text}: unknown {', '.join(unknown)}; choose from {', '.join(POLICIES)}")
    return policies


def _generate(model, inputs: dict, new_tokens: int) -> tuple[torch.Tensor, float]:
    start = time.perf_counter()
    out = model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    return out, time.perf_counter() - start


def measure(model, inputs: dict, policy: str, slots: int, predictor: str | None, new_tokens: int,
            repeats: int) -> dict:
    """Timed runs alternate between an unwrapped copy and the wrapped model, so that a slow stretch of the machine
    hits both sides; per side the median."""
    plain_model = copy.deepcopy(model)
    reference, _ = _generate(plain_model, inputs, new_tokens)  # also the unwrapped warm-up
    plain, wrapped = [], []
    expertflow.wrap(model, cache_slots=slots, policy=policy, device="cpu",
                    predictor=predictor if policy == "expertflow" else None)
    try:
        out, _ = _generate(model, inputs, new_tokens)  # warm-up: loads every expert these prompts route to
        same = bool(torch.equal(out, reference))  # the only run that copies experts: its tokens count too
        stats = expertflow.stats(model)
        stats.reset()
        for _ in range(repeats):
            plain.append(_generate(plain_model, inputs, new_tokens)[1])
            out, seconds = _generate(model, inputs, new_tokens)
            wrapped.append(seconds)
            same &= bool(torch.equal(out, reference))
        snapshot = stats.copy()
    finally:
        expertflow.unwrap(model)
    plain_s, wrapped_s = statistics.median(plain), statistics.median(wrapped)
    return {"policy": policy, "unwrapped_ms_per_step": round(1000 * plain_s / new_tokens, 3),
            "wrapped_ms_per_step": round(1000 * wrapped_s / new_tokens, 3),
            "wrapped_vs_unwrapped": round(wrapped_s / plain_s, 3),
            "predictor_ms_per_step": round(1000 * snapshot.predictor_s / max(snapshot.steps, 1), 3),
            "loads_after_warm_up": snapshot.loads, "same_tokens": same}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=batch_sizes, default="1,16", metavar="B[,B...]",
                        help="batch sizes (default 1,16)")
    default = "all of them" if tuple(POLICIES) == DEFAULT_POLICIES else ",".join(DEFAULT_POLICIES)
    parser.add_argument("--policy", default=",".join(DEFAULT_POLICIES), metavar="P[,P...]",
                        help=f"policies of the wrapped runs, comma-separated, from: {', '.join(POLICIES)} (default: "
                        f"{default})")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="tokens generated per run (default 32)")
    parser.add_argument("--repeats", type=int, default=9,
                        help="timed generations per configuration and side (default 9)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    args = parser.parse_args()
    try:
        for flag in ("max_new_tokens", "repeats"):
            check_positive(getattr(args, flag), "--" + flag.replace("_", "-"), integer=True)
        check_threads(args.threads)
        policies = _policies(args.policy)
    except ValueError as exc:
        parser.error(str(exc))
    torch.set_num_threads(args.threads)
    model, tokenizer, description = load_demo_model(None)
    if tokenizer is None:
        raise SystemExit("the built-in tiny MoE is not installed (expertflow/assets/tiny-moe)")
    predictor = None
    if "expertflow" in policies:
        from expertflow.predictor import default_predictor_path

        if not (default_predictor_path() / "model.safetensors").exists():
            raise SystemExit("--policy expertflow needs the built-in route predictor, which is not installed")
        predictor = str(default_predictor_path())
    from expertflow.adapters import find_adapter

    slots = sum(layer.num_experts for layer in find_adapter(model)[1])
    failed = False
    tokenizer.padding_side = "left"
    rows = load_prompts(split="test")
    for batch in args.batch:  # repeats already dropped by batch_sizes
        prompts = [rows[i * len(rows) // batch]["prompt"] for i in range(batch)]  # spread over the tasks
        inputs = dict(tokenizer(prompts, return_tensors="pt", padding=True, truncation=True, max_length=128))
        for policy in policies:
            row = measure(model, inputs, policy, slots, predictor, args.max_new_tokens, args.repeats)
            row = {"benchmark": "overhead", "model": description, "batch": int(inputs["input_ids"].shape[0]),
                   "cache_slots": slots, "max_new_tokens": args.max_new_tokens, "threads": args.threads,
                   "device": f"cpu ({platform.machine()})", **row}
            failed |= not row["same_tokens"]
            print(json.dumps(row), flush=True)
    if failed:
        print("error: a wrapped run's tokens differ from the unwrapped model's", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
