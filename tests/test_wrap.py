"""wrap/unwrap on every supported family: exact greedy tokens, bit-exact restore, consistent counters."""

from __future__ import annotations

import gc
import time

import numpy as np
import pytest
import torch

import expertflow
from expertflow.adapters import find_adapter
from families import COMMON, FAMILIES, batch, forward_wrapped, generate_wrapped, make_tiny, random_predictor

GEN = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False, output_logits=True, return_dict_in_generate=True)


def _total_experts(model) -> int:
    return sum(layer.num_experts for layer in find_adapter(model)[1])


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_case(request):
    family = request.param
    model = make_tiny(family)
    inputs = batch(family)
    reference = model.generate(**inputs, **GEN)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    return family, model, inputs, reference, state


def _assert_same_generation(family: str, out, reference, where: str) -> None:
    """Same tokens, and the same logits at every step: a tiny model's argmax can hide a wrong expert weighting."""
    assert torch.equal(out.sequences, reference.sequences), f"{family} at {where} generated different tokens"
    for step, (got, want) in enumerate(zip(out.logits, reference.logits, strict=True)):
        assert torch.equal(got, want), f"{family} at {where}: logits of step {step} differ"


@pytest.mark.parametrize("fraction", [0.0, 0.25, 1.0], ids=["1slot", "25pct", "100pct"])
def test_generate_matches_unwrapped(family_case, fraction):
    family, model, inputs, reference, _ = family_case
    total = _total_experts(model)
    slots = max(1, round(total * fraction))
    out, stats = generate_wrapped(model, inputs, GEN, cache_slots=slots, device="cpu")
    _assert_same_generation(family, out, reference, f"{slots} slots")
    assert stats.needs > 0
    assert stats.hits + stats.misses == stats.needs
    assert stats.loads == stats.misses == stats.on_demand_loads  # demand loading only
    assert sum(p.needs for p in stats.per_layer) == stats.needs
    if slots == total:
        assert stats.loads <= total  # everything fits: each expert is loaded at most once
        assert stats.evictions == 0


@pytest.mark.parametrize("implementation", ["grouped_mm", "batched_mm", "eager"])
def test_logits_match_unwrapped_bit_for_bit(family_case, implementation):
    """One thread (conftest): the expert arithmetic follows transformers' own, row by row, for each of its experts
    implementations."""
    family, model, inputs, _, _ = family_case
    if model.config.is_encoder_decoder and implementation != "grouped_mm":
        pytest.skip("Switch's experts do not use transformers' experts implementations")
    forward = {k: v for k, v in inputs.items() if k in ("input_ids", "attention_mask")}
    if model.config.is_encoder_decoder:
        forward["decoder_input_ids"] = inputs["input_ids"][:, :3]
    else:
        model.set_experts_implementation(implementation)
    try:
        reference, logits = forward_wrapped(model, forward, cache_slots=max(1, _total_experts(model) // 4),
                                            device="cpu")
    finally:
        if not model.config.is_encoder_decoder:
            model.set_experts_implementation("grouped_mm")
    assert torch.equal(logits, reference), f"{family}: max difference {(logits - reference).abs().max():.3g}"


@pytest.mark.parametrize("implementation", ["grouped_mm", "batched_mm", "eager"])
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_logits_match_unwrapped_bit_for_bit_under_autocast(family, implementation):
    """Under bf16 autocast the experts compute as transformers' implementation does there: grouped_mm (not
    autocast-enabled) in the weights' fp32; batched_mm summing each token's bf16 products in bf16; eager adding
    GPT-OSS's fp32 biases out of place (the result is fp32)."""
    model = make_tiny(family)
    with torch.no_grad():  # biases that change the sums (GPT-OSS's experts have them)
        for name, param in model.named_parameters():
            if "experts" in name and name.endswith("_bias"):
                param.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(3))
    model.set_experts_implementation(implementation)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference, logits = forward_wrapped(model, batch(family), cache_slots=_total_experts(model) // 4,
                                            device="cpu")
    assert torch.equal(logits, reference), f"max difference {(logits.float() - reference.float()).abs().max():.3g}"


@pytest.mark.parametrize("implementation", ["grouped_mm", "batched_mm", "eager"])
@pytest.mark.parametrize("weights, autocast", [(torch.bfloat16, torch.float16), (torch.float16, torch.bfloat16)])
def test_half_weights_under_autocast_to_the_other_half_match_bit_for_bit(weights, autocast, implementation):
    """batched_mm and eager leave the input's cast to autocast: casting it to the weights' half precision first
    rounded it twice (up to 4e-3 apart)."""
    model = make_tiny("qwen3_moe").to(weights)
    model.set_experts_implementation(implementation)
    with torch.autocast("cpu", dtype=autocast):
        reference, logits = forward_wrapped(model, batch("qwen3_moe"), cache_slots=_total_experts(model) // 4,
                                            device="cpu")
    assert torch.equal(logits, reference), f"max difference {(logits.float() - reference.float()).abs().max():.3g}"


def test_wrap_and_unwrap_inside_autocast_to_the_other_half_precision():
    """They move weights and compute nothing: torch.stack of the bf16 experts under float16 CPU autocast raised, and
    unwrap was left unfinished."""
    model = make_tiny("qwen3_moe").to(torch.bfloat16)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    with torch.autocast("cpu", dtype=torch.float16):
        expertflow.wrap(model, cache_slots=4, device="cpu")
        expertflow.unwrap(model)
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) and after[k].dtype == v.dtype
                                                 for k, v in before.items())


def _granitemoe_of_odd_width():
    from transformers import GraniteMoeConfig, GraniteMoeForCausalLM
    torch.manual_seed(0)
    model = GraniteMoeForCausalLM(GraniteMoeConfig(**COMMON, intermediate_size=10, num_hidden_layers=2,
                                                   num_local_experts=8, num_experts_per_tok=2)).eval()
    with torch.no_grad():  # routing that depends on the input, as make_tiny draws it
        for layer in model.model.layers:
            layer.block_sparse_moe.router.weight.normal_(0.0, 0.5)
    return model


@pytest.mark.parametrize("make", [lambda: make_tiny("phimoe").double(), _granitemoe_of_odd_width],
                         ids=["float64", "intermediate-size-10"])
