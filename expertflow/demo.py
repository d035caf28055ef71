"""The main job: generate with a built-in (or given) MoE model under several cache policies and sizes, side by side.

Owns: choosing the model and prompts, calibrating the emulated link, timing each run and checking its tokens against
the unoffloaded model. It always runs on the CPU (also where there is a GPU), with copies over the emulated link.
Does not know: how offloading works inside (it only calls wrap/unwrap/stats).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

import expertflow
from expertflow.errors import first_line, is_bad_model, unreadable_weights
from expertflow.models import TINY_MOE_NAME, is_tiny_moe
from expertflow.runtime import runtime_of
from expertflow.sim import capacity_from_fraction

__all__ = ["DemoRun", "load_demo_model", "demo_inputs", "calibrate_layer_ms", "run_demo", "check_policies",
           "check_predictor_fits", "given_model"]

_FALLBACK_PROMPTS = [
    "Explain why the sky is blue in two sentences.",
    "Translate English to Finnish: The weather is nice today.",
    "def fibonacci(n):",
    "Natalia sold clips to 48 of her friends in April, and then half as many in May. How many clips in all?",
]


@dataclass
class DemoRun:
    policy: str
    cache_fraction: float | None
    slots: int | None
    device_bytes: int
    full_bytes: int
    hit_rate: float | None
    loads_per_token: float | None
    tokens_per_s: float
    new_tokens: int
    matches_full: bool
    on_demand_rate: float | None = None
    prefetch_precision: float | None = None

    def as_dict(self) -> dict:
        return {**self.__dict__, "device_fraction": self.device_bytes / self.full_bytes}


def given_model(path: str | None) -> str | None:
    """`path` as the demo runs it: None (the built-in model, with its shipped predictor) for no path, for the name
    'tiny-moe', or for the built-in model's own directory (by real path, as `wrap` recognizes it); else `path`."""
    return None if path is None or path == TINY_MOE_NAME or is_tiny_moe(path) else path


