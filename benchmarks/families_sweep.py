"""Wrapped against unwrapped on every transformers MoE family whose experts use `use_experts_implementation`.

For each such model type in the installed transformers, builds a tiny random model (fp32 unless `--dtype` says
otherwise; E=8 experts, top-2, hidden
32, vocabulary 256, 2 layers, every MLP layer sparse), redraws the router weights so that routing depends on the input,
and compares the unwrapped model with `expertflow.wrap(model, cache_slots=s, device="cpu")` for s = 1 and s = E/2,
under each experts implementation asked for: the greedy tokens of `generate` (6 new tokens, 2 left-padded prompts),
the logits of one forward pass, and the state_dict after `unwrap` (same keys, order, dtypes and values).

Each family runs in its own subprocess with one thread and a timeout. Prints one JSON object per family, then a
summary object; progress goes to stderr. Results:
  exact                       tokens, logits and state_dict all equal, in every run
  tokens_equal_logits_differ  tokens equal, logits differ by at most LOGITS_TOLERANCE of the dtype (a last-bit
                              difference: reported, not a failure)
  wrong_logits                tokens equal, logits differ by more (wrong weights or routing the tokens hide)
  wrong_tokens                the wrapped model generated other tokens
  state_dict_changed          `unwrap` did not restore the parameters exactly
  wrap_error / run_error      `wrap`, the wrapped forward or `unwrap` raised (or the worker crashed or timed out)
  not_built                   no tiny model of this family could be built (not a failure of expertflow)
Exits with status 1 when any family gives wrong tokens or logits, a changed state_dict, or a wrap/run error.

The tiny configs come from each family's default config, shrunk by the constants below; a few families need a
fix-up (listed with their reasons in TEXT_FIXES / TOP_FIXES), reported in each result's `notes`.

Usage: python benchmarks/families_sweep.py [--families mixtral,zaya] [--implementations grouped_mm,eager,batched_mm]
                                           [--dtype float32|bfloat16|float16] [--timeout 60] [--jobs 1]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import re
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from expertflow.commands import check_positive

IMPLEMENTATIONS = ("grouped_mm", "eager", "batched_mm")
FAILURES = ("wrong_tokens", "wrong_logits", "state_dict_changed", "wrap_error", "run_error")
# Worst first: a family's result is the worst result of its runs.
SEVERITY = ("run_error", "wrap_error", "wrong_tokens", "wrong_logits", "state_dict_changed",
            "tokens_equal_logits_differ", "exact")
# Largest logits difference still taken for rounding: a few last bits of logits of order 1 in each dtype (fp32 ~1e-7,
# fp16 ~1e-3, bf16 ~8e-3).
LOGITS_TOLERANCE = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 6e-2}
# Longest --timeout: subprocess.run overflows from about 2.1e6 s (it polls with a C int of milliseconds).
MAX_TIMEOUT = 86400.0

# ---------------------------------------------------------------------------------------------- tiny config sizes
E, K, H, V = 8, 2, 32, 256  # experts, top-k, hidden size, vocabulary
LAYERS = 2  # 3 when a family's layer types have more than 2 distinct values (all of them are kept)
MAX_SIZE = 320  # memory guard: a config that still has a larger size after shrinking is refused, not built

SIZES = dict(vocab_size=V, hidden_size=H, intermediate_size=32, max_position_embeddings=128,
             vocab_size_per_layer_input=V, unpadded_vocab_size=V, hidden_size_per_layer_input=8,
             prefix_dense_intermediate_size=32, router_hidden_size=16, moe_hidden_size=H, moe_latent_size=None)
EXPERT_SIZES = dict(moe_intermediate_size=16, shared_expert_intermediate_size=16, shared_intermediate_size=16,
                    shared_experts_intermediate_size=16, moe_shared_expert_intermediate_size=16)
ROUTING = dict(num_experts=E, num_local_experts=E, n_routed_experts=E, moe_num_experts=E,
               num_experts_per_tok=K, moe_k=K, moe_topk=K, num_experts_per_token=K)
EVERY_LAYER_SPARSE = dict(first_k_dense_replace=0, num_dense_layers=0, moe_layer_start_index=0, moe_layer_interval=1,
                          decoder_sparse_step=1, expert_layer_period=1, expert_layer_offset=0, mlp_only_layers=[])
ATTENTION = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8)
LATENT_ATTENTION = dict(kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, qk_head_dim=16)
ATTENTION_INDEXER = dict(index_topk=8, index_head_dim=16, index_n_heads=2)
LINEAR_ATTENTION = dict(linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                        linear_num_value_heads=4, linear_head_dim=8, linear_num_heads=4)
MAMBA = dict(mamba_n_heads=4, mamba_num_heads=4, mamba_d_head=16, mamba_head_dim=16, mamba_d_state=8,
             ssm_state_size=8, mamba_chunk_size=16, mamba_dt_rank=4, mamba_n_groups=1, n_groups=1,
             use_mamba_kernels=False)
TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
TEXT = {**SIZES, **EXPERT_SIZES, **ROUTING, **EVERY_LAYER_SPARSE, **ATTENTION, **LATENT_ATTENTION,
        **ATTENTION_INDEXER, **LINEAR_ATTENTION, **MAMBA, **TOKENS}
# Optional features: shrunk only where the default config turns them on (None stays None).
OPTIONAL = dict(q_lora_rank=24, sliding_window=16, n_group=2, topk_group=1, num_expert_group=2, n_shared_experts=1,
                num_shared_experts=1)
# Vision and audio towers (their own sub-configs): only fed text here, so made as small as possible.
TOWER = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1, depth=1, num_attention_heads=2, num_heads=2,
             out_hidden_size=H, embed_dim=32, mlp_dim=32, projection_dim=32, deepstack_visual_indexes=[],
             num_layers=1, encoder_layers=1, d_model=32, encoder_attention_heads=2, encoder_ffn_dim=32)
GUARDED = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "vocab_size_per_layer_input",
           "hidden_size_per_layer_input", "mlp_dim", "kv_lora_rank", "q_lora_rank")


def _set(**values):
    return lambda d: d.update(values)


def _mrope(section: list[int], head_dim: int | None = None):
    def fix(d: dict) -> None:
        if head_dim:
            d["head_dim"] = head_dim
        d["rope_parameters"] = {**(d.get("rope_parameters") or {}), "mrope_section": section}
    return fix


def _loop(d: dict) -> None:
    d.update(num_hidden_layers=3, layer_types=_cycle(d["layer_types"], 3), loop_layer_index_start=1,
             loop_layer_index_end=3, loop_num_passes=2, n_layers_per_attn_res_block=1)
    if isinstance(d.get("mlp_layer_types"), list):
        d["mlp_layer_types"] = _cycle(d["mlp_layer_types"], 3)


# Applied to the text config after shrinking: family -> (reason, fix-up).
TEXT_FIXES = {
    "jamba": ("attention in layer 1: with the default period 8 both layers are mamba and generate fails",
              _set(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=1, expert_layer_offset=0)),
    "granitemoehybrid": ("a linear-attention and an attention layer: without one generate fails",
                         _set(layer_types=["linear_attention", "attention"])),
    "lfm2_moe": ("a convolution and an attention layer (the default layer types are None)",
                 _set(layer_types=["conv", "full_attention"])),
    "deepseek_ocr2": ("both layers sparse (the default MLP layer types are None)",
                      _set(mlp_layer_types=["sparse", "sparse"])),
    "dots1": ("one shared expert: the model does not accept n_shared_experts=None",
              _set(n_shared_experts=1, num_experts_per_tok=K, n_routed_experts=E)),
    "zaya": ("top-1 routing: the model accepts no other top-k", _set(num_experts_per_tok=1)),
    "gemma4": ("MoE block switched on (off by default), with its own names for the expert sizes",
               _set(enable_moe_block=True, num_experts=E, top_k_experts=K, moe_intermediate_size=16)),
    "dots3_note": ("head_dim 16: the config requires qk_nope_head_dim + qk_rope_head_dim", _set(head_dim=16)),
    "qwen4_exp": ("sparse-attention indexer sizes (None by default)", _set(
        indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=8, indexer_compress_ratio=4)),
    "glm5_next": ("indexer top-k 16: it must be a multiple of index_kpool", _set(index_topk=16)),
    "ernie4_5_vl_moe": ("mrope sections for the tiny rotary size", _mrope([2, 2, 4], 16)),
    "glm4v_moe": ("mrope sections for the tiny rotary size", _mrope([1, 1, 0])),
    "hy_v4_vl": ("mrope sections for the tiny rotary size", _mrope([2, 1, 1])),
    "inkling2_loop": ("3 layers, layers 1-2 looped twice: the same experts modules run twice per step", _loop),
}
# Applied to the whole (multimodal) config: family -> (reason, fix-up).
TOP_FIXES = {
    "muse_spark": ("pyramid audio tower shrunk by hand: its output size must equal the text hidden size", lambda d: (
        d["audio_config"].update(hidden_sizes=[8, 8, 16, 16], depths=[1, 1, 1, 1], out_hidden_size=H),
        d.update(out_hidden_size=H, projector_hidden_size=32))),
}
# Families whose class is not found by name: the top-level omni model has no forward of its own.
CLASSES = {"qwen3_omni_moe": "Qwen3OmniMoeThinkerForConditionalGeneration"}


# ---------------------------------------------------------------------------------------------- discovery, shrinking
def discover_families() -> list[str]:
    """Model types in the installed transformers whose modeling file uses `@use_experts_implementation`."""
    import transformers

    models = Path(transformers.__file__).parent / "models"
    return sorted({f.parent.name for f in models.glob("*/modeling_*.py")
                   if "@use_experts_implementation" in f.read_text(encoding="utf-8")})


def _cycle(values: list, n: int) -> list:
    """n layer types cycling through the distinct values, so a mix of layer kinds survives."""
    distinct = list(dict.fromkeys(values))
    return [distinct[i % len(distinct)] for i in range(n)]


def _shrink_values(d: dict) -> None:
    keep_zero = d.get("qk_rope_head_dim") == 0  # latent attention without rotary part: stays without
    for key, value in TEXT.items():
        if key in d:
            d[key] = [value] * len(d[key]) if isinstance(d[key], list) and not isinstance(value, list) else value
    if keep_zero:
        d["qk_rope_head_dim"] = 0
    for key, value in OPTIONAL.items():
        if d.get(key) is not None:
            d[key] = value
    if d.get("per_layer_config"):  # heterogeneous per-layer overrides (gemma4, dots3_note): dropped
        d["per_layer_config"] = None


def _shrink_layers(d: dict, n: int, old_layers: int | None) -> None:
    if "num_hidden_layers" in d:
        d["num_hidden_layers"] = n
    for key in ("layer_types", "layers_block_type"):
        if isinstance(d.get(key), list):
            d[key] = _cycle(d[key], n)
    if isinstance(d.get("mlp_layer_types"), list):
        sparse = [v for v in dict.fromkeys(d["mlp_layer_types"]) if v != "dense"]
        d["mlp_layer_types"] = _cycle(sparse, n) if sparse else d["mlp_layer_types"][:n]
    if "moe_layer_end_index" in d:
        d["moe_layer_end_index"] = n - 1
    for key, value in list(d.items()):  # any other per-layer list
        if key in ("layer_types", "layers_block_type", "mlp_layer_types") or not isinstance(value, list):
            continue
        if old_layers and value and len(value) == old_layers:
            d[key] = [ATTENTION["num_attention_heads"]] * n if "heads" in key else _cycle(value, n)


def shrink_text(d: dict, family: str) -> None:
    """Shrink a text (decoder) config in place."""
    types = d.get("layer_types") or d.get("layers_block_type")
    n = min(3, len(set(types))) if isinstance(types, list) and len(set(types)) > 2 else LAYERS
    old_layers = d.get("num_hidden_layers")
    _shrink_values(d)
    _shrink_layers(d, n, old_layers)
    if d.get("kv_lora_rank") is not None or family == "glm5_next":  # latent attention: as many kv heads as heads
        d["num_key_value_heads"] = d.get("num_attention_heads")
        if family == "mistral4":  # its head_dim must be nope + rope
            d["head_dim"] = d["qk_nope_head_dim"] + d["qk_rope_head_dim"]


def shrink_tower(d: dict) -> None:
    """Shrink a vision or audio tower config in place (and the towers nested in it)."""
    if "patch_sizes" in d:  # pyramid tower: shrunk by TOP_FIXES["muse_spark"]
        return
    d.update({key: value for key, value in TOWER.items() if key in d})
    if isinstance(d.get("layer_types"), list) and "num_hidden_layers" in d:
        d["layer_types"] = d["layer_types"][: d["num_hidden_layers"]]
    for key, value in d.items():
        if isinstance(value, dict) and key.endswith("_config"):
            shrink_tower(value)
            value.update({k: SIZES[k] for k in ("vocab_size", "max_position_embeddings") if k in value})


def shrink(d: dict, family: str) -> None:
    """Shrink a (possibly multimodal) config dict in place."""
    for key, value in d.items():
        if isinstance(value, dict) and key.endswith("_config"):
            if key in ("text_config", "thinker_config", "talker_config"):
                shrink(value, family)
            else:
                shrink_tower(value)
    if "text_config" not in d and ("hidden_size" in d or "num_hidden_layers" in d):
        shrink_text(d, family)


def sizes_left_large(d: dict, prefix: str = "") -> list[str]:
    """Sizes above MAX_SIZE after shrinking: an unshrunk model can take tens of GB."""
    large = []
    for key, value in d.items():
        if isinstance(value, dict) and key.endswith("_config"):
            large += sizes_left_large(value, f"{prefix}{key}.")
        elif key in GUARDED and isinstance(value, int) and value > MAX_SIZE:
            large.append(f"{prefix}{key}={value}")
    return large


# ---------------------------------------------------------------------------------------------- building a model
def pick_class(family: str) -> type:
    """The family's own causal-LM class, else its conditional-generation class, else a token classifier."""
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    if family in CLASSES:
        return getattr(module, CLASSES[family])
    own = [n for n in dir(module) if getattr(getattr(module, n), "__module__", None) == module.__name__]
    for pattern in (r"\w+ForCausalLM", r"\w+ForConditionalGeneration", r"\w+ForTokenClassification"):
        names = [n for n in own if re.fullmatch(pattern, n)]
        if names:  # prefer the main class over talkers, code predictors and thinkers
            names.sort(key=lambda n: ("Talker" in n or "CodePredictor" in n or "PreTrained" in n, "Thinker" in n,
                                      len(n)))
            return getattr(module, names[0])
    raise RuntimeError("no ForCausalLM, ForConditionalGeneration or ForTokenClassification class")