def test_eager_takes_each_experts_rows_in_transformers_order(make):
    """transformers' eager loop gives an expert its rows k-major (every token's first choice, then the second): where
    a row's place in the buffer changes its last bits (float64's blocking; rows of a size not a multiple of 4), the
    wrapped model must take them in that order too to stay bit-exact."""
    model = make()
    model.set_experts_implementation("eager")
    reference, logits = forward_wrapped(model, batch("x"), cache_slots=1, device="cpu")
    assert torch.equal(logits, reference), f"max difference {(logits - reference).abs().max():.3g}"


@pytest.mark.parametrize("implementation", ["eager", "batched_mm"])
@pytest.mark.parametrize("family", sorted(set(FAMILIES) - {"switch_transformers"}))
def test_generate_matches_unwrapped_under_other_experts_implementations(family, implementation):
    """As above for transformers' other experts implementations, over steps whose requests mix hits and misses (so
    experts finish out of id order, and eager must still add them in id order)."""
    model = make_tiny(family)
    model.set_experts_implementation(implementation)
    inputs, gen = batch(family), {**GEN, "max_new_tokens": 8, "min_new_tokens": 8}
    reference = model.generate(**inputs, **gen)
    slots = _total_experts(model) // 2
    out, stats = generate_wrapped(model, inputs, gen, cache_slots=slots, device="cpu")
    _assert_same_generation(family, out, reference, f"{slots} slots, {implementation}")
    assert 0 < stats.hits < stats.needs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("implementation", ["grouped_mm", "batched_mm", "eager"])
@pytest.mark.parametrize("family", sorted(set(FAMILIES) - {"switch_transformers"}))
def test_half_precision_logits_match_unwrapped(family, implementation, dtype):
    """Some routers (Mixtral's, DeepSeek's) hand fp32 weights to bf16 experts: the weighted rows must stay fp32 until
    a token's rows are summed (eager: until each is added), as transformers keeps them; rounding each row first
    differs."""
    model = make_tiny(family).to(dtype)
    model.set_experts_implementation(implementation)
    reference, logits = forward_wrapped(model, batch(family), cache_slots=2, device="cpu")
    assert torch.equal(logits, reference), f"max difference {(logits - reference).abs().max():.3g}"


def test_experts_in_another_dtype_than_the_rest_of_the_model_match_unwrapped():
    """transformers' grouped_mm casts the rows to the experts' dtype (`input.to(weight.dtype)`); so does the wrapped
    compute, for experts kept in another dtype than the hidden states (either way round)."""
    for experts_dtype, rest in ((torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)):
        model = make_tiny("mixtral").to(rest)
        for layer in model.model.layers:
            layer.mlp.experts.to(experts_dtype)
        reference, logits = forward_wrapped(model, batch("mixtral"), cache_slots=3, device="cpu")
        assert torch.equal(logits, reference), f"experts {experts_dtype}, rest {rest}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_switch_in_half_precision_with_its_wo_kept_in_fp32_matches_unwrapped(dtype):
    """As transformers' Switch experts do, the activations are cast to `wo`'s dtype before it and each expert's output
    back to the hidden dtype before it is added: `wo` kept in fp32 in a half model (as T5-style checkpoints keep it
    for fp16) works and matches."""
    model = make_tiny("switch_transformers").to(dtype)
    for name, module in model.named_modules():
        if name.endswith(".wo"):
            module.float()
    inputs = _switch_inputs()
    reference, logits = forward_wrapped(model, inputs, cache_slots=3, device="cpu")
    assert torch.equal(logits, reference)


def _switch_inputs() -> dict:
    inputs = batch("switch_transformers")
    inputs["decoder_input_ids"] = inputs["input_ids"][:, :3]
    return inputs


def _seeded_forwards(model, inputs: dict, seeds: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """For each seed: the forward's logits and the next draw after it (the generator's state)."""
    out = []
    for seed in range(seeds):
        torch.manual_seed(seed)
        with torch.no_grad():
            out.append((model(**inputs).logits, torch.rand(4)))
    return out


class _AddedNoise(torch.nn.Module):
    """A dropout-like module whose output depends on its input otherwise than by a factor (as a device's fused dropout
    rounds otherwise than a precomputed mask would); with `always`, it draws in eval mode too."""

    def __init__(self, always: bool = False) -> None:
        super().__init__()
        self.always = always

    def forward(self, x):
        return x + torch.rand_like(x) if self.training or self.always else x


class _Logged(torch.nn.Module):
    """A container around an expert's dropout that logs (layer, expert) when it computes: the order the experts are
    computed in (`log_now` is off while the random states of their turns are recorded)."""

    def __init__(self, inner: torch.nn.Module, key: tuple[str, int], log: list, log_now: list) -> None:
        super().__init__()
        self.inner, self.key, self.log, self.log_now = inner, key, log, log_now

    def forward(self, x):
        if self.log_now[0]:
            self.log.append(self.key)
        return self.inner(x)


@pytest.mark.parametrize("noise, mode", [(noise, mode) for noise in ("dropout", "added noise", "noise in any mode")
                                         for mode in ("train", "monte carlo dropout")] + [("noise in any mode", "eval")])
def test_switch_experts_dropout_draws_as_transformers_does_in_any_order(noise, mode, monkeypatch):
    """Each Switch expert's own dropout module runs on its activations as it does unwrapped (the whole model in train
    mode; only the `nn.Dropout` modules in train mode inside containers that are not, for Monte Carlo dropout; a module
    that draws in any mode), with the random state its turn has unwrapped (ascending expert id), though the cache
    computes experts in another order after prefetches: seeded forwards give the unwrapped model's logits and leave
    the generator where it does (every dropout of the model and the router's jitter stay on)."""
    from expertflow.adapters import switch as switch_adapter

    model = make_tiny("switch_transformers")
    log, log_now = [], [True]
    for name, module in list(model.named_modules()):
        if name.endswith(".mlp.experts"):
            for e in range(len(module)):
                inner = torch.nn.Dropout(0.5) if noise == "dropout" else _AddedNoise(always=noise != "added noise")
                module[f"expert_{e}"].dropout = _Logged(inner, (name, e), log, log_now)
    recording = switch_adapter._dropout_draws

    def unlogged(*args, **kwargs):
        log_now[0] = False
        try:
            return recording(*args, **kwargs)
        finally:
            log_now[0] = True

    monkeypatch.setattr(switch_adapter, "_dropout_draws", unlogged)
    inputs = _switch_inputs()

    def sampling(on: bool) -> None:
        if mode == "train":
            model.train(on)
        else:
            model.eval()
            for module in model.modules():
                if on and mode != "eval" and isinstance(module, (torch.nn.Dropout, _AddedNoise)):
                    module.train()

    def runs():
        return _seeded_forwards(model, inputs, 4)

    sampling(True)
    reference = runs()
    sampling(False)
    expertflow.wrap(model, cache_slots=8, device="cpu", policy="prev-step")
    try:
        sampling(True)
        log.clear()
        for seed, (got, expected) in enumerate(zip(runs(), reference)):
            assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]), f"seed {seed}"
    finally:
        sampling(False)
        expertflow.unwrap(model)
    assert not torch.equal(reference[0][0], reference[1][0])
    calls = [[]]
    for key, after in zip(log, log[1:] + [None]):
        calls[-1].append(key[1])
        if after is None or after[0] != key[0]:
            calls.append([])
    assert any(call != sorted(call) for call in calls), "no layer computed its experts out of ascending order"


