"""Offload the experts of the built-in tiny MoE, generate, print cache statistics, and restore the model.

Run: python examples/offload_generate.py [--slots N] [--policy lru|lru-layer|lfu|lookahead|prev-step|expertflow]
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoTokenizer

import expertflow
from expertflow.config import POLICIES
from expertflow.models import tiny_moe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--slots", type=int, default=48, help="expert slots on the device (all layers)")
    parser.add_argument("--policy", default="lru", choices=POLICIES, help="cache policy (default: %(default)s)")
    args = parser.parse_args()
    if args.slots < 1:
        parser.error(f"--slots {args.slots} must be at least 1")

    model = tiny_moe(dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model.name_or_path)
    inputs = tokenizer(["Once upon a time"], return_tensors="pt")

    expertflow.wrap(model, cache_slots=args.slots, policy=args.policy)
    out = model.generate(**inputs, max_new_tokens=24, do_sample=False)
    print(tokenizer.decode(out[0], skip_special_tokens=True))
    stats = expertflow.stats(model)
    print(f"hit rate {stats.hit_rate:.3f}, {stats.loads} expert loads, {stats.bytes_to_device / 1e6:.1f} MB copied")
    expertflow.unwrap(model)


if __name__ == "__main__":
    main()
