"""Device bytes held by a wrapped model (non-expert weights + slot bank) against the full model, per cache size.

Prints one JSON object per (config, cache fraction). The Mixtral-like config has experts at ~95% of its parameters,
like Mixtral-8x7B (96%). Exits 1, with an error line, if the built-in tiny MoE cannot be loaded (its rows would be
missing). Usage: python benchmarks/memory.py
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import expertflow
from expertflow.runtime import runtime_of


def mixtral_like():
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=2000, hidden_size=512, intermediate_size=1792, num_hidden_layers=4,
                           num_attention_heads=8, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
                           max_position_embeddings=256)
    return MixtralForCausalLM(config).eval()


def measure(name: str, model, fractions=(0.25, 0.5, 1.0)) -> None:
    full = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    for fraction in fractions:
        from expertflow.adapters import find_adapter

        total = sum(layer.num_experts for layer in find_adapter(model)[1])
        expertflow.wrap(model, cache_slots=max(1, round(total * fraction)), device="cpu")
        runtime = runtime_of(model)
        row = {
            "benchmark": "device_memory", "model": name, "cache_fraction": fraction,
            "cache_slots": runtime.cache.num_slots, "experts": total,
            "expert_share_of_params": round(runtime.plan.expert_bytes / runtime.full_model_bytes, 4),
            "full_model_bytes": full, "non_expert_bytes": runtime.plan.non_expert_bytes,
            "slot_bank_bytes": runtime.cache.bank.nbytes, "device_bytes": runtime.device_bytes,
            "device_fraction_of_full": round(runtime.device_bytes / full, 4),
            "host_store_bytes": runtime.store.total_bytes,
        }
        expertflow.unwrap(model)
        print(json.dumps(row))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.parse_args()
    measure("mixtral-like (H512, 8 experts, fp32)", mixtral_like())
    name = "tiny-moe (built-in, fp32)"
    try:
        from expertflow.models import tiny_moe

        model = tiny_moe(dtype=torch.float32)
    except (ImportError, OSError) as exc:  # a row left out silently would read as a finished run
        print(f"error: {name} not measured: loading it failed ({type(exc).__name__}: {exc})", file=sys.stderr)
        sys.exit(1)
    measure(name, model)


if __name__ == "__main__":
    main()