def tiny_config(family: str, cls: type) -> tuple[object, list[str]]:
    """The family's default config, shrunk and fixed up; refuses one left large. Returns (config, notes)."""
    config_class = next((c.config_class for c in cls.__mro__ if getattr(c, "config_class", None)), None)
    if config_class is None:
        from transformers import CONFIG_MAPPING

        config_class = CONFIG_MAPPING[family]
    d = config_class().to_dict()
    for key in ("transformers_version", "architectures", "_name_or_path"):
        d.pop(key, None)
    shrink(d, family)
    notes = []
    for fixes, target in ((TEXT_FIXES, d.get("text_config", d)), (TOP_FIXES, d)):
        if family in fixes:
            reason, fix = fixes[family]
            fix(target)
            notes.append(reason)
    large = sizes_left_large(d)
    if large:
        raise RuntimeError(f"sizes left large after shrinking (refused to build): {', '.join(large)}")
    return config_class(**d), notes


def build_model(family: str, dtype: str = "float32") -> tuple[object, list[str]]:
    """A tiny random model in eval mode, seed 0, drawn in fp32 and then cast to `dtype`. Returns (model, notes)."""
    import torch

    cls = pick_class(family)
    config, notes = tiny_config(family, cls)
    torch.manual_seed(0)
    model = cls(config).float().eval()
    if dtype != "float32":
        model = model.to(getattr(torch, dtype))
    if family == "qwen3_omni_moe":  # the Thinker alone reads this from its own config, which lacks it
        model.config.vision_start_token_id = 151652
    return model, notes


