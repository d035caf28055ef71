"""GPU throughput: a Mixtral-like model generated unoffloaded on the GPU and wrapped at several cache sizes.

Prints one JSON object per run (tokens/s, hit rate, loads per generated token, bytes held on the GPU). Needs CUDA.
Exits with status 1 when a wrapped run gave other tokens than the unoffloaded model or its counters do not add up
(hits + misses = needs, loads = on-demand loads + prefetches, no more on-demand loads than misses), naming the rows.
Each timed run follows a warm-up generation on other random ids; a wrapped model's counters are reset after it, so
they count the timed run only, which starts from the cache the warm-up left (as a server's would). The unoffloaded model
is timed with transformers' `grouped_mm` experts and with `eager` ones; wrapped runs are compared token for token
with the `eager` one, whose per-expert operations the runtime follows (in bf16 the two paths differ from each other).
Usage: python benchmarks/gpu_bench.py [--layers 8] [--hidden 1024] [--experts 8] [--batch 1,16] [--new-tokens 32]
       [--policies lru-layer,lru,lfu] [--fractions 0.25,0.5]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time

import torch

import expertflow
from expertflow import sim
from expertflow.commands import check_positive
from expertflow.config import POLICIES
from expertflow.runtime import runtime_of


TOP_K, HEADS = 2, 16  # the model's routing and attention heads (fixed; the flags size the rest)


def build(layers: int, hidden: int, experts: int):
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=4096, hidden_size=hidden, intermediate_size=int(3.5 * hidden),
                           num_hidden_layers=layers, num_attention_heads=HEADS, num_key_value_heads=4,
                           num_local_experts=experts, num_experts_per_tok=TOP_K, max_position_embeddings=1024)
    model = MixtralForCausalLM(config).to(torch.bfloat16).eval()
    model.set_experts_implementation("eager")
    return model


def timed(model, inputs, new_tokens: int, after_warmup=None) -> tuple[torch.Tensor, float]:
    generator = torch.Generator().manual_seed(1)
    other = torch.randint(3, 4096, inputs["input_ids"].shape, generator=generator).to(inputs["input_ids"].device)
    model.generate(input_ids=other, attention_mask=torch.ones_like(other), max_new_tokens=2, do_sample=False)
    torch.cuda.synchronize()
    if after_warmup is not None:
        after_warmup()
    start = time.perf_counter()
    out = model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    torch.cuda.synchronize()  # host sync: end of the timed region
    return out, time.perf_counter() - start


def _check(args: argparse.Namespace) -> tuple[list[int], list[float], list[str]]:
    """Batch sizes, cache fractions and policies from the flags; ValueError naming the flag for a bad one."""
    for flag in ("layers", "hidden", "experts", "new_tokens"):
        check_positive(getattr(args, flag), "--" + flag.replace("_", "-"), integer=True)
    if args.experts < TOP_K:
        raise ValueError(f"--experts {args.experts}: the model routes each token to {TOP_K} experts; give at least "
                         f"{TOP_K}")
    if args.hidden % (2 * HEADS):  # rotary embeddings rotate pairs of a head's channels
        raise ValueError(f"--hidden {args.hidden}: the model has {HEADS} attention heads of an even size; give a "
                         f"multiple of {2 * HEADS}")
    try:
        sizes = [int(b) for b in args.batch.split(",")]
        fractions = [float(f) for f in args.fractions.split(",")]
    except ValueError:
        raise ValueError(f"--batch {args.batch!r} / --fractions {args.fractions!r}: give comma-separated numbers such "
                         "as 1,16 and 0.25,0.5") from None
    if not all(b >= 1 for b in sizes):
        raise ValueError(f"--batch {args.batch}: batch sizes must be at least 1")
    if not all(0 < f <= 1 for f in fractions):
        raise ValueError(f"--fractions {args.fractions}: cache fractions must be in (0, 1]")
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    usable = [p for p in POLICIES if p != "expertflow"]  # no predictor for this random model
    if not policies or any(p not in usable for p in policies):
        raise ValueError(f"--policies {args.policies!r}: choose from {', '.join(usable)}")
    return sizes, fractions, policies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--layers", type=int, default=8, help="MoE layers of the random Mixtral-like model")
    parser.add_argument("--hidden", type=int, default=1024,
                        help=f"its hidden size, a multiple of {2 * HEADS} (experts' width: 3.5 x this)")
    parser.add_argument("--experts", type=int, default=8,
                        help=f"experts per layer, at least {TOP_K} (each token is routed to {TOP_K})")
    parser.add_argument("--batch", default="1,16", metavar="B[,B...]",
                        help="batch sizes, comma-separated, each at least 1 (64-token random prompts)")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens generated per run")
    parser.add_argument("--fractions", default="0.25,0.5", metavar="F[,F...]",
                        help="cache sizes of the wrapped runs as shares of the experts, comma-separated, each in "
                        "(0, 1]")
    usable = ", ".join(p for p in POLICIES if p != "expertflow")
    parser.add_argument("--policies", default="lru-layer,lru,lfu", metavar="P[,P...]",
                        help=f"policies of the wrapped runs, comma-separated, from: {usable} (not expertflow: "
                        "no route predictor fits this random model)")
    args = parser.parse_args()
    try:
        sizes, fractions, policies = _check(args)
    except ValueError as exc:
        parser.error(str(exc))
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device; none is visible to PyTorch here")
    model = build(args.layers, args.hidden, args.experts)
    gpu_model = copy.deepcopy(model).cuda()  # the unoffloaded model, for the reference tokens and speed
    full_bytes = sum(t.numel() * t.element_size() for t in [*gpu_model.parameters(), *gpu_model.buffers()])
    batches = {}
    for batch in sizes:
        ids = torch.randint(3, 4096, (batch, 64))
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        for implementation in ("grouped_mm", "eager"):
            gpu_model.set_experts_implementation(implementation)
            ref, seconds = timed(gpu_model, {k: v.cuda() for k, v in inputs.items()}, args.new_tokens)
            print(json.dumps({"benchmark": "gpu", "policy": "full", "experts_implementation": implementation,
                              "batch": batch, "tokens_per_s": round(batch * args.new_tokens / seconds, 2),
                              "gpu_bytes": full_bytes}), flush=True)
        batches[batch] = inputs, ref  # the eager run's tokens
    del gpu_model
    torch.cuda.empty_cache()
    wrong = []
    for batch, (inputs, ref) in batches.items():
        for policy in policies:
            for fraction in fractions:
                slots = sim.capacity_from_fraction(fraction, args.layers, args.experts)
                expertflow.wrap(model, cache_slots=slots, policy=policy, device="cuda")
                try:
                    out, seconds = timed(model, {k: v.cuda() for k, v in inputs.items()}, args.new_tokens,
                                         after_warmup=expertflow.stats(model).reset)
                    stats = expertflow.stats(model)
                    row = {"benchmark": "gpu", "policy": policy, "cache_fraction": fraction, "cache_slots": slots,
                           "batch": batch, "tokens_per_s": round(batch * args.new_tokens / seconds, 2),
                           "hit_rate": round(stats.hit_rate, 4), "needs": stats.needs, "hits": stats.hits,
                           "misses": stats.misses, "loads": stats.loads, "on_demand_loads": stats.on_demand_loads,
                           "prefetches": stats.prefetches,
                           "loads_per_generated_token": round(stats.loads / (batch * args.new_tokens), 3),
                           "gpu_bytes": runtime_of(model).device_bytes, "full_model_bytes": full_bytes,
                           "same_tokens_as_eager_gpu_model": bool(torch.equal(out.cpu(), ref.cpu()))}
                finally:
                    expertflow.unwrap(model)
                print(json.dumps(row), flush=True)
                wrong.extend(f"{policy} at {fraction} cached, batch {batch}: {problem}" for problem in problems(row))
    if wrong:
        print("gpu_bench: " + "; ".join(wrong), file=sys.stderr)
        sys.exit(1)


def problems(row: dict) -> list[str]:
    """What is wrong with a wrapped run's row: other tokens than the unoffloaded model's, or counters that do not add
    up (a miscount on the device's streams would show here first)."""
    found = [] if row["same_tokens_as_eager_gpu_model"] else ["other tokens than the unoffloaded model"]
    if row["hits"] + row["misses"] != row["needs"]:
        found.append(f"hits {row['hits']} + misses {row['misses']} != needs {row['needs']}")
    if row["loads"] != row["on_demand_loads"] + row["prefetches"]:
        found.append(f"loads {row['loads']} != on-demand {row['on_demand_loads']} + prefetches {row['prefetches']}")
    if row["on_demand_loads"] > row["misses"]:
        found.append(f"on-demand loads {row['on_demand_loads']} > misses {row['misses']}")
    return found


if __name__ == "__main__":
    main()
