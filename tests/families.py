"""Tiny random fp32 models of every supported family, for exact-match tests (seconds on a CPU)."""

from __future__ import annotations

from pathlib import Path

import torch

COMMON = dict(vocab_size=320, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM
    return MixtralForCausalLM(MixtralConfig(**COMMON, intermediate_size=24, num_hidden_layers=2, num_local_experts=8,
                                            num_experts_per_tok=2))


def _qwen2_moe():
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM
    return Qwen2MoeForCausalLM(Qwen2MoeConfig(**COMMON, intermediate_size=40, moe_intermediate_size=16,
                                              shared_expert_intermediate_size=24, num_hidden_layers=4, num_experts=8,
                                              num_experts_per_tok=4, decoder_sparse_step=1, mlp_only_layers=[1]))


def _qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**COMMON, intermediate_size=40, moe_intermediate_size=16, head_dim=8,
                                              num_hidden_layers=3, num_experts=8, num_experts_per_tok=4,
                                              decoder_sparse_step=2, mlp_only_layers=[]))


def _deepseek_v2():
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM
    return DeepseekV2ForCausalLM(DeepseekV2Config(
        **{**COMMON, "num_key_value_heads": 4}, intermediate_size=40, moe_intermediate_size=16, num_hidden_layers=3,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=16,
        q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_group=2, topk_group=1,
        topk_method="group_limited_greedy"))


def _deepseek_v3():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    return DeepseekV3ForCausalLM(DeepseekV3Config(
        **{**COMMON, "num_key_value_heads": 4}, intermediate_size=40, moe_intermediate_size=16, num_hidden_layers=3,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=16,
        q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_group=2, topk_group=1))


def _olmoe():
    from transformers import OlmoeConfig, OlmoeForCausalLM
    return OlmoeForCausalLM(OlmoeConfig(**COMMON, intermediate_size=16, num_hidden_layers=2, num_experts=8,
                                        num_experts_per_tok=4))


def _phimoe():
    from transformers import PhimoeConfig, PhimoeForCausalLM
    return PhimoeForCausalLM(PhimoeConfig(**COMMON, intermediate_size=24, num_hidden_layers=2, num_local_experts=8,
                                          num_experts_per_tok=2))


def _granitemoe():
    from transformers import GraniteMoeConfig, GraniteMoeForCausalLM
    return GraniteMoeForCausalLM(GraniteMoeConfig(**COMMON, intermediate_size=16, num_hidden_layers=2,
                                                  num_local_experts=8, num_experts_per_tok=4))


def _gpt_oss():
    from transformers import GptOssConfig, GptOssForCausalLM
    return GptOssForCausalLM(GptOssConfig(**COMMON, intermediate_size=32, head_dim=8, num_hidden_layers=2,
                                          num_local_experts=8, num_experts_per_tok=2, sliding_window=16,
                                          layer_types=["sliding_attention", "full_attention"]))


def _switch():
    from transformers import SwitchTransformersConfig, SwitchTransformersForConditionalGeneration
    return SwitchTransformersForConditionalGeneration(SwitchTransformersConfig(
        vocab_size=320, d_model=32, d_kv=8, d_ff=24, num_layers=2, num_decoder_layers=2, num_heads=4, num_experts=8,
        encoder_sparse_step=1, decoder_sparse_step=2, expert_capacity=4, pad_token_id=0, eos_token_id=1,
        decoder_start_token_id=0))


FAMILIES = {
    "mixtral": _mixtral, "qwen2_moe": _qwen2_moe, "qwen3_moe": _qwen3_moe, "deepseek_v2": _deepseek_v2,
    "deepseek_v3": _deepseek_v3, "olmoe": _olmoe, "phimoe": _phimoe, "granitemoe": _granitemoe, "gpt_oss": _gpt_oss,
    "switch_transformers": _switch,
}


def make_tiny(family: str, seed: int = 0):
    """A tiny random fp32 model of `family`, in eval mode. Router weights are re-drawn larger than HF's init so that
    routing depends on the input (HF's tiny init gives near-uniform router logits), and expert biases (gpt_oss) are
    drawn non-zero (HF initialises them to zero, which would hide a bias handled wrongly)."""
    torch.manual_seed(seed)
    model = FAMILIES[family]().float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(k in name for k in ("gate.weight", "router.weight", "router.classifier.weight")) and p.dim() == 2:
                p.normal_(0.0, 0.5)
            elif "experts" in name and name.endswith("_bias"):
                p.normal_(0.0, 0.1)
    return model


def batch(family: str):
    """Two prompts of different lengths (left padded for decoders)."""
    ids = torch.tensor([[0, 0, 0, 5, 17, 33, 9], [11, 12, 250, 14, 15, 16, 301]])
    mask = (ids != 0).long()
    if family == "switch_transformers":  # encoder side: right padding is the T5 convention
        ids = torch.tensor([[5, 17, 33, 9, 1, 0, 0], [11, 12, 250, 14, 15, 16, 1]])
        mask = (ids != 0).long()
    return {"input_ids": ids, "attention_mask": mask}


def generate_wrapped(model, inputs: dict, gen: dict, **wrap_options):
    """Wrap `model`, generate once, unwrap (even on failure); returns (tokens, stats of that run)."""
    import expertflow

    expertflow.wrap(model, **wrap_options)
    try:
        return model.generate(**inputs, **gen), expertflow.stats(model)
    finally:
        expertflow.unwrap(model)


def forward_wrapped(model, inputs: dict, **wrap_options):
    """One forward pass unwrapped, then wrapped (unwrapping after, even on failure); returns both logits."""
    import expertflow

    with torch.no_grad():
        reference = model(**inputs).logits
        expertflow.wrap(model, **wrap_options)
        try:
            return reference, model(**inputs).logits
        finally:
            expertflow.unwrap(model)


def record_wrapped(model, prompts, tokenizer, wrap_options: dict, **record_options):
    """Record a trace of `prompts` while wrapped (unwrapping after); returns it and the run's live counters."""
    import expertflow
    from expertflow.recorder import record

    expertflow.wrap(model, **wrap_options)
    try:
        trace = record(model, prompts, tokenizer, progress=False, **record_options)
        return trace, expertflow.stats(model).copy()
    finally:
        expertflow.unwrap(model)


def random_predictor(model, path) -> str:
    """An untrained (seeded) route predictor that fits `model`, saved under `path`; returns its directory."""
    from expertflow.adapters import find_adapter
    from expertflow.predictor import RoutePredictor
    from expertflow.predictor.model import PredictorConfig, RouteNet

    layers = find_adapter(model)[1]
    top_k = getattr(model.config, "num_experts_per_tok", None) or 2  # `wrap` refuses a predictor of another top-k
    config = PredictorConfig(vocab_size=model.config.vocab_size, num_layers=len(layers),
                             num_experts=max(l.num_experts for l in layers), top_k=top_k, d_model=16, d_ff=32,
                             heads=2, encoder_layers=1, decoder_layers=1, next_hidden=16)
    torch.manual_seed(0)
    path = Path(path) / "predictor"
    RoutePredictor(RouteNet(config)).save(path)
    return str(path)
