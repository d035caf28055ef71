"""GPU throughput: a Mixtral-like model generated unoffloaded on the GPU and wrapped at several cache sizes.

Prints one JSON object per run (tokens/s, hit rate, loads, bytes held on the GPU). Needs CUDA. The unoffloaded model
is timed with transformers' `grouped_mm` experts and with `eager` ones; wrapped runs are compared token for token
with the `eager` one, whose per-expert operations the runtime follows (in bf16 the two paths differ from each other).
Usage: python benchmarks/gpu_bench.py [--layers 8] [--hidden 1024] [--experts 8] [--batch 1,16] [--new-tokens 32]
       [--policies lru-layer,lru,lfu] [--fractions 0.25,0.5]
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import torch

import expertflow
from expertflow.runtime import runtime_of


def build(layers: int, hidden: int, experts: int):
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=4096, hidden_size=hidden, intermediate_size=int(3.5 * hidden),
                           num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=4,
                           num_local_experts=experts, num_experts_per_tok=2, max_position_embeddings=1024)
    model = MixtralForCausalLM(config).to(torch.bfloat16).eval()
    model.set_experts_implementation("eager")
    return model


def timed(model, inputs, new_tokens: int) -> tuple[torch.Tensor, float]:
    model.generate(**inputs, max_new_tokens=2, do_sample=False)
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    torch.cuda.synchronize()  # host sync: end of the timed region
    return out, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--batch", default="1,16")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--fractions", default="0.25,0.5")
    parser.add_argument("--policies", default="lru-layer,lru,lfu")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device; none is visible to PyTorch here")
    model = build(args.layers, args.hidden, args.experts)
    total = args.layers * args.experts
    gpu_model = copy.deepcopy(model).cuda()  # the unoffloaded model, for the reference tokens and speed
    full_bytes = sum(p.numel() * p.element_size() for p in gpu_model.parameters())
    batches = {}
    for batch in (int(b) for b in args.batch.split(",")):
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
    for batch, (inputs, ref) in batches.items():
        for policy in args.policies.split(","):
            for fraction in (float(f) for f in args.fractions.split(",")):
                expertflow.wrap(model, cache_slots=max(1, round(total * fraction)), policy=policy, device="cuda")
                try:
                    out, seconds = timed(model, {k: v.cuda() for k, v in inputs.items()}, args.new_tokens)
                    stats = expertflow.stats(model)
                    row = {"benchmark": "gpu", "policy": policy, "cache_fraction": fraction, "batch": batch,
                           "tokens_per_s": round(batch * args.new_tokens / seconds, 2),
                           "hit_rate": round(stats.hit_rate, 4), "loads_per_token": round(stats.loads_per_token, 3),
                           "gpu_bytes": runtime_of(model).device_bytes, "full_model_bytes": full_bytes,
                           "same_tokens_as_eager_gpu_model": bool(torch.equal(out.cpu(), ref.cpu()))}
                finally:
                    expertflow.unwrap(model)
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