@pytest.mark.parametrize("policy", ["lru", "prev-step"])
def test_hooks_on_a_switch_experts_dropout_run_once_per_call_as_unwrapped(policy):
    """In eval mode, a hook on an expert's `nn.Dropout` still runs (a hook may change the activations), once per
    call as unwrapped, and sees the real activations (finite), also on an expert whose dropout module is of another
    kind."""
    model = make_tiny("switch_transformers")
    experts = model.encoder.block[0].layer[1].mlp.experts
    seen = []

    def zero_and_log(module, args, output):
        seen.append(bool(torch.isfinite(args[0]).all()))
        return torch.zeros_like(output)

    for e in range(len(experts)):
        if e % 2:
            experts[f"expert_{e}"].dropout = torch.nn.Identity()  # another kind, which draws nothing either
        experts[f"expert_{e}"].dropout.register_forward_hook(zero_and_log)
    inputs = _switch_inputs()
    with torch.no_grad():
        reference = [model(**inputs).logits for _ in range(3)]
        calls = len(seen)
        expertflow.wrap(model, cache_slots=3, device="cpu", policy=policy)
        try:
            seen.clear()
            wrapped = [model(**inputs).logits for _ in range(3)]
        finally:
            expertflow.unwrap(model)
    assert all(torch.equal(a, b) for a, b in zip(wrapped, reference))
    assert len(seen) == calls and all(seen)


@pytest.mark.parametrize("mode", ["train", "monte carlo dropout"])
def test_a_hook_that_draws_on_a_switch_experts_dropout_draws_as_unwrapped(mode):
    """A hook on an expert's dropout that draws random numbers (noise added to the activations) gets the numbers it
    gets unwrapped although the cache computes the experts in another order: seeded forwards give the unwrapped
    logits and leave the generator where it does."""
    model = make_tiny("switch_transformers")
    for name, module in model.named_modules():
        if name.endswith(".mlp.experts"):
            for e in range(len(module)):
                module[f"expert_{e}"].dropout.register_forward_hook(
                    lambda module, args, output: output + 0.1 * torch.randn_like(output))
    inputs = _switch_inputs()

    def sampling(on: bool) -> None:
        if mode == "train":
            model.train(on)
        else:
            for module in model.modules():
                if isinstance(module, torch.nn.Dropout):
                    module.train(on)

    def runs():
        return _seeded_forwards(model, inputs, 3)

    sampling(True)
    reference = runs()
    sampling(False)
    expertflow.wrap(model, cache_slots=3, device="cpu", policy="prev-step")
    try:
        sampling(True)
        for seed, (got, expected) in enumerate(zip(runs(), reference)):
            assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]), f"seed {seed}"
    finally:
        sampling(False)
        expertflow.unwrap(model)


def test_a_hook_that_draws_on_an_eval_mode_switch_dropout_advances_the_generator_as_unwrapped():
    """In eval mode an expert's `nn.Dropout` draws nothing, but a hook on it may: it draws from the live generator,
    a different number for each expert, and leaves the generator where it is left unwrapped."""
    model = make_tiny("switch_transformers")
    drawn = []
    for e in range(len(experts := model.encoder.block[0].layer[1].mlp.experts)):
        experts[f"expert_{e}"].dropout.register_forward_hook(lambda module, args, output: drawn.append(torch.randn(4)))
    inputs = _switch_inputs()

    def run():
        drawn.clear()
        torch.manual_seed(0)
        with torch.no_grad():
            logits = model(**inputs).logits
        return logits, torch.rand(4), len({tuple(x.tolist()) for x in drawn}), len(drawn)

    reference = run()
    expertflow.wrap(model, cache_slots=3, device="cpu", policy="prev-step")
    try:
        got = run()
    finally:
        expertflow.unwrap(model)
    assert torch.equal(got[0], reference[0]) and torch.equal(got[1], reference[1])
    assert got[2:] == reference[2:] and reference[2] == reference[3] > 1


def test_switch_experts_use_their_own_activation_and_dropout_modules():
    """Each expert's own `act` runs on its activations, hooks included, once per routed expert (an expert whose `act`
    was replaced computes with it); a dropout whose forward was replaced on the module is run, not skipped as an
    eval-mode `nn.Dropout` is."""
    model = make_tiny("switch_transformers")
    experts = model.encoder.block[0].layer[1].mlp.experts
    experts["expert_1"].act = torch.nn.Tanh()
    dropout = experts["expert_2"].dropout
    dropout.forward = lambda x: x * 0.5
    calls = []
    for e in range(len(experts)):
        experts[f"expert_{e}"].act.register_forward_hook(lambda module, args, output, e=e: calls.append(e))
    inputs = _switch_inputs()
    with torch.no_grad():
        reference = model(**inputs).logits
        unwrapped_calls = sorted(calls)
        expertflow.wrap(model, cache_slots=3, device="cpu", policy="prev-step")
        try:
            calls.clear()
            got = model(**inputs).logits
        finally:
            expertflow.unwrap(model)
    assert torch.equal(got, reference)
    assert sorted(calls) == unwrapped_calls and len(set(unwrapped_calls)) > 1