def load_demo_model(path: str | None):
    """(model, tokenizer or None, description). Default: the shipped tiny trained MoE, else a fixed random one."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if path is None:
        try:
            from expertflow import models

            model = models.tiny_moe(dtype=torch.float32)
            return model.eval(), AutoTokenizer.from_pretrained(model.name_or_path), "built-in tiny-moe (trained)"
        except (ImportError, OSError, AttributeError):
            return _random_model(), None, "built-in tiny random Mixtral (fixed seed)"
    config = _model_config(path)
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"--model {path}: {config.model_type} is an encoder-decoder model; the demo runs decoder-only "
                         "models (expertflow.wrap supports it: wrap it in Python and call generate)")
    from safetensors import SafetensorError

    try:
        model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32).eval()
    except SafetensorError as exc:  # a download or copy cut short
        raise unreadable_weights(path, exc) from None
    except Exception as exc:
        if not is_bad_model(exc):
            raise
        raise ValueError(f"--model {path}: cannot load it as a Hugging Face causal LM ({first_line(exc)}); "
                         f"{_GIVE_A_MODEL}") from None
    tokenizer = None
    if any(Path(path).glob("tokenizer*")):
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError, TypeError, ImportError, KeyError, AttributeError) as exc:  # damaged files
            raise ValueError(f"--model {path}: cannot load its tokenizer ({first_line(exc)}); save it beside the "
                             "model again with tokenizer.save_pretrained(DIR)") from None
    saved = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    saved = str(saved).removeprefix("torch.") if saved is not None else None
    # run in float32, the exactness check's dtype, whatever it was saved in: the memory figures are the fp32 copy's
    return model, tokenizer, path if saved in (None, "float32") else f"{path} (saved in {saved}, run in float32)"


# Above this an expert copy takes minutes on the built-in model and a run seems to hang
MAX_TRANSFER_RATIO = 1000.0
_GIVE_A_MODEL = f"give a saved Hugging Face MoE model directory (or '{TINY_MOE_NAME}', the built-in one)"


def _model_config(path: str):
    """The Hugging Face config of the model directory `path`; an error naming --model and the fix for a path that is
    not a saved model."""
    from transformers import AutoConfig

    if not Path(path).exists():
        raise FileNotFoundError(f"--model {path}: no such directory; {_GIVE_A_MODEL}")
    if not Path(path).is_dir():
        raise ValueError(f"--model {path}: is a file, not a directory; {_GIVE_A_MODEL}")
    if not (Path(path) / "config.json").is_file():
        raise ValueError(f"--model {path}: has no config.json; {_GIVE_A_MODEL}")
    try:
        return AutoConfig.from_pretrained(path)
    except Exception as exc:
        if not is_bad_model(exc):
            raise
        raise ValueError(f"--model {path}: cannot load it as a Hugging Face model ({first_line(exc)}); "
                         f"{_GIVE_A_MODEL}") from None


def _random_model():
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=2048, hidden_size=128, intermediate_size=64, num_hidden_layers=6,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=32, num_experts_per_tok=4,
                           max_position_embeddings=512, pad_token_id=0)
    return MixtralForCausalLM(config).eval()


def demo_inputs(tokenizer, vocab_size: int, num_prompts: int = 4) -> dict:
    """A left-padded batch of a few real prompts (or fixed random ids without a tokenizer)."""
    if tokenizer is None:
        gen = torch.Generator().manual_seed(0)
        lengths = [24, 17, 30, 12][:num_prompts]
        ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, n in enumerate(lengths):
            ids[row, -n:] = torch.randint(3, vocab_size, (n,), generator=gen)
            mask[row, -n:] = 1
        return {"input_ids": ids, "attention_mask": mask}
    prompts = _FALLBACK_PROMPTS[:num_prompts]
    try:
        from expertflow import models

        rows = models.load_prompts()
        by_task: dict[str, str] = {}
        for row in rows:
            by_task.setdefault(row["task"], row["prompt"][:400])
        prompts = list(by_task.values())[:num_prompts] or prompts
    except (ImportError, OSError, AttributeError):
        pass
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        from expertflow.recorder import padding_token

        tokenizer.pad_token = padding_token(tokenizer)
    return dict(tokenizer(prompts, return_tensors="pt", padding=True, truncation=True, max_length=96,
                          return_attention_mask=True))


class _Progress:
    """A generation stopping criterion that never stops; it ticks a progress bar once per new token."""

    def __init__(self, bar) -> None:
        self.bar = bar

    def __call__(self, input_ids, scores, **kwargs):
        self.bar.update(1)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _generate(model, inputs: dict, max_new_tokens: int, label: str, quiet: bool) -> tuple[torch.Tensor, float]:
    from transformers import StoppingCriteriaList

    with tqdm(total=max_new_tokens, desc=label, unit="tok", leave=False, disable=quiet) as bar:
        start = time.perf_counter()
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             do_sample=False, stopping_criteria=StoppingCriteriaList([_Progress(bar)]))
        return out, time.perf_counter() - start


class _StepClock:
    """A stopping criterion that never stops; it notes the time of every generation step."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids, scores, **kwargs):
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def decode_step_ms(model, inputs: dict, steps: int = 12) -> float:
    """Median wall time of one decode step of `model` on `inputs` (prefill excluded), in milliseconds."""
    from transformers import StoppingCriteriaList

    clock = _StepClock()
    model.generate(**inputs, max_new_tokens=steps + 1, min_new_tokens=steps + 1, do_sample=False,
                   stopping_criteria=StoppingCriteriaList([clock]))
    gaps = sorted(b - a for a, b in zip(clock.times, clock.times[1:]))
    return 1000.0 * gaps[len(gaps) // 2]


def fit_layer_compute(model, inputs: dict, num_moe_layers: int, rounds: int = 5) -> tuple[float, float]:
    """(ms of one layer at batch 1, extra ms per layer per additional row), from median decode steps of `model` on
    the first row of `inputs` and on all of its rows. The two are measured alternately, `rounds` times, and the extra
    cost is the median of the paired differences: a machine whose speed drifts between two long measurements would
    otherwise skew the difference far more than either time."""
    rows = inputs["input_ids"].shape[0]
    subs = {n: {k: v[:n] for k, v in inputs.items()} for n in sorted({1, rows})}
    for sub in subs.values():
        decode_step_ms(model, sub, steps=2)  # warm-up
    times: dict[int, list[float]] = {n: [] for n in subs}
    for _ in range(max(rounds, 1)):
        for n, sub in subs.items():
            times[n].append(decode_step_ms(model, sub) / max(num_moe_layers, 1))
    extra = statistics.median(b - a for a, b in zip(times[1], times[rows])) / max(rows - 1, 1)
    return statistics.median(times[1]), max(extra, 0.0)


def calibrate_layer_ms(model, inputs: dict, num_moe_layers: int) -> float:
    """Milliseconds of one decoder layer's compute in a decode step of the unoffloaded model at batch 1 (the first
    row of `inputs`), as the benchmarks measure it: the median of five medians of decode steps, which keeps a busy
    machine from skewing it."""
    return fit_layer_compute(model, {k: v[:1] for k, v in inputs.items()}, num_moe_layers)[0]


def predictive(policies) -> list[str]:
    """The policies among `policies` (and "full", the unoffloaded run) that read route predictions."""
    from expertflow.policy.base import policy_class

    return [p for p in policies if p != "full" and policy_class(p).wants_predictions]


def check_policies(policies: tuple[str, ...], model_path: str | None, predictor: str | None) -> None:
    """A policy that needs a route predictor, on a model other than the built-in one, needs `predictor`."""
    if given_model(model_path) is None or predictor is not None:
        return
    needing = predictive(policies)
    if needing:
        raise ValueError(f"policy {', '.join(needing)} with --model needs a route predictor trained on that model: "
                         "give --predictor DIR (the built-in one belongs to the built-in model), or leave the policy "
                         "out")


def check_predictor_fits(model, policies, predictor: str | None, device: str = "cpu") -> None:
    """A predictor (None: the shipped one) that cannot drive the predictive policies among `policies` on `model` is
    refused before any run, by wrapping once (ValueError naming the problem)."""
    wanting = predictive(policies)
    if not wanting:
        return
    try:
        expertflow.wrap(model, cache_slots=1, policy=wanting[0], device=device, predictor=predictor)
    except expertflow.WrapError as exc:
        raise ValueError(f"--predictor {predictor}: {exc}" if predictor else f"policy {wanting[0]}: {exc}") from None
    expertflow.unwrap(model)


def run_demo(model_path: str | None = None, policies: tuple[str, ...] | None = None,
             fractions: tuple[float, ...] = (0.25, 0.5), max_new_tokens: int = 24, transfer_ratio: float = 8.0,
             quiet: bool = False, predictor: str | None = None) -> dict:
    """Run every (policy, fraction) and return one JSON-ready report. `model_path`: a saved model directory, or
    None, 'tiny-moe' or the built-in model's directory for the built-in model (see `given_model`)."""
    if not (math.isfinite(transfer_ratio) and 0 < transfer_ratio <= MAX_TRANSFER_RATIO):
        raise ValueError(f"transfer_ratio={transfer_ratio} must be a number above 0 and at most {MAX_TRANSFER_RATIO:g} "
                         "(expert copy time over one layer's compute; 8 stands for Mixtral-8x7B over PCIe 4.0)")
    model_path = given_model(model_path)
    if policies is None:
        policies = default_policies()
        if model_path is not None and predictor is None:  # the built-in predictor belongs to the built-in model
            policies = tuple(p for p in policies if p != "expertflow")
    check_policies(policies, model_path, predictor)
    model, tokenizer, description = load_demo_model(model_path)
    check_predictor_fits(model, policies, predictor)
    inputs = demo_inputs(tokenizer, model.config.vocab_size)
    from expertflow.recorder import check_token_ids

    try:
        check_token_ids(inputs["input_ids"], model)
    except ValueError as exc:
        raise ValueError(f"--model {model_path}: {exc}") from None
    from expertflow.adapters import UnsupportedModelError, find_adapter

    try:
        _, layers = find_adapter(model)
    except UnsupportedModelError as exc:
        raise ValueError(f"--model {model_path}: {exc}") from None
    layer_ms = calibrate_layer_ms(model, inputs, len(layers))  # at batch 1, as the transfer ratio is stated
    slot_bytes = max(layer.layout.nbytes for layer in layers)
    link = slot_bytes / (transfer_ratio * layer_ms / 1000.0)  # bytes/s so that one expert = ratio × layer compute
    full_bytes = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    reference, seconds = _generate(model, inputs, max_new_tokens, "full", quiet)
    new_tokens = (reference.shape[1] - inputs["input_ids"].shape[1]) * reference.shape[0]
    runs = []
    if "full" in policies:
        runs.append(DemoRun("full", None, None, full_bytes, full_bytes, None, None, new_tokens / seconds,
                            new_tokens, True))
    total_experts = sum(layer.num_experts for layer in layers)
    for policy in [p for p in policies if p != "full"]:
        for fraction in fractions:
            slots = capacity_from_fraction(fraction, len(layers), max(layer.num_experts for layer in layers))
            runs.append(_offloaded_run(model, inputs, reference, policy, fraction, slots, link, max_new_tokens,
                                       full_bytes, quiet, predictor))
    return {
        "model": description,
        "moe_layers": len(layers),
        "experts": total_experts,
        "expert_bytes": slot_bytes,
        "device": "cpu",
        "emulated_link_bytes_per_s": link,
        "layer_compute_ms": layer_ms,
        "transfer_over_compute": transfer_ratio,
        "timing_note": "CPU, emulated link: one expert's copy takes transfer_over_compute x one layer's compute",
        "batch_size": int(inputs["input_ids"].shape[0]),
        "max_new_tokens": max_new_tokens,
        "runs": [run.as_dict() for run in runs],
    }


def default_policies() -> tuple[str, ...]:
    """full and the baselines, plus `expertflow` when the built-in predictor is installed."""
    try:
        from expertflow.predictor import default_predictor_path

        has_predictor = default_predictor_path().is_dir()
    except ImportError:
        has_predictor = False
    return ("full", "lru-layer", "lru") + (("expertflow",) if has_predictor else ())


def _offloaded_run(model, inputs, reference, policy, fraction, slots, link, max_new_tokens, full_bytes, quiet,
                   predictor=None):
    expertflow.wrap(model, cache_slots=slots, policy=policy, device="cpu", link_bandwidth=f"{link:.3f}B/s",
                    predictor=predictor if policy == "expertflow" else None)
    try:
        out, seconds = _generate(model, inputs, max_new_tokens, f"{policy} @ {fraction:.0%}", quiet)
        stats = expertflow.stats(model).copy()
        device_bytes = runtime_of(model).device_bytes
    finally:
        expertflow.unwrap(model)
    new_tokens = (out.shape[1] - inputs["input_ids"].shape[1]) * out.shape[0]
    return DemoRun(policy, fraction, slots, device_bytes, full_bytes, stats.hit_rate, stats.loads / new_tokens,
                   new_tokens / seconds, new_tokens, bool(torch.equal(out, reference)),
                   stats.on_demand_rate, stats.prefetch_precision if stats.prefetches else None)