def perturb_routing(model) -> None:
    """As tests/families.py: larger router weights (so routing depends on the input), non-zero expert biases."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            owner = name.split(".")[-2] if "." in name else ""
            is_router = "gate" in owner or "router" in name or name.endswith("gate.weight")
            if p.dim() == 2 and E <= p.shape[0] <= E + 2 and is_router and "experts" not in name \
                    and "shared" not in name:  # [E (+ skip experts), H]
                p.normal_(0.0, 0.5)
            elif "experts" in name and name.endswith("_bias"):
                p.normal_(0.0, 0.1)
            if not torch.isfinite(p).all():  # a parameter its init left non-finite
                p.normal_(0.0, 0.02)


# ---------------------------------------------------------------------------------------------- comparing
def make_inputs() -> dict:
    import torch

    ids = torch.tensor([[0, 0, 0, 5, 17, 33, 9], [11, 12, 250, 14, 15, 16, 201]])  # [B, T], left-padded
    return {"input_ids": ids, "attention_mask": (ids != 0).long()}


def route_counts(model, experts: list, inputs: dict) -> dict:
    """Distinct (layer, expert) pairs routed in one forward of the prompts, and experts calls per forward."""
    import torch

    hits, calls = set(), []

    def spy(name: str, args: tuple, kwargs: dict) -> None:
        index = args[1] if len(args) > 1 else next(
            v for v in kwargs.values() if torch.is_tensor(v) and not v.is_floating_point())  # top_k_index [T, K]
        calls.append(name)
        hits.update((name, int(i)) for i in index.reshape(-1).tolist())

    hooks = [m.register_forward_pre_hook(lambda _, a, kw, n=n: spy(n, a, kw), with_kwargs=True) for n, m in experts]
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        for hook in hooks:
            hook.remove()
    total = sum(int(m.num_experts) for _, m in experts)
    return {"experts_hit": f"{len(hits)}/{total}", "experts_calls_per_forward": len(calls)}


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc)[:300]}"


def _outputs(model, inputs: dict, generates: bool):
    import torch

    with torch.no_grad():
        logits = model(**inputs).logits
        tokens = model.generate(**inputs, max_new_tokens=6, do_sample=False, pad_token_id=0) if generates \
            else logits.argmax(-1)  # token classifiers: compare the argmax of the forward
    return logits, tokens


def _state_restored(model, before: dict) -> bool:
    import torch

    after = model.state_dict()
    return list(after) == list(before) and all(
        after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in before.items())


def compare_wrapped(model, inputs: dict, reference: tuple, before: dict, slots: int, generates: bool,
                    dtype: str = "float32") -> dict:
    """One wrap / forward + generate / unwrap cycle against the unwrapped reference (logits, tokens)."""
    import expertflow

    run: dict = {"cache_slots": slots}
    try:
        expertflow.wrap(model, cache_slots=slots, device="cpu")
    except Exception as exc:  # wrap promises to leave the model as it was: checked below
        return {**run, "result": "wrap_error", "reason": _error(exc),
                "state_dict_restored": _state_restored(model, before)}
    try:
        logits, tokens = _outputs(model, inputs, generates)
        run["max_logits_diff"] = float((logits - reference[0]).abs().max())
        run["tokens_equal"] = tokens.shape == reference[1].shape and bool((tokens == reference[1]).all())
    except Exception as exc:
        run.update(result="run_error", reason=_error(exc))
    try:
        expertflow.unwrap(model)
    except Exception as exc:
        return {**run, "result": "run_error", "reason": f"unwrap: {_error(exc)}"}
    run["state_dict_restored"] = _state_restored(model, before)
    if "result" not in run:
        run["result"] = _outcome(run["tokens_equal"], run["max_logits_diff"], run["state_dict_restored"], dtype)
    return run


def _outcome(tokens_equal: bool, logits_diff: float, state_restored: bool, dtype: str = "float32") -> str:
    if not tokens_equal:
        return "wrong_tokens"
    if logits_diff > LOGITS_TOLERANCE[dtype] or logits_diff != logits_diff:  # (NaN != NaN)
        return "wrong_logits"
    if not state_restored:
        return "state_dict_changed"
    return "exact" if logits_diff == 0.0 else "tokens_equal_logits_differ"


def compare_implementation(model, implementation: str, inputs: dict, before: dict, slot_counts: list[int],
                           dtype: str = "float32") -> list:
    """Runs at each cache size under one experts implementation; a single `skipped` run when the unwrapped model
    cannot run it."""
    generates = not type(model).__name__.endswith("ForTokenClassification")
    try:
        model.set_experts_implementation(implementation)
        reference = _outputs(model, inputs, generates)
    except Exception as exc:
        return [{"implementation": implementation, "result": "skipped", "reason": f"unwrapped: {_error(exc)}"}]
    return [{"implementation": implementation, **compare_wrapped(model, inputs, reference, before, s, generates,
                                                                     dtype)}
            for s in slot_counts]


def family_result(runs: list[dict]) -> dict:
    """The worst result over the runs, the largest logits difference, and why it is not exact."""
    done = [r for r in runs if r["result"] != "skipped"]
    if not done:
        return {"result": "not_built", "reason": "; ".join(r["reason"] for r in runs)}
    result = min((r["result"] for r in done), key=SEVERITY.index)
    diffs = [r["max_logits_diff"] for r in done if "max_logits_diff" in r]
    out = {"result": result, "max_logits_diff": max(diffs) if diffs else None}
    reasons = [r["implementation"] + (f", {r['cache_slots']} slots" if "cache_slots" in r else "")
               + f": {r['result']}" + (f" ({r['reason']})" if "reason" in r else "")
               for r in runs if r["result"] != "exact"]  # a skipped implementation has no slot count
    if reasons:
        out["reason"] = "; ".join(reasons)
    return out


def run_family(family: str, implementations: list[str], dtype: str = "float32") -> dict:
    """Worker: build the family's tiny model and compare wrapped with unwrapped under each implementation."""
    import torch

    from expertflow.adapters.experts3d import is_experts3d

    torch.set_num_threads(1)
    start = time.perf_counter()
    row: dict = {"benchmark": "families_sweep", "family": family, "class": None, "dtype": dtype}
    try:
        model, notes = build_model(family, dtype)
    except Exception as exc:  # any failure to build a tiny model is reported, it is not a failure of expertflow
        return {**row, "result": "not_built", "reason": _error(exc)}
    row.update({"class": type(model).__name__, "notes": notes})
    experts = [(n, m) for n, m in model.named_modules() if is_experts3d(m)]
    if not experts:
        return {**row, "result": "not_built", "reason": "the tiny model has no experts module"}
    perturb_routing(model)
    inputs = make_inputs()
    try:
        row.update(route_counts(model, experts, inputs))
    except Exception as exc:  # the unwrapped tiny model does not run: nothing to compare with
        return {**row, "result": "not_built", "reason": f"unwrapped: {_error(exc)}"}
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    slot_counts = [1, max(2, max(int(m.num_experts) for _, m in experts) // 2)]
    runs = [run for impl in implementations for run in compare_implementation(model, impl, inputs, before,
                                                                             slot_counts, dtype)]
    row.update(family_result(runs))
    return {**row, "runs": runs, "seconds": round(time.perf_counter() - start, 1)}


# ---------------------------------------------------------------------------------------------- driver
def run_worker(family: str, implementations: list[str], timeout: float, dtype: str = "float32") -> dict:
    """Runs one family in a fresh single-threaded interpreter; its last stdout line is the result."""
    row = {"benchmark": "families_sweep", "family": family, "class": None, "dtype": dtype}
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error")
    command = [sys.executable, os.path.abspath(__file__), "--worker", family,
               "--implementations", ",".join(implementations), "--dtype", dtype]
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {**row, "result": "run_error", "reason": f"timed out after {timeout:g} s"}
    lines = done.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        tail = (done.stderr or done.stdout).strip()[-500:]
        return {**row, "result": "run_error", "reason": f"worker exited with status {done.returncode}: {tail}"}


def summary(rows: list[dict], implementations: list[str], seconds: float, dtype: str = "float32") -> dict:
    import torch
    import transformers

    import expertflow

    counts = Counter(r["result"] for r in rows)
    return {"benchmark": "families_sweep_summary", "transformers": transformers.__version__,
            "torch": torch.__version__, "expertflow": getattr(expertflow, "__version__", None),
            "python": platform.python_version(),
            "cpu": {"machine": platform.machine(), "capability": torch.backends.cpu.get_cpu_capability(),
                    "platform": platform.platform()},
            "implementations": implementations, "dtype": dtype, "families": len(rows),
            "counts": dict(sorted(counts.items())),
            "failed": [r["family"] for r in rows if r["result"] in FAILURES], "seconds": round(seconds, 1)}


def _names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError("expected a comma-separated list of names")
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", type=_names, help="comma-separated model types (default: all discovered)")
    parser.add_argument("--implementations", type=_names, default=list(IMPLEMENTATIONS),
                        help=f"comma-separated experts implementations, of {','.join(IMPLEMENTATIONS)}")
    parser.add_argument("--dtype", choices=list(LOGITS_TOLERANCE), default="float32",
                        help="dtype of the tiny models (default float32)")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="seconds allowed per family (default 60, at most a day)")
    parser.add_argument("--jobs", type=int, default=1, help="families run at once, one thread each (default 1)")
    parser.add_argument("--worker", metavar="FAMILY", help=argparse.SUPPRESS)  # one family, in this process
    args = parser.parse_args(argv)
    unknown = sorted(set(args.implementations) - set(IMPLEMENTATIONS))
    if unknown:
        parser.error(f"--implementations: unknown {', '.join(unknown)}; choose from {', '.join(IMPLEMENTATIONS)}")
    try:  # nan, inf or a timeout over MAX_TIMEOUT would fail inside subprocess.run, in a traceback
        check_positive(args.timeout, "--timeout")
        check_positive(args.jobs, "--jobs", integer=True)
    except ValueError as exc:
        parser.error(str(exc))
    if args.timeout > MAX_TIMEOUT:
        parser.error(f"--timeout {args.timeout:g} must be at most {MAX_TIMEOUT:g} seconds (a day) per family")
    if args.families:
        known = discover_families()
        unknown = [f for f in args.families if f not in known]
        if unknown:
            parser.error(f"--families: {', '.join(unknown)} not among the {len(known)} model types whose experts use "
                         "`use_experts_implementation` in the installed transformers")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        import warnings

        warnings.simplefilter("ignore")  # this process's stderr is not shown; keep it short for crash reports
        print(json.dumps(run_family(args.worker, args.implementations, args.dtype)), flush=True)
        return 0
    families = args.families or discover_families()
    start = time.perf_counter()
    rows = []
    with ThreadPoolExecutor(args.jobs) as pool:
        for i, row in enumerate(pool.map(lambda f: run_worker(f, args.implementations, args.timeout, args.dtype),
                                                 families)):
            print(json.dumps(row), flush=True)
            print(f"[{i + 1}/{len(families)}] {row['family']}: {row['result']}", file=sys.stderr, flush=True)
            rows.append(row)
    print(json.dumps(summary(rows, args.implementations, time.perf_counter() - start, args.dtype)), flush=True)
    return 1 if any(r["result"] in FAILURES for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