def _expert_dropouts(model) -> list[torch.nn.Module]:
    return [module[f"expert_{e}"].dropout for name, module in model.named_modules() if name.endswith(".mlp.experts")
            for e in range(len(module))]


def test_a_dropout_subclass_that_draws_in_eval_mode_on_a_switch_expert_runs_as_unwrapped():
    """An `nn.Dropout` subclass whose own forward always draws (Monte Carlo dropout written as a subclass, the model in
    eval mode) is run as unwrapped, not skipped as an eval-mode `nn.Dropout` is: seeded forwards give the unwrapped
    logits and leave the generator where it does. Were it skipped, the experts would lose their dropout."""

    class AlwaysDropout(torch.nn.Dropout):
        def forward(self, x):
            return torch.nn.functional.dropout(x, self.p, training=True)

    model = make_tiny("switch_transformers")
    for name, module in model.named_modules():
        if name.endswith(".mlp.experts"):
            for e in range(len(module)):
                module[f"expert_{e}"].dropout = AlwaysDropout(0.5)
    model.eval()
    inputs = _switch_inputs()
    reference = _seeded_forwards(model, inputs, 2)
    expertflow.wrap(model, cache_slots=3, device="cpu", policy="prev-step")
    try:
        got = _seeded_forwards(model, inputs, 2)
    finally:
        expertflow.unwrap(model)
    for seed, (wrapped, expected) in enumerate(zip(got, reference)):
        assert torch.equal(wrapped[0], expected[0]) and torch.equal(wrapped[1], expected[1]), f"seed {seed}"
    assert not torch.equal(reference[0][0], reference[1][0])


@pytest.mark.parametrize("kind", ["forward pre-hook", "global forward hook", "global forward pre-hook"])
def test_other_kinds_of_hooks_on_an_eval_mode_switch_dropout_run_as_unwrapped(kind):
    """In eval mode an expert's `nn.Dropout` draws nothing, but a forward pre-hook on it (activation steering), or a
    global forward hook or pre-hook (`register_module_forward_hook`, as profilers and activation loggers use) runs on
    it once per routed expert as unwrapped, and what it returns is used: the logits are the unwrapped ones."""
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    model = make_tiny("switch_transformers")
    dropouts = {id(dropout) for dropout in _expert_dropouts(model)}
    calls = []

    def pre(module, args):
        if id(module) in dropouts:
            calls.append(id(module))
            return (args[0] * 0.5,)

    def post(module, args, output):
        if id(module) in dropouts:
            calls.append(id(module))
            return output * 0.5

    if kind == "forward pre-hook":
        handles = [dropout.register_forward_pre_hook(pre) for dropout in _expert_dropouts(model)]
    elif kind == "global forward hook":
        handles = [register_module_forward_hook(post)]
    else:
        handles = [register_module_forward_pre_hook(pre)]
    inputs = _switch_inputs()
    try:
        reference = _seeded_forwards(model, inputs, 1)[0]
        unwrapped_calls = sorted(calls)
        expertflow.wrap(model, cache_slots=3, device="cpu", policy="prev-step")
        try:
            calls.clear()
            got = _seeded_forwards(model, inputs, 1)[0]
        finally:
            expertflow.unwrap(model)
    finally:
        for handle in handles:
            handle.remove()
    assert torch.equal(got[0], reference[0]) and torch.equal(got[1], reference[1])
    assert sorted(calls) == unwrapped_calls and len(set(unwrapped_calls)) > 1


def test_a_hook_that_draws_a_fixed_amount_on_a_switch_dropout_runs_only_for_routed_experts():
    """In train mode, a hook on each expert's dropout that draws a fixed number of values whatever the activations (a
    sampled noise scale) runs only for the experts that get tokens, as unwrapped: never on empty activations of an
    unrouted expert, whose draws would shift every later expert's random numbers. Seeded forwards give the unwrapped
    logits and leave the generator where it does."""
    model = make_tiny("switch_transformers")
    rows = []

    def scale(module, args, output):
        rows.append(args[0].shape[0])
        return output * (1 + 0.1 * torch.rand(1))

    dropouts = _expert_dropouts(model)
    for dropout in dropouts:
        dropout.register_forward_hook(scale)
    inputs = _switch_inputs()
    model.train()
    reference = _seeded_forwards(model, inputs, 2)
    routed = len(rows) // 2
    model.eval()
    expertflow.wrap(model, cache_slots=3, device="cpu", policy="prev-step")
    try:
        model.train()
        rows.clear()
        got = _seeded_forwards(model, inputs, 2)
    finally:
        model.eval()
        expertflow.unwrap(model)
    assert routed < len(dropouts), "every expert of every layer got tokens"
    for seed, (wrapped, expected) in enumerate(zip(got, reference)):
        assert torch.equal(wrapped[0], expected[0]) and torch.equal(wrapped[1], expected[1]), f"seed {seed}"
    assert rows and 0 not in rows


def test_an_error_inside_a_switch_layer_in_train_mode_leaves_the_generator_where_the_layer_would():
    """In train mode, an error raised inside a Switch layer (here by a hook on the dropout of its lowest routed expert)
    leaves the generator where the unwrapped layer leaves it when it completes, not at the random state of another
    expert's turn, from which the next draws would repeat the dropout masks the layer drew."""
    model = make_tiny("switch_transformers")
    experts = model.encoder.block[0].layer[1].mlp.experts
    seen, failing = [], [None]

    def failing_on(e: int):
        def hook(module, args, output):
            seen.append(e)
            if e == failing[0] and args[0].any():  # the activations, not the zeros its random state is recorded on
                raise RuntimeError("failing hook")
        return hook

    for e in range(len(experts)):
        experts[f"expert_{e}"].dropout.register_forward_hook(failing_on(e))
    ends = []
    handle = experts.register_forward_hook(lambda module, args, output: ends.append(torch.get_rng_state()))
    inputs = _switch_inputs()
    model.train()
    _seeded_forwards(model, inputs, 1)
    model.eval()
    handle.remove()
    routed = sorted(set(seen))
    assert len(routed) > 1 and len(ends) == 1
    failing[0] = routed[0]
    expertflow.wrap(model, cache_slots=3, device="cpu", policy="prev-step")
    try:
        model.train()
        torch.manual_seed(0)
        with torch.no_grad(), pytest.raises(RuntimeError, match="failing hook"):
            model(**inputs)
        after_error = torch.get_rng_state()
    finally:
        model.eval()
        failing[0] = None
        expertflow.unwrap(model)
    assert torch.equal(after_error, ends[0])


@pytest.mark.parametrize("implementation", ["grouped_mm", "batched_mm", "eager"])
def test_gpt_oss_experts_are_bit_exact_for_every_row_count(implementation):
    """The transposed, interleaved GPT-OSS experts give transformers' output to the last bit for 1 to 24 tokens (the
    gate's element-wise functions run on buffers grouped or ordered otherwise here than there: with an intermediate
    size that is a multiple of 32, as in the released models, no row falls in a vectorised kernel's tail)."""
    model = make_tiny("gpt_oss")
    model.set_experts_implementation(implementation)
    experts = model.model.layers[0].mlp.experts
    generator = torch.Generator().manual_seed(0)
    cases = []
    for rows in range(1, 25):
        index = torch.stack([torch.randperm(8, generator=generator)[:2] for _ in range(rows)])
        cases.append((torch.randn(rows, model.config.hidden_size, generator=generator), index,
                      torch.rand(rows, 2, generator=generator)))
    with torch.no_grad():
        references = [experts(*case) for case in cases]
        expertflow.wrap(model, cache_slots=2, device="cpu")
        try:
            outs = [experts(*case) for case in cases]
        finally:
            expertflow.unwrap(model)
    differ = [rows for rows, (out, reference) in enumerate(zip(outs, references), 1) if not torch.equal(out, reference)]
    assert not differ, f"{implementation}: outputs differ for {differ} tokens"
    reference, logits = forward_wrapped(model, batch("gpt_oss"), cache_slots=3, device="cpu")
    assert torch.equal(logits, reference)


def test_top_1_routing_of_a_single_token_under_batched_mm_is_bit_exact():
    """With top-1 routing a decode step of one sequence is a batch of one (token, k) row in transformers' batched_mm,
    which takes the single-row kernel: the wrapped compute does the same for that row."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(**COMMON, intermediate_size=24, num_hidden_layers=2, num_local_experts=8,
                                             num_experts_per_tok=1)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "gate.weight" in name:
                p.normal_(0.0, 0.5)
    model.set_experts_implementation("batched_mm")
    inputs = {"input_ids": torch.tensor([[5, 17, 33, 9]]), "attention_mask": torch.ones(1, 4, dtype=torch.long)}
    gen = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True)
    reference = model.generate(**inputs, **gen)
    out, _ = generate_wrapped(model, inputs, gen, cache_slots=2, device="cpu")
    _assert_same_generation("mixtral", out, reference, "top-1, batch of one, batched_mm")


def test_layers_whose_experts_differ_in_size_match_unwrapped():
    """The slots hold the largest expert of any layer (models such as ernie4_5_vl_moe have experts of two sizes)."""
    model = make_tiny("mixtral")
    experts, hidden = model.model.layers[1].mlp.experts, model.config.hidden_size
    generator = torch.Generator().manual_seed(1)
    experts.gate_up_proj = torch.nn.Parameter(torch.randn(8, 2 * 40, hidden, generator=generator) * 0.2)
    experts.down_proj = torch.nn.Parameter(torch.randn(8, hidden, 40, generator=generator) * 0.2)
    inputs = batch("mixtral")
    gen = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False)
    reference = model.generate(**inputs, **gen)
    out, _ = generate_wrapped(model, inputs, gen, cache_slots=3, device="cpu")
    assert torch.equal(out, reference)


def test_unwrap_restores_state_dict_bit_for_bit(family_case):
    family, model, _, _, state = family_case
    expertflow.wrap(model, cache_slots=3, device="cpu")
    expertflow.unwrap(model)
    restored = model.state_dict()
    assert list(restored) == list(state)
    for key, value in state.items():
        assert restored[key].dtype == value.dtype and torch.equal(restored[key], value), key


@pytest.mark.parametrize("family", ["mixtral", "switch_transformers"])
def test_unwrap_gives_experts_back_in_the_memory_layout_they_had(family):
    """Expert weights laid out otherwise than contiguously (a transposed copy) come back so laid out, not as
    contiguous copies: kernels take other paths by layout, and the unwrapped model computed other last bits."""
    model = make_tiny(family)
    layer = find_adapter(model)[1][0]
    name, param = next(iter(layer.module.named_parameters()))
    with torch.no_grad():
        param.data = param.data.transpose(-1, -2).contiguous().transpose(-1, -2)  # same values, another layout
    stride, values = param.stride(), param.detach().clone()
    inputs = batch(family)
    if model.config.is_encoder_decoder:
        inputs["decoder_input_ids"] = inputs["input_ids"][:, :3]
    with torch.no_grad():
        reference = model(**inputs).logits
    expertflow.wrap(model, cache_slots=2, device="cpu")
    expertflow.unwrap(model)
    assert param.stride() == stride and torch.equal(param, values), name
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, reference)


def test_wrapped_model_holds_no_expert_parameters(family_case):
    family, model, _, _, _ = family_case
    before = sum(p.numel() for p in model.parameters())
    expertflow.wrap(model, cache_slots=2, device="cpu")
    try:
        runtime = expertflow.runtime.runtime_of(model)
        after = sum(p.numel() for p in model.parameters())
        expert_numel = sum(layer.num_experts * sum(
            int(torch.tensor(s.shape).prod()) for s in layer.layout.tensors) for layer in runtime.layers)
        assert after == before - expert_numel
        assert runtime.store.total_bytes >= expert_numel * 4
    finally:
        expertflow.unwrap(model)


def test_original_expert_storage_is_freed_and_the_same_parameters_come_back():
    model = make_tiny("mixtral")
    layer = find_adapter(model)[1][0]
    param = layer.module.gate_up_proj
    values = param.detach().clone()
    param.marked = True  # attributes (from_pretrained's `_is_hf_initialized`, say) must survive too
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model.train()
    model(**batch("mixtral")).logits.sum().backward()  # a gradient too: kept aside while wrapped, then put back
    model.eval()
    grad = param.grad.clone()
    storage = param.untyped_storage()._weak_ref()
    expertflow.wrap(model, cache_slots=4, device="cpu")
    gc.collect()
    assert torch.UntypedStorage._expired(storage), "the experts' memory must be freed (host would hold two copies)"
    assert "gate_up_proj" not in dict(layer.module.named_parameters()) and param.grad is None
    expertflow.unwrap(model)
    assert layer.module.gate_up_proj is param and param.marked and torch.equal(param.detach(), values)
    assert torch.equal(param.grad, grad)
    assert any(param is p for group in optimizer.param_groups for p in group["params"])


def test_a_gradient_cleared_after_unwrap_does_not_come_back_at_the_next_unwrap():
    """The gradient kept aside while wrapped is handed back once: a gradient cleared after the first unwrap
    (`optimizer.zero_grad()`) stays cleared through the next wrap and unwrap."""
    model = make_tiny("mixtral")
    param = model.model.layers[0].mlp.experts.gate_up_proj
    model.train()
    model(**batch("mixtral")).logits.sum().backward()
    model.eval()
    expertflow.wrap(model, cache_slots=2, device="cpu")
    expertflow.unwrap(model)
    assert param.grad is not None  # put back
    model.zero_grad(set_to_none=True)
    expertflow.wrap(model, cache_slots=2, device="cpu")
    expertflow.unwrap(model)
    assert param.grad is None, "a gradient cleared before the second wrap came back"
    assert "_expertflow_grad" not in vars(param)


def test_a_non_expert_parameter_of_an_experts_module_stays_on_it_and_keeps_its_place():
    """Only parameters with one row per expert are experts: a 2-D parameter with another first dimension stays on the
    module. unwrap puts the experts back in the module's own parameter order, so `state_dict` keys come back in the
    same order."""
    model = make_tiny("mixtral")
    experts = model.model.layers[0].mlp.experts
    down_proj = experts.down_proj
    del experts.down_proj  # an extra parameter between the experts' two: gate_up_proj, scale, down_proj
    experts.scale = torch.nn.Parameter(torch.randn(3, model.config.hidden_size))
    experts.down_proj = down_proj
    inputs = batch("mixtral")
    keys, names = list(model.state_dict()), [name for name, _ in experts.named_parameters()]
    assert names == ["gate_up_proj", "scale", "down_proj"]
    with torch.no_grad():
        reference = model(**inputs).logits
    expertflow.wrap(model, cache_slots=2, device="cpu")
    try:
        assert [name for name, _ in experts.named_parameters()] == ["scale"]  # stays on the module (on the device)
        with torch.no_grad():
            assert torch.equal(model(**inputs).logits, reference)
    finally:
        expertflow.unwrap(model)
    assert [name for name, _ in experts.named_parameters()] == names
    assert list(model.state_dict()) == keys


def test_switch_experts_come_back_each_with_its_own_memory():
    """unwrap gives every Switch expert weight its own storage, as before wrap, not a view of the layer's stacked copy
    (which one expert would keep alive whole, and `torch.save` of one expert would write whole)."""
    model = make_tiny("switch_transformers")
    experts = model.encoder.block[1].layer[-1].mlp.experts

    def own_memory(p):
        return p.untyped_storage().nbytes() == p.numel() * p.element_size()

    assert all(own_memory(p) for p in experts.parameters())
    expertflow.wrap(model, cache_slots=2, device="cpu")
    expertflow.unwrap(model)
    assert all(own_memory(p) for p in experts.parameters())


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_wrapped_models_state_dict_has_its_experts_and_loading_experts_is_refused(family):
    model = make_tiny(family)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    layer_name = find_adapter(model)[1][0].name
    expertflow.wrap(model, cache_slots=2, device="cpu")
    try:
        state = model.state_dict()  # torch.save(model.state_dict()) must not lose the experts
        assert set(state) == set(expected)
        assert all(torch.equal(state[k], v) for k, v in expected.items())
        part = model.get_submodule(layer_name).state_dict(prefix="x.")  # a part of the model: relative names
        assert part and all(torch.equal(v, expected[layer_name + k[1:]]) for k, v in part.items())
        changed = {k: v + 1 for k, v in expected.items()}
        with pytest.raises(expertflow.WrapError, match="cannot load expert weights"):
            model.load_state_dict(changed)
        assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())  # nothing was loaded
        experts = set(expected) - {k for k, _ in model.named_parameters()} - {k for k, _ in model.named_buffers()}
        rest = {k: v for k, v in changed.items() if k not in experts}
        model.load_state_dict(rest, strict=False)  # the rest loads, as into the unwrapped model
        plain = make_tiny(family)
        plain.load_state_dict(rest, strict=False)
        after = model.state_dict()
        assert all(torch.equal(after[k], v) for k, v in plain.state_dict().items())
        assert not all(torch.equal(after[k], expected[k]) for k in rest)
    finally:
        expertflow.unwrap(model)
    assert set(model.state_dict()) == set(expected)

def test_cache_slots_is_clamped_to_number_of_experts():
    model = make_tiny("olmoe")
    total = _total_experts(model)
    expertflow.wrap(model, cache_slots=10_000, device="cpu")
    try:
        assert expertflow.runtime.runtime_of(model).cache.num_slots == total
    finally:
        expertflow.unwrap(model)
    expertflow.wrap(model, cache_slots=np.int64(3), device="cpu")  # e.g. from a numpy sweep
    try:
        assert expertflow.runtime.runtime_of(model).cache.num_slots == 3
    finally:
        expertflow.unwrap(model)


def test_a_gpu_budget_gives_the_slots_it_pays_for_and_no_more_than_the_experts():
    """gpu_budget pays for the non-expert weights first, then whole slots, and never more slots than the model has
    experts (as cache_slots is clamped)."""
    model = make_tiny("olmoe")
    total = _total_experts(model)
    expertflow.wrap(model, cache_slots=1, device="cpu")
    plan = expertflow.runtime.runtime_of(model).plan
    expertflow.unwrap(model)
    budget = plan.non_expert_bytes + 3 * plan.slot_bytes + plan.slot_bytes // 2
    expertflow.wrap(model, gpu_budget=budget, device="cpu")
    try:
        runtime = expertflow.runtime.runtime_of(model)
        assert runtime.cache.num_slots == 3
        assert runtime.device_bytes <= budget
    finally:
        expertflow.unwrap(model)
    expertflow.wrap(model, gpu_budget="1GiB", device="cpu")
    try:
        assert expertflow.runtime.runtime_of(model).cache.num_slots == total
    finally:
        expertflow.unwrap(model)


def test_the_default_cpu_cache_of_a_model_with_fewer_than_four_experts_has_one_slot():
    """On the CPU the default is a quarter of the experts, and at least one slot."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(**COMMON, intermediate_size=24, num_hidden_layers=1, num_local_experts=3,
                                             num_experts_per_tok=2)).eval()
    inputs = batch("mixtral")
    reference = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    expertflow.wrap(model, device="cpu")
    try:
        assert expertflow.runtime.runtime_of(model).cache.num_slots == 1
        assert torch.equal(model.generate(**inputs, max_new_tokens=3, do_sample=False), reference)
    finally:
        expertflow.unwrap(model)


@pytest.mark.parametrize("family", ["mixtral", "switch_transformers"])
def test_device_bytes_count_everything_but_the_experts_taken_out(family):
    model = make_tiny(family)
    adapter, layers = find_adapter(model)
    # Tensors an experts module may own besides its experts: a post-expert norm, a buffer. (Switch's experts module
    # counts its submodules as experts.)
    if family == "mixtral":
        layers[0].module.add_module("post_norm", torch.nn.LayerNorm(8))
    else:
        layers[0].module.register_parameter("scale", torch.nn.Parameter(torch.ones(8)))
    layers[0].module.register_buffer("extra", torch.ones(3))
    expert_bytes = sum(t.numel() * t.element_size() for layer in layers for name in adapter.expert_names(layer)
                       for t in [layer.module.get_parameter(name)])
    total = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    expertflow.wrap(model, cache_slots=1, device="cpu")
    try:
        plan = expertflow.runtime.runtime_of(model).plan
        assert plan.non_expert_bytes == total - expert_bytes and plan.expert_bytes == expert_bytes
    finally:
        expertflow.unwrap(model)


def test_lru_layer_policy_matches_and_counts():
    model = make_tiny("qwen3_moe")
    inputs = batch("qwen3_moe")
    reference = model.generate(**inputs, **GEN)
    expertflow.wrap(model, cache_slots=4, policy="lru-layer", device="cpu")
    try:
        _assert_same_generation("qwen3_moe", model.generate(**inputs, **GEN), reference, "4 slots, lru-layer")
        s = expertflow.stats(model)
        assert s.hits + s.misses == s.needs and s.loads == s.misses
    finally:
        expertflow.unwrap(model)


def test_emulated_link_stalls_and_still_matches():
    model = make_tiny("mixtral")
    inputs = batch("mixtral")
    reference = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    start = time.perf_counter()
    expertflow.wrap(model, cache_slots=2, device="cpu", link_bandwidth="200MB/s")
    try:
        live = expertflow.stats(model)  # held from the start: it keeps counting
        assert live.link_busy_s == 0.0
        out = model.generate(**inputs, max_new_tokens=2, do_sample=False)
        first = live.link_busy_s
        out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
        copied = expertflow.runtime.runtime_of(model).cache.engine.bytes_copied  # lru: no copy is left running
        s = live.copy()
        wall = time.perf_counter() - start
        slot_bytes = expertflow.runtime.runtime_of(model).store.slot_bytes
        live.reset()  # through the held object, without asking the runtime first
        after_reset = live.link_busy_s
        time.sleep(0.01)
        assert live.link_busy_s == after_reset, "an idle link adds nothing"
    finally:
        expertflow.unwrap(model)
    assert torch.equal(out, reference)
    assert s.stall_s > 0  # 200 MB/s makes every copy take visible time
    assert s.bytes_to_device == s.loads * slot_bytes
    # Every copy occupied the link for its bytes / 200 MB/s at least, one after another, within the run; the two
    # generations add up.
    assert copied == s.bytes_to_device and copied / 200e6 <= s.link_busy_s <= wall
    assert 0 < first < s.link_busy_s
    assert after_reset == 0.0, "reset starts the busy time again from zero"
    assert s.link_busy_s == s.as_dict()["link_busy_s"] and s.copy().link_busy_s == s.link_busy_s


def test_stats_as_dict_has_contract_fields():
    model = make_tiny("mixtral")
    d = generate_wrapped(model, batch("mixtral"), dict(max_new_tokens=2, do_sample=False), cache_slots=4,
                         device="cpu")[1].as_dict()
    for name in ("needs", "hits", "misses", "loads", "prefetches", "prefetch_hits", "on_demand_loads",
                 "bytes_to_device", "hit_rate"):
        assert name in d
    assert 0.0 <= d["hit_rate"] <= 1.0


@pytest.mark.parametrize("implementation", ["grouped_mm", "eager"])
@pytest.mark.parametrize("policy", expertflow.config.POLICIES)
def test_routes_to_no_expert_add_nothing_as_in_transformers(implementation, policy, tmp_path):
    """Expert-parallel sentinels (an index past the last expert, weight 0) are skipped by transformers' experts;
    the wrapped experts must skip them too, not pass their rows through, and no policy may trip over them."""
    model = make_tiny("mixtral")
    model.set_experts_implementation(implementation)
    num_experts = model.config.num_local_experts
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, model.config.hidden_size, generator=generator)
    index = torch.randint(0, num_experts, (5, 2), generator=generator)
    index[1, 0] = index[3, 1] = num_experts
    weights = torch.rand(5, 2, generator=generator).masked_fill(index >= num_experts, 0.0)
    experts = [layer.mlp.experts for layer in model.model.layers]
    # transformers' own grouped_mm sometimes gives NaN in a sentinel's row (weight 0 times memory it never wrote):
    # its reference sends those rows to a real expert with the same weight 0, which adds exactly nothing
    valid = index.clamp(max=num_experts - 1) if implementation == "grouped_mm" else index
    with torch.no_grad():
        references = [module(hidden, valid, weights) for module in experts]
        predictor = random_predictor(model, tmp_path) if policy == "expertflow" else None
        expertflow.wrap(model, cache_slots=2, policy=policy, predictor=predictor, device="cpu")
        try:
            for _ in range(2):  # two steps: the second one learns from / predicts with the first one's routes
                outs = [module(hidden, index, weights) for module in experts]
                assert all(torch.equal(out, ref) for out, ref in zip(outs, references))
        finally:
            expertflow.unwrap(model)


def test_the_plan_handed_to_compute_lists_each_experts_rows_in_ascending_order(monkeypatch):
    """`Adapter.compute` is promised `order` sorted by expert *stably* (an adapter may rely on each expert's rows coming
    in ascending (token, k) order, as the Switch adapter's comment does), with the rows naming no expert last. The
    built-in adapters' results do not depend on it, so only the plan itself shows it."""
    from expertflow.adapters.experts3d import Experts3DAdapter

    plans = []
    compute = Experts3DAdapter.compute

    def spy(module, hidden, top_k_index, top_k_weights, waves, plan):
        plans.append((top_k_index.clone(), plan))
        return compute(module, hidden, top_k_index, top_k_weights, waves, plan)

    monkeypatch.setattr(Experts3DAdapter, "compute", staticmethod(spy))
    model = make_tiny("mixtral")
    experts = model.model.layers[0].mlp.experts
    generator = torch.Generator().manual_seed(0)
    index = torch.randint(0, 9, (40, 2), generator=generator)  # 8: a sentinel
    expertflow.wrap(model, cache_slots=2, device="cpu")
    try:
        with torch.no_grad():
            experts(torch.randn(40, model.config.hidden_size, generator=generator), index, torch.rand(40, 2))
    finally:
        expertflow.unwrap(model)
    (index, (order, starts, counts)), = plans
    flat = index.reshape(-1)
    for e in range(8):
        rows = order[starts[e]: starts[e] + counts[e]]
        assert bool((flat[rows] == e).all()) and rows.tolist() == sorted(rows.tolist()), f"expert {e}"
    rest = order[sum(counts):]
    assert bool((flat[rest] == 8).all()) and rest.tolist() == sorted(rest.tolist())


def test_an_experts_call_with_no_tokens_gives_an_empty_output_as_unwrapped():
    model = make_tiny("mixtral")
    experts = model.model.layers[0].mlp.experts
    empty = (torch.zeros(0, model.config.hidden_size), torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2))
    with torch.no_grad():
        reference = experts(*empty)
        expertflow.wrap(model, cache_slots=2, policy="lookahead", device="cpu")
        try:
            out = experts(*empty)
            assert expertflow.stats(model).steps == 0
        finally:
            expertflow.unwrap(model)
    assert out.shape == reference.shape == (0, model.config.hidden_size)


def test_a_patched_model_or_router_forward_is_kept_and_the_tokens_stay_exact():
    """Only the experts modules' forwards are replaced: a logging wrapper on the model's forward or a router's stays
    in place while wrapped and after unwrap."""
    import functools

    model = make_tiny("mixtral")
    inputs = batch("mixtral")
    calls = {"model": 0, "router": 0}
    model_forward, router = model.forward, model.model.layers[0].mlp.gate
    router_forward = router.forward

    @functools.wraps(model_forward)
    def logged(*args, **kwargs):
        calls["model"] += 1
        return model_forward(*args, **kwargs)

    def routed(*args, **kwargs):
        calls["router"] += 1
        return router_forward(*args, **kwargs)

    model.forward, router.forward = logged, routed
    reference = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    before = dict(calls)
    expertflow.wrap(model, cache_slots=2, device="cpu")
    try:
        out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    finally:
        expertflow.unwrap(model)
    assert torch.equal(out, reference)
    assert calls == {key: 2 * count for key, count in before.items()}
    assert model.__dict__["forward"] is logged and router.__dict__["forward"] is routed


def test_layers_run_outside_the_models_forward_count_a_step_each_even_after_an_interrupted_forward():
    """Outside the model's forward call a layer that does not follow the last one starts a step (an encoder–decoder's
    encoder, run on its own by generate); a forward cut short by Ctrl-C does not leave the runtime thinking it is
    still inside that call."""
    from expertflow.runtime import runtime_of

    model = make_tiny("mixtral")
    experts = model.model.layers[0].mlp.experts
    call = (torch.randn(3, model.config.hidden_size), torch.tensor([[0, 1], [2, 3], [1, 4]]), torch.full((3, 2), 0.5))
    expertflow.wrap(model, cache_slots=2, device="cpu")
    try:
        def interrupt(step, layer, index, weights):
            raise KeyboardInterrupt

        runtime_of(model).listeners.append(interrupt)
        inputs = batch("mixtral")
        with pytest.raises(KeyboardInterrupt), torch.no_grad():
            model(**inputs)
        runtime_of(model).listeners.clear()
        stats = expertflow.stats(model)
        assert (stats.steps, stats.tokens) == (1, inputs["input_ids"].numel())
        with torch.no_grad():
            experts(*call)
            experts(*call)
        assert (stats.steps, stats.tokens) == (3, inputs["input_ids"].numel() + 2 * 3)
    finally:
        expertflow.unwrap(model)


def test_an_encoder_decoder_forward_counts_its_encoder_and_its_decoder_as_two_steps():
    """The decoder's first MoE layer starts a pass of its own (`MoELayer.starts_pass`), also when one forward call runs
    the encoder and the decoder: the decoder is not taken for the encoder's layers looped again, in the same step."""
    model = make_tiny("switch_transformers")
    inputs = batch("switch_transformers")
    decoder_ids = inputs["input_ids"][:, :3]
    expertflow.wrap(model, cache_slots=4, device="cpu")
    try:
        with torch.no_grad():
            for _ in range(2):
                model(**inputs, decoder_input_ids=decoder_ids)
        stats = expertflow.stats(model)
        assert (stats.steps, stats.tokens) == (4, 2 * (inputs["input_ids"].numel() + decoder_ids.numel()))
    finally:
        expertflow.unwrap(model)
