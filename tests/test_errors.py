"""Bad input gets a clear error that names the fix, and a failed wrap leaves the model exactly as it was."""

from __future__ import annotations

import copy
import gc
import io
import threading

import pytest
import torch
from torch import nn

import expertflow
from expertflow.adapters import UnsupportedModelError
from expertflow.runtime import WrapError
from families import batch, make_tiny, random_predictor


def _snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _same(model, snapshot) -> bool:
    now = model.state_dict()
    return list(now) == list(snapshot) and all(torch.equal(now[k], v) for k, v in snapshot.items())


def test_dense_model_is_not_moe():
    from transformers import LlamaConfig, LlamaForCausalLM
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2)).eval()
    with pytest.raises(UnsupportedModelError, match="no Mixture-of-Experts layers"):
        expertflow.wrap(model)


@pytest.mark.parametrize("family, dense", [("qwen3_moe", dict(mlp_only_layers=[0, 1, 2])),
                                           ("qwen2_moe", dict(decoder_sparse_step=8, mlp_only_layers=[])),
                                           ("qwen2_moe", dict(num_experts=0)),
                                           ("deepseek_v3", dict(first_k_dense_replace=3))])
def test_a_supported_family_whose_config_makes_every_layer_dense_is_told_so(family, dense):
    import families

    config = families.FAMILIES[family]().config
    for key, value in dense.items():
        setattr(config, key, value)
    model = type(families.FAMILIES[family]())(config).eval()
    with pytest.raises(UnsupportedModelError) as info:
        expertflow.wrap(model)
    assert "is a supported family, but this model has no layer with experts (its config makes every layer dense" \
        in str(info.value)


def test_a_model_type_of_the_generic_adapter_whose_config_makes_every_layer_dense_is_told_so():
    """Not only the named families: a type whose modeling code declares experts of transformers' interface is
    supported, so an all-dense config of it is told it has no experts, not sent to write an adapter."""
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    config = Glm4MoeConfig(vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                           num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=8,
                           n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=2)
    with pytest.raises(UnsupportedModelError, match=r"Glm4MoeForCausalLM \(model_type='glm4_moe'\) is a supported "
                                                    r"model type .* but this model has no layer with experts"):
        expertflow.wrap(Glm4MoeForCausalLM(config).eval())
    config.first_k_dense_replace = 1  # one sparse layer: wrapped
    model = Glm4MoeForCausalLM(config).eval()
    expertflow.wrap(model, cache_slots=2, device="cpu")
    expertflow.unwrap(model)


def test_a_supported_familys_model_whose_experts_no_adapter_finds_is_not_called_dense():
    """Remote code of a supported family (its experts in a ModuleList of its own classes) has experts: it is told no
    adapter recognises its classes, not that its config is dense."""
    import families

    model = families.FAMILIES["qwen3_moe"]().eval()
    for layer in model.model.layers:  # as a hub model's own code might hold them
        if hasattr(layer.mlp, "experts"):
            layer.mlp.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
    with pytest.raises(UnsupportedModelError, match="that no expertflow adapter recognises"):
        expertflow.wrap(model)


def test_a_supported_familys_model_running_its_own_code_is_told_to_load_it_without_remote_code():
    """A checkpoint loaded with trust_remote_code runs classes of its own (their module is transformers_modules.…):
    the fix is to load it with transformers' classes, not to write an adapter for a family that has one."""
    import families

    model = families.FAMILIES["qwen3_moe"]().eval()
    for layer in model.model.layers:
        if hasattr(layer.mlp, "experts"):
            layer.mlp.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
    model.__class__ = type(type(model).__name__, (type(model),), {"__module__": "transformers_modules.hub.modeling"})
    with pytest.raises(UnsupportedModelError, match="loaded with trust_remote_code=True.* load the model without "
                                                     "trust_remote_code"):
        expertflow.wrap(model)


class ToySparseMoeBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x):
        return self.experts[0](x)


def test_unknown_moe_family_names_its_classes_and_the_fix():
    model = nn.Sequential(ToySparseMoeBlock()).eval()
    with pytest.raises(UnsupportedModelError) as info:
        expertflow.wrap(model)
    text = str(info.value)
    assert "ToySparseMoeBlock" in text and "mixtral" in text and "Adapter" in text


class ToyRouter(nn.Module):
    def forward(self, x):
        return x


class ToyExpertBank(nn.Module):
    def forward(self, x):
        return x


class ToyMoe(nn.Module):
    def forward(self, x):
        return x


class ToyMoeMLP(nn.Module):
    def forward(self, x):
        return x


def test_moe_classes_of_an_unsupported_model_are_named_whatever_words_they_use():
    """A class is MoE-like by any of the words (expert, sparse, router, moeblock, moelayer, moemlp) or a name ending in
    "moe": all of them are named, and such a model is not called dense."""
    model = nn.Sequential(ToyRouter(), ToyExpertBank(), ToyMoe(), ToyMoeMLP()).eval()
    with pytest.raises(WrapError) as info:
        expertflow.wrap(model)
    text = str(info.value)
    assert "ToyExpertBank, ToyMoe, ToyMoeMLP, ToyRouter" in text and "no Mixture-of-Experts layers" not in text
    with pytest.raises(WrapError, match="has MoE classes ToyMoe that no expertflow adapter recognises"):
        expertflow.wrap(nn.Sequential(ToyMoe()).eval())


def test_an_unsupported_models_error_names_its_model_type():
    """The message names the family by `config.model_type`, not only by class."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2)).eval()
    with pytest.raises(WrapError, match=r"LlamaForCausalLM \(model_type='llama'\) has no Mixture"):
        expertflow.wrap(model)


@pytest.mark.parametrize("call", ["wrap", "stats", "unwrap"])
def test_a_call_given_something_that_is_not_a_module_says_so(call):
    with pytest.raises(WrapError, match=f"^expertflow.{call} expects a torch.nn.Module .*got str$"):
        getattr(expertflow, call)("mistralai/Mixtral-8x7B-v0.1")
    with pytest.raises(WrapError, match=f"^expertflow.{call} expects a torch.nn.Module .*got NoneType$"):
        getattr(expertflow, call)(None)


@pytest.mark.parametrize("call", ["wrap", "stats", "unwrap"])
def test_a_call_given_a_pipeline_names_its_model(call):
    """A transformers pipeline holds the model as `.model`: the error says to pass that."""
    from transformers import pipeline

    from expertflow.models import tiny_moe, tiny_moe_path

    pipe = pipeline("text-generation", model=tiny_moe(), tokenizer=str(tiny_moe_path()), device="cpu")
    fix = rf"\(it holds one as .model: pass that, as in expertflow.{call}\(pipe.model\)\)$"
    with pytest.raises(WrapError, match=rf"^expertflow.{call} expects a torch.nn.Module .*got TextGenerationPipeline "
                                        + fix):
        getattr(expertflow, call)(pipe)


@pytest.mark.parametrize("kwargs, match", [
    (dict(cache_slots=4, gpu_budget="1GiB"), "give only one"),
    (dict(gpu_budget="6 gigs"), "not a size"),
    (dict(cache_slots=0), "at least 1"),
    (dict(cache_slots=2.0), "must be an int"),
    (dict(cache_slots=True), "must be an int"),
    (dict(policy="fifo"), "choose one of"),
    (dict(link_bandwidth="16GB"), "rate such as"),
    (dict(no_such_field=1), "unknown Config field"),
    (dict(device="meta"), "'cuda', 'cuda:N' or 'cpu'"),
    (dict(device="cuda:01"), "'cuda', 'cuda:N' or 'cpu'"),  # torch would not parse these two
    (dict(device="cuda:99999999999999999999"), "'cuda', 'cuda:N' or 'cpu'"),
    (dict(device="cuda:256"), "'cuda', 'cuda:N' or 'cpu'"),  # torch would read it as cuda:0
    (dict(cache_slots=torch.tensor(True)), "must be an int"),
    (dict(link_bandwidth="0GB/s"), "'0GB/s' must be a positive rate"),
    (dict(pin_memory="no"), "True or False"),
    (dict(predictor=123), "path of a trained predictor"),
])
def test_bad_config_is_refused_before_touching_the_model(kwargs, match):
    model = make_tiny("mixtral")
    snapshot = _snapshot(model)
    with pytest.raises((ValueError, TypeError), match=match):
        expertflow.wrap(model, **kwargs)
    assert _same(model, snapshot)


def test_budget_smaller_than_one_expert():
    model = make_tiny("mixtral")
    with pytest.raises(WrapError, match="does not hold the non-expert weights"):
        expertflow.wrap(model, gpu_budget="1KB", device="cpu")


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "olmoe"])
def test_the_smallest_budget_the_error_suggests_is_accepted(family):
    """The "give at least" figure is rounded up: given back, it holds one expert (rounded to the nearest hundredth of
    a KiB, qwen2_moe's 181.53125 KiB and olmoe's 113.03125 KiB came out below what they need)."""
    import re

    model = make_tiny(family)
    with pytest.raises(WrapError, match="does not hold the non-expert weights") as info:
        expertflow.wrap(model, gpu_budget="1KB", device="cpu")
    suggested = re.search(r"give at least ([0-9.]+ [KMG]iB)", str(info.value)).group(1)
    expertflow.wrap(model, gpu_budget=suggested, device="cpu")
    try:
        assert expertflow.stats(model) is not None
    finally:
        expertflow.unwrap(model)


def test_a_float_gpu_budget_too_small_does_not_say_an_int_is_bytes():
    """The hint that an int budget counts bytes is for ints only; a float is a fraction already."""
    model = make_tiny("mixtral")
    with pytest.raises(WrapError, match="does not hold the non-expert weights") as info:
        expertflow.wrap(model, gpu_budget=1e-15, device="cpu")
    assert "an int gpu_budget" not in str(info.value)


def test_accelerator_needs_a_cache_size(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    model = make_tiny("mixtral")
    snapshot = _snapshot(model)
    with pytest.raises(WrapError, match="cache_slots=N .* or gpu_budget"):
        expertflow.wrap(model, device="cuda")
    assert _same(model, snapshot)



@pytest.mark.parametrize("index", [3, 1])
def test_a_cuda_device_this_machine_does_not_have(monkeypatch, index):
    """CUDA devices are numbered from 0: on a one-GPU machine cuda:1 (one past the last) does not exist either."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    model = make_tiny("mixtral")
    snapshot = _snapshot(model)
    with pytest.raises(WrapError, match=rf"device='cuda:{index}' but this machine has 1 CUDA device\(s\), numbered "
                                        "from 0"):
        expertflow.wrap(model, device=f"cuda:{index}", cache_slots=2)
    assert _same(model, snapshot)


def test_an_emulated_link_on_a_cuda_device_is_refused(monkeypatch):
    """link_bandwidth emulates a link on the CPU device only. `Config` refuses it with device='cuda'; with no device
    given, the default device (CUDA when available) is known at wrap only."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    model = make_tiny("mixtral")
    snapshot = _snapshot(model)
    with pytest.raises(WrapError, match="link_bandwidth emulates a link on the CPU device only, but the device is "
                                        "cuda"):
        expertflow.wrap(model, cache_slots=2, link_bandwidth="16GB/s")
    assert _same(model, snapshot)


def test_non_expert_weights_that_do_not_fit_the_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1024, 1024))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 3072)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 2048)
    model = make_tiny("mixtral")
    snapshot = _snapshot(model)
    # free for it: what the driver reports free plus what PyTorch's allocator holds unused
    with pytest.raises(WrapError, match=r"need \d+\.\d\d KiB on cuda, but only 2.00 KiB is free for them"):
        expertflow.wrap(model, device="cuda", cache_slots=2)
    assert _same(model, snapshot)


def test_wrap_twice_and_unwrap_unwrapped():
    model = make_tiny("mixtral")
    with pytest.raises(WrapError, match="nothing to unwrap"):
        expertflow.unwrap(model)
    expertflow.wrap(model, cache_slots=2, device="cpu")
    with pytest.raises(WrapError, match="already wrapped"):
        expertflow.wrap(model, cache_slots=2, device="cpu")
    expertflow.unwrap(model)


def test_stats_and_unwrap_of_the_outer_model_name_the_wrapped_part():
    model = make_tiny("mixtral")
    expertflow.wrap(model.model, cache_slots=2, device="cpu")
    try:
        with pytest.raises(WrapError, match=r"MixtralForCausalLM is not wrapped by expertflow; part model "
                                            r"\(MixtralModel\) of it is, so call expertflow.stats\(model.model\)"):
            expertflow.stats(model)
        with pytest.raises(WrapError, match=r"not wrapped by expertflow: part model \(MixtralModel\) of it is, so "
                                            r"call expertflow.unwrap\(model.model\)"):
            expertflow.unwrap(model)
        assert expertflow.stats(model.model).needs == 0
    finally:
        expertflow.unwrap(model.model)
    with pytest.raises(WrapError, match="call expertflow.wrap\\(model\\) first"):
        expertflow.stats(model)
    outer = torch.nn.Module()  # an application's module that holds the model: the part is found at any depth
    outer.lm = model
    expertflow.wrap(outer.lm.model, cache_slots=2, device="cpu")
    try:
        with pytest.raises(WrapError, match=r"part lm\.model \(MixtralModel\) of it is, so call "
                                            r"expertflow\.stats\(model\.lm\.model\)"):
            expertflow.stats(outer)
    finally:
        expertflow.unwrap(outer.lm.model)


def test_training_mode_is_refused():
    model = make_tiny("mixtral").train()
    with pytest.raises(WrapError, match=r"model.eval\(\)"):
        expertflow.wrap(model)


def test_accelerate_offloaded_model_is_refused():
    from accelerate.hooks import ModelHook, add_hook_to_module
    model = make_tiny("mixtral")
    add_hook_to_module(model.model.layers[0], ModelHook())
    with pytest.raises(WrapError, match="device_map"):
        expertflow.wrap(model)


def test_a_model_loaded_with_device_map_cpu_is_accepted():
    """As the README says ("Load it without a device_map (or with device_map='cpu')"), a device map that names one
    device is not a dispatched model."""
    model = make_tiny("mixtral")
    inputs = batch("mixtral")
    reference = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    model.hf_device_map = {"": "cpu"}
    expertflow.wrap(model, cache_slots=2, device="cpu")
    try:
        assert torch.equal(model.generate(**inputs, max_new_tokens=3, do_sample=False), reference)
    finally:
        expertflow.unwrap(model)


def test_failure_midway_rolls_back(monkeypatch):
    model = make_tiny("gpt_oss")
    inputs = batch("gpt_oss")
    reference = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    snapshot = _snapshot(model)

    def broken(*args, **kwargs):
        raise RuntimeError("copy engine failed to start")

    monkeypatch.setattr(expertflow.runtime, "make_engine", broken)
    with pytest.raises(RuntimeError, match="copy engine"):
        expertflow.wrap(model, cache_slots=2, device="cpu")
    assert _same(model, snapshot)
    with pytest.raises(WrapError, match="not wrapped"):
        expertflow.stats(model)
    assert torch.equal(model.generate(**inputs, max_new_tokens=4, do_sample=False), reference)


def _copy_threads() -> int:
    import threading
    return sum(t.name == "expertflow-copy" and t.is_alive() for t in threading.enumerate())


def test_failed_wrap_and_dropped_model_leave_no_copy_thread(monkeypatch):
    import gc
    before = _copy_threads()
    model = make_tiny("mixtral")

    def broken(*args, **kwargs):
        raise RuntimeError("slot bank could not be allocated")

    with monkeypatch.context() as patch:  # fails after the copy thread has started
        patch.setattr(expertflow.runtime, "ExpertCache", broken)
        with pytest.raises(RuntimeError, match="slot bank"):
            expertflow.wrap(model, cache_slots=2, device="cpu")
    assert _copy_threads() == before
    model.double().float()  # no guard left behind: converting is allowed again (and fp32 → fp64 → fp32 is exact)
    expertflow.wrap(model, cache_slots=2, device="cpu")
    assert _copy_threads() == before + 1
    del model
    gc.collect()
    assert _copy_threads() == before


def test_a_ctrl_c_during_wrap_rolls_back_and_stops_the_copy_thread(monkeypatch):
    """A KeyboardInterrupt while wrapping (here just after the copy thread started) is rolled back like any error: the
    experts are back, no copy thread is left, and the model generates as before."""
    model = make_tiny("mixtral")
    inputs = batch("mixtral")
    reference = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    snapshot = _snapshot(model)
    before = _copy_threads()

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(expertflow.runtime, "ExpertCache", interrupted)
        with pytest.raises(KeyboardInterrupt):
            expertflow.wrap(model, cache_slots=2, device="cpu")
    assert _copy_threads() == before
    assert _same(model, snapshot)
    assert torch.equal(model.generate(**inputs, max_new_tokens=3, do_sample=False), reference)


def test_a_wrap_that_fails_while_installing_its_guards_leaves_no_hook_or_guard(monkeypatch):
    """A failure once the runtime exists (here while the guards go in) removes the forward hooks and the guards
    already installed: converting and saving work again, and a forward keeps its gradients."""
    model = make_tiny("mixtral")
    snapshot, threads = _snapshot(model), _copy_threads()
    hooks = (dict(model._forward_pre_hooks), dict(model._forward_hooks))
    calls = []
    original = expertflow.runtime._before_load_state_dict

    def flaky(module, hook):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("hook registration failed")
        return original(module, hook)

    monkeypatch.setattr(expertflow.runtime, "_before_load_state_dict", flaky)
    with pytest.raises(RuntimeError, match="hook registration failed"):
        expertflow.wrap(model, cache_slots=2, device="cpu")
    assert (dict(model._forward_pre_hooks), dict(model._forward_hooks)) == hooks
    assert not any("_apply" in vars(m) or "save_pretrained" in vars(m) for m in model.modules())
    assert _same(model, snapshot) and _copy_threads() == threads
    model.double().float()  # allowed again
    model.train()
    model(**batch("mixtral")).logits.sum().backward()  # no refusal left on the outputs
    assert model.lm_head.weight.grad is not None


def test_predictor_of_another_model_is_refused():
    from expertflow.predictor import default_predictor_path
    model = make_tiny("mixtral")  # the shipped predictor is for the built-in 6-layer, 32-expert model
    snapshot, threads = _snapshot(model), _copy_threads()
    with pytest.raises(WrapError, match="trained for another model: MoE layers 6 .*experts per layer 32"):
        expertflow.wrap(model, policy="expertflow", predictor=str(default_predictor_path()), device="cpu")
    assert _same(model, snapshot) and _copy_threads() == threads


def _predictor_for(model, path, top_k: int, trained_on: str = "") -> str:
    """An untrained predictor of `model`'s layers and experts with the given top-k, saved as trained on traces of
    `trained_on` (what `expertflow predictor train` records)."""
    from expertflow.adapters import find_adapter
    from expertflow.predictor import RoutePredictor
    from expertflow.predictor.model import PredictorConfig, RouteNet

    layers = find_adapter(model)[1]
    config = PredictorConfig(vocab_size=model.config.vocab_size, num_layers=len(layers), num_experts=8, top_k=top_k,
                             d_model=16, d_ff=32, heads=2, encoder_layers=1, decoder_layers=1, next_hidden=16)
    torch.manual_seed(0)
    RoutePredictor(RouteNet(config), info={"model": trained_on} if trained_on else None).save(path)
    return str(path)


def test_a_predictor_of_another_top_k_is_refused(tmp_path):
    """Same layers and experts but trained for top-1 routing: refused as `predictor eval` and `simulate` refuse it."""
    model = make_tiny("mixtral")  # top-2
    path = _predictor_for(model, tmp_path / "predictor", top_k=1)
    snapshot, threads = _snapshot(model), _copy_threads()
    with pytest.raises(WrapError, match=r"trained for another model: top-k 1 \(the model has 2\)"):
        expertflow.wrap(model, policy="expertflow", predictor=path, cache_slots=4, device="cpu")
    assert _same(model, snapshot) and _copy_threads() == threads


def test_a_predictor_trained_on_another_named_model_is_used_with_a_warning(tmp_path):
    """The shape fits, so it can serve (the outputs stay exact), but its routes are another model's: `wrap` warns,
    naming both models, where `predictor eval` refuses. The same name, by last path part, passes quietly."""
    import warnings

    model = make_tiny("mixtral")
    model.name_or_path = "/models/mixtral-tiny"
    inputs = batch("mixtral")
    reference = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    other = _predictor_for(model, tmp_path / "other", top_k=2, trained_on="org/qwen-tiny")
    with pytest.warns(UserWarning, match="trained on traces of 'org/qwen-tiny', this model is '/models/mixtral-tiny'") \
            as caught:
        expertflow.wrap(model, policy="expertflow", predictor=other, cache_slots=4, device="cpu")
    assert [w.filename for w in caught] == [__file__]  # reported at the `wrap` call
    try:
        assert torch.equal(model.generate(**inputs, max_new_tokens=3, do_sample=False), reference)
    finally:
        expertflow.unwrap(model)
    same = _predictor_for(model, tmp_path / "same", top_k=2,
                          trained_on="/hf/hub/models--hub-org--Mixtral-Tiny/snapshots/5e6f7a8b")  # `trace record`'s
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        expertflow.wrap(model, policy="expertflow", predictor=same, cache_slots=4, device="cpu")
    expertflow.unwrap(model)


def test_a_predictor_trained_on_a_smaller_vocabulary_is_accepted(tmp_path):
    """A predictor trained without the model's config knows the largest id it saw + 1: a smaller vocabulary than the
    model's is fine, only a larger one is refused."""
    from expertflow.adapters import find_adapter
    from expertflow.predictor import RoutePredictor
    from expertflow.predictor.model import PredictorConfig, RouteNet

    model = make_tiny("mixtral")
    layers = find_adapter(model)[1]
    config = PredictorConfig(vocab_size=model.config.vocab_size - 20, num_layers=len(layers), num_experts=8, top_k=2,
                             d_model=16, d_ff=32, heads=2, encoder_layers=1, decoder_layers=1, next_hidden=16)
    torch.manual_seed(0)
    RoutePredictor(RouteNet(config)).save(tmp_path / "predictor")
    inputs = batch("mixtral")  # id 301 is past the predictor's vocabulary: hashed onto its rows
    reference = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    expertflow.wrap(model, policy="expertflow", predictor=str(tmp_path / "predictor"), cache_slots=4, device="cpu")
    try:
        assert torch.equal(model.generate(**inputs, max_new_tokens=3, do_sample=False), reference)
    finally:
        expertflow.unwrap(model)


def test_what_would_silently_break_a_wrapped_model_is_refused(tmp_path):
    model = make_tiny("mixtral")
    inputs = batch("mixtral")
    reference = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    expertflow.wrap(model, cache_slots=2, device=torch.device("cpu"))  # a torch.device works too
    snapshot = _snapshot(model)
    with pytest.raises(WrapError, match="converting it to torch.bfloat16 .*expertflow.unwrap"):
        model.to(torch.bfloat16)
    with pytest.raises(WrapError, match="without its experts"):
        model.save_pretrained(tmp_path)
    with pytest.raises(WrapError, match="without its experts"):
        model.model.save_pretrained(tmp_path)  # the base model holds the experts too
    shallow = copy.copy(model)  # shares the wrapped modules: works as the model does
    assert torch.equal(shallow.generate(**inputs, max_new_tokens=4, do_sample=False), reference)
    for part in (model, model.model, model.model.layers[0].mlp.experts):
        with pytest.raises(WrapError, match="cannot be copied or pickled"):
            copy.deepcopy(part)
        with pytest.raises(WrapError, match="cannot be copied or pickled"):
            torch.save(part, io.BytesIO())  # pickles it
    assert not any(tmp_path.iterdir())
    output = model(**inputs, labels=inputs["input_ids"], output_hidden_states=True)
    cached = [t.sum() for layer in output.cache.layers for t in (layer.keys, layer.values)]
    for tensor in (output.loss, output.logits.sum(), output.hidden_states[-1].sum(), *cached):
        with pytest.raises(RuntimeError, match="inference only"):
            tensor.backward(retain_graph=True)
    # refused at the outputs, before autograd reaches any weight (the final norm's, the head's, a layer's key and
    # value projections: layer 0's cache does not even pass an MoE layer)
    assert [name for name, p in model.named_parameters() if p.grad is not None] == []
    with pytest.raises(WrapError, match="converting it to torch.float16"):
        model.model.half()  # a part that holds experts: refused before anything is converted
    model.model.layers[0].self_attn.float()  # no experts below, and no change: allowed
    model.to("cpu").float()  # no change: allowed
    assert _same(model, snapshot) and all(p.dtype == torch.float32 for p in model.parameters())
    assert torch.equal(model.generate(**inputs, max_new_tokens=4, do_sample=False), reference)
    expertflow.unwrap(model)
    model.model.double().float()  # no guard left behind on the parts that held experts
    model.save_pretrained(tmp_path)  # the full checkpoint again
    assert (tmp_path / "config.json").exists()
    assert _same(copy.deepcopy(model), _snapshot(model))  # and it can be copied again


def test_weights_on_the_meta_device_are_refused():
    model = make_tiny("mixtral")
    model.model.layers[1].mlp.experts.down_proj = nn.Parameter(torch.empty(4, 16, 32, device="meta"))
    modules = [type(m) for m in model.modules()]
    with pytest.raises(WrapError, match="1 of the model's weights are on the meta device.*layers.1.mlp.experts."
                                        "down_proj.*load the checkpoint's weights first"):
        expertflow.wrap(model, cache_slots=2, device="cpu")
    assert [type(m) for m in model.modules()] == modules and model.model.layers[1].mlp.experts.down_proj.is_meta


def test_wrap_and_unwrap_under_another_default_device_keep_the_experts_on_the_host():
    """A `with torch.device(...)` block around `wrap` changes where tensors made without a device go: the experts'
    host copy must still be made in host memory (on "meta" it held no data and the experts were lost)."""
    model = make_tiny("mixtral")
    inputs = batch("mixtral")
    reference = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    state = _snapshot(model)
    with torch.device("meta"):
        expertflow.wrap(model, cache_slots=1, device="cpu")
    assert torch.equal(model.generate(**inputs, max_new_tokens=4, do_sample=False), reference)
    with torch.device("meta"):
        expertflow.unwrap(model)
    assert _same(model, state)


def test_wrap_and_unwrap_inside_inference_mode_make_normal_tensors():
    """A script that runs entirely under torch.inference_mode(): the slot bank must stay writable by the copy thread,
    and the restored experts must be ordinary parameters (loadable, trainable) after unwrap."""
    model = make_tiny("mixtral")
    inputs = batch("mixtral")
    reference = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    state = _snapshot(model)
    with torch.inference_mode():
        expertflow.wrap(model, cache_slots=3, device="cpu")
        assert torch.equal(model.generate(**inputs, max_new_tokens=4, do_sample=False), reference)
    assert torch.equal(model.generate(**inputs, max_new_tokens=4, do_sample=False), reference)
    with torch.inference_mode():
        expertflow.unwrap(model)
    assert not any(p.is_inference() for p in model.parameters())
    model.load_state_dict(state)
    assert _same(model, state)


def test_a_predictor_that_would_not_be_used_is_a_warning():
    from expertflow.predictor import default_predictor_path
    model = make_tiny("mixtral")
    with pytest.warns(UserWarning, match="policy 'lru' does not use route predictions") as caught:
        expertflow.wrap(model, policy="lru", predictor=str(default_predictor_path()), cache_slots=2, device="cpu")
    expertflow.unwrap(model)
    assert [w.filename for w in caught] == [__file__]  # reported at the `wrap` call


def test_an_encoder_decoder_model_runs_the_expertflow_policy_without_a_predictor():
    """The route predictor is not run on encoder-decoder models: policy 'expertflow' plans from the observed routes
    there, so no predictor is asked for."""
    from expertflow.runtime import runtime_of

    model = make_tiny("switch_transformers")
    inputs = batch("switch_transformers")
    reference = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    expertflow.wrap(model, policy="expertflow", cache_slots=4, device="cpu")
    try:
        assert runtime_of(model).routes is None
        assert torch.equal(model.generate(**inputs, max_new_tokens=3, do_sample=False), reference)
    finally:
        expertflow.unwrap(model)


def test_a_wrap_that_fails_while_taking_a_layers_experts_out_restores_that_layer(monkeypatch):
    from expertflow.adapters import base, experts3d

    model = make_tiny("mixtral")
    snapshot = _snapshot(model)
    params = {name: p for name, p in model.named_parameters()}
    calls = []

    def flaky(param):
        calls.append(1)
        if len(calls) == 2:  # the second expert tensor of the first layer
            raise MemoryError("host memory exhausted")
        base.release_parameter(param)

    monkeypatch.setattr(experts3d, "release_parameter", flaky)
    with pytest.raises(MemoryError):
        expertflow.wrap(model, cache_slots=2, device="cpu")
    assert _same(model, snapshot)
    assert all(p is params[name] for name, p in model.named_parameters())


def test_demo_refuses_an_encoder_decoder_model_in_one_line(tmp_path, capsys):
    from expertflow.cli import main

    make_tiny("switch_transformers").save_pretrained(tmp_path)
    capsys.readouterr()  # the saving's progress bar
    assert main(["demo", "--model", str(tmp_path), "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "switch_transformers is an encoder-decoder model; the demo runs decoder-only models" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("kwargs", [
    dict(cache_slots=0),
    dict(policy="fifo"),
    dict(gpu_budget="0.5"),
    dict(link_bandwidth="16Gb/s"),
    dict(policy="lru", policy_options={"margin": 1}),
    dict(no_such_field=1),
    dict(extra={"cache": 4}),  # not a setting: refused, not silently ignored
])
def test_bad_settings_are_a_wrap_error_with_configs_message(kwargs):
    """`except expertflow.WrapError` catches every refusal of `wrap`; an unknown keyword stays a TypeError too."""
    with pytest.raises((ValueError, TypeError)) as expected:
        expertflow.Config().replace(**kwargs)
    model = make_tiny("mixtral")
    snapshot = _snapshot(model)
    with pytest.raises(WrapError) as info:
        expertflow.wrap(model, **kwargs)
    assert str(info.value) == str(expected.value)
    assert isinstance(info.value, type(expected.value))  # a ValueError stays one, and so does a TypeError
    assert _same(model, snapshot)


def test_a_config_of_another_type_is_a_wrap_error_and_a_type_error():
    with pytest.raises(WrapError, match="config must be an expertflow.Config, got dict") as info:
        expertflow.wrap(make_tiny("mixtral"), {"cache_slots": 2})
    assert isinstance(info.value, TypeError)


def test_a_keyword_replaces_the_configs_sizing_and_the_options_of_the_policy_it_replaces(tmp_path):
    model = make_tiny("mixtral")
    expertflow.wrap(model, expertflow.Config(cache_slots=8, device="cpu"), gpu_budget=1.0)
    assert model._expertflow_runtime.cache.bank.data.shape[0] > 8  # all of the host's share, not the config's 8 slots
    expertflow.unwrap(model)
    expertflow.wrap(model, expertflow.Config(gpu_budget=1.0, device="cpu"), cache_slots=3)
    assert model._expertflow_runtime.cache.bank.data.shape[0] == 3
    expertflow.unwrap(model)
    tuned = expertflow.Config(policy="expertflow", policy_options={"margin": 8}, cache_slots=4, device="cpu",
                              predictor=random_predictor(model, tmp_path))
    with pytest.warns(UserWarning, match="is ignored: policy 'lru' does not use route predictions"):
        expertflow.wrap(model, tuned, policy="lru")  # the expertflow options were not lru's
    assert type(model._expertflow_runtime.cache.policy).__name__ == "LRUPolicy"
    expertflow.unwrap(model)
    expertflow.wrap(model, tuned, policy="expertflow")  # the same policy keeps them
    assert model._expertflow_runtime.cache.policy.margin == 8
    expertflow.unwrap(model)


def test_policy_options_changed_after_the_config_checked_them_are_refused_by_name():
    config = expertflow.Config(policy="lfu", cache_slots=4, device="cpu", policy_options={})
    config.policy_options["decay"] = 0.5
    model = make_tiny("mixtral")
    snapshot = _snapshot(model)
    with pytest.raises(WrapError, match="policy_options: 'decay' is not an option of policy 'lfu'"):
        expertflow.wrap(model, config)
    assert _same(model, snapshot)


def test_a_device_torch_cannot_parse_is_a_wrap_error():
    config = expertflow.Config(cache_slots=4, device="cpu")
    object.__setattr__(config, "device", "cuda:01")  # past Config's check, as a subclass or an older pattern might
    model = make_tiny("mixtral")
    snapshot = _snapshot(model)
    with pytest.raises(WrapError, match="device='cuda:01' is not a device torch knows"):
        expertflow.wrap(model, config)
    assert _same(model, snapshot)


@pytest.mark.parametrize("options, match", [
    ({"margin": -1}, "margin=-1 must be a number of requests of at least 0"),
    ({"theta": float("nan")}, "theta=nan must be a finite number"),
    ({"waves": "yes"}, "waves='yes' must be True or False"),
])
def test_a_bad_policy_option_value_is_refused_before_any_expert_moves(options, match, tmp_path, monkeypatch):
    """The policy's constructor checks option values: `wrap` builds the policy before it packs a single expert, so
    the experts keep their storage (a view taken before `wrap` still is the model's weight)."""
    model = make_tiny("mixtral")
    predictor = random_predictor(model, tmp_path)
    params = dict(model.named_parameters())
    pointers = {name: p.data_ptr() for name, p in params.items()}
    alias = model.model.layers[0].mlp.experts.gate_up_proj[0]
    snapshot = _snapshot(model)
    packed = []
    original = expertflow.runtime.ExpertStore.add_layer
    monkeypatch.setattr(expertflow.runtime.ExpertStore, "add_layer",
                        lambda self, *args: packed.append(1) or original(self, *args))
    with pytest.raises(WrapError, match=match):
        expertflow.wrap(model, policy="expertflow", predictor=predictor, policy_options=options, cache_slots=4,
                        device="cpu")
    assert not packed  # refused before the store was filled
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == pointers
    assert all(p is params[name] for name, p in model.named_parameters())
    assert alias.data_ptr() == model.model.layers[0].mlp.experts.gate_up_proj[0].data_ptr()
    assert _same(model, snapshot)


@pytest.mark.parametrize("budget", [1, 100])
def test_an_int_budget_too_small_says_an_int_is_bytes(budget):
    model = make_tiny("mixtral")
    with pytest.raises(WrapError, match=rf"gpu_budget={budget} \({budget} B\) does not hold .*an int gpu_budget is "
                                        r"a number of bytes: for a fraction of the free memory give a float such as "
                                        r"1\.0"):
        expertflow.wrap(model, gpu_budget=budget, device="cpu")
    with pytest.raises(WrapError) as info:
        expertflow.wrap(model, gpu_budget="1KB", device="cpu")
    assert "an int" not in str(info.value)  # a size with a unit is clearly bytes


class _OnAnotherDevice(torch.Tensor):
    """A CPU tensor that reports a CUDA device: a model spread over two devices, on a machine without a GPU."""

    @property
    def device(self):
        return torch.device("cuda", 0)


def test_a_model_spread_over_several_devices_is_refused():
    """`unwrap` and a failed `wrap` put the model back on one device, so a model placed by hand on several is
    refused at `wrap` (accelerate's dispatch is refused with its own message above)."""
    model = make_tiny("mixtral")
    model.lm_head.register_buffer("elsewhere", torch.zeros(2).as_subclass(_OnAnotherDevice))
    snapshot, threads = _snapshot(model), _copy_threads()
    with pytest.raises(WrapError, match=r"on 2 devices \(cpu, cuda:0\).*Move it to one device first"):
        expertflow.wrap(model, cache_slots=2, device="cpu")
    assert _same(model, snapshot) and _copy_threads() == threads


def test_a_shallow_copy_keeps_working_after_the_original_is_dropped():
    """The copy shares the runtime, its copy thread and its store: they close when the last user is gone, not when
    the object `wrap` was given dies."""
    model = make_tiny("mixtral")
    inputs = batch("mixtral")
    reference = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    before = _copy_threads()
    expertflow.wrap(model, cache_slots=2, device="cpu")
    shallow = copy.copy(model)
    del model
    gc.collect()
    assert _copy_threads() == before + 1
    assert torch.equal(shallow.generate(**inputs, max_new_tokens=4, do_sample=False), reference)
    assert expertflow.stats(shallow).steps > 0
    with pytest.raises(WrapError, match="shallow copy of a wrapped model whose original has been dropped"):
        shallow.to("cpu")  # its guard names the original: a clear refusal, not an AttributeError
    del shallow
    gc.collect()
    assert _copy_threads() == before  # the last user gone: the copy thread stops


def test_a_shallow_copy_of_a_model_unwrapped_through_the_original_says_so_and_unwraps_cleanly():
    """After `unwrap(model)`, a shallow copy made while wrapped still carried the runtime: `stats` gave its last
    counters as if it were live. Now it says the copy is stale; `unwrap(copy)` clears what the copy carries, and the
    copy can be wrapped again."""
    model = make_tiny("mixtral")
    inputs = batch("mixtral")
    reference = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    expertflow.wrap(model, cache_slots=2, device="cpu")
    shallow = copy.copy(model)
    assert torch.equal(shallow.generate(**inputs, max_new_tokens=4, do_sample=False), reference)
    expertflow.unwrap(model)
    for call in (lambda: expertflow.stats(shallow), lambda: expertflow.wrap(shallow, cache_slots=2, device="cpu")):
        with pytest.raises(WrapError, match="shallow copy of a wrapped model that has since been unwrapped"):
            call()
    assert torch.equal(shallow.generate(**inputs, max_new_tokens=4, do_sample=False), reference)  # runs unwrapped
    assert expertflow.unwrap(shallow) is shallow
    assert "_expertflow_runtime" not in vars(shallow) and "save_pretrained" not in vars(shallow)
    expertflow.wrap(shallow, cache_slots=2, device="cpu")
    assert torch.equal(shallow.generate(**inputs, max_new_tokens=4, do_sample=False), reference)
    assert expertflow.stats(shallow).steps > 0
    expertflow.unwrap(shallow)
    assert torch.equal(model.generate(**inputs, max_new_tokens=4, do_sample=False), reference)


def test_converting_a_model_with_a_wrapped_part_names_the_part_to_unwrap():
    """The guard on a wrapped part refused the enclosing model's conversion with "call expertflow.unwrap(model)",
    which answers that the model is not wrapped: it names the part now."""
    model = make_tiny("mixtral")
    expertflow.wrap(model.model.layers, cache_slots=2, device="cpu")
    with pytest.raises(WrapError, match=r"part model.layers \(ModuleList\) of this model is wrapped by expertflow.*"
                       r"Call expertflow.unwrap\(model.model.layers\), then convert"):
        model.half()
    expertflow.unwrap(model.model.layers)
    model.half()  # the same call converts the rest
    assert {p.dtype for p in model.parameters()} == {torch.float16}


def test_converting_an_experts_module_itself_is_refused():
    """The experts modules are guarded too, not only the modules above them."""
    model = make_tiny("mixtral")
    experts = model.model.layers[0].mlp.experts
    expertflow.wrap(model, cache_slots=2, device="cpu")
    try:
        snapshot = _snapshot(model)
        with pytest.raises(WrapError, match="converting it to torch.float16"):
            experts.half()
        assert _same(model, snapshot)
    finally:
        expertflow.unwrap(model)


def test_moving_a_wrapped_model_to_another_device_is_refused():
    """A move is refused like a dtype conversion (the meta device stands for a GPU on this machine)."""
    model = make_tiny("mixtral")
    expertflow.wrap(model, cache_slots=2, device="cpu")
    try:
        with pytest.raises(WrapError, match="converting it to torch.float32 on meta would leave them behind"):
            model.to("meta")
        assert all(p.device.type == "cpu" for p in model.parameters())
    finally:
        expertflow.unwrap(model)


def test_a_conversion_that_changes_only_some_of_the_experts_dtypes_is_refused():
    """A half model may keep some expert weights in fp32 (Switch / T5-style checkpoints keep `wo` in fp32): converting
    the wrapped model to the half dtype would convert the dense layers' `wo` and leave the experts' behind, so it is
    refused like any other conversion, before anything is converted, and so is the other direction."""
    model = make_tiny("switch_transformers").to(torch.bfloat16)
    for name, module in model.named_modules():
        if name.endswith(".wo"):
            module.float()
    snapshot = _snapshot(model)
    expertflow.wrap(model, cache_slots=2, device="cpu")
    try:
        dtypes = {name: p.dtype for name, p in model.named_parameters()}  # the dense layers' `wo` in fp32 too
        assert set(dtypes.values()) == {torch.bfloat16, torch.float32}
        for dtype in (torch.bfloat16, torch.float32):
            with pytest.raises(WrapError, match=rf"experts are torch.bfloat16 and torch.float32 in host memory .*"
                                                rf"converting it to {dtype} on cpu would leave them behind"):
                model.to(dtype)
            assert {name: p.dtype for name, p in model.named_parameters()} == dtypes
    finally:
        expertflow.unwrap(model)
    assert _same(model, snapshot)
    assert {k: v.dtype for k, v in model.state_dict().items()} == {k: v.dtype for k, v in snapshot.items()}


def test_loading_experts_through_a_module_that_holds_the_wrapped_model_is_refused():
    """The load guard reads the keys under the prefix it is called with: a container holding the wrapped model (prefix
    "lm.") is refused too, not silently left without its experts (strict=False)."""
    model = make_tiny("mixtral")
    outer = nn.ModuleDict({"lm": model})
    expertflow.wrap(model, cache_slots=2, device="cpu")
    try:
        state = {k: v + 1 for k, v in outer.state_dict().items()}
        with pytest.raises(WrapError, match=r"cannot load expert weights \(lm\.model\.layers"):
            outer.load_state_dict(state, strict=False)
    finally:
        expertflow.unwrap(model)


def test_wrap_given_a_cache_size_in_place_of_a_config_names_the_keyword():
    model = make_tiny("mixtral")
    with pytest.raises(TypeError, match=r"got int; the cache size is a keyword: wrap\(model, cache_slots=N\)"):
        expertflow.wrap(model, 64)


def test_a_part_used_after_its_wrapped_model_was_dropped_says_so():
    model = make_tiny("mixtral")
    expertflow.wrap(model, cache_slots=2, device="cpu")
    inner = model.model
    del model
    gc.collect()
    with pytest.raises(WrapError, match="was dropped without expertflow.unwrap.*keep the wrapped model"):
        inner(**batch("mixtral"))


def _hold_in_forward(model, inputs):
    """A thread inside the model's forward call (held in a forward pre-hook); returns it, its result dict and the
    event that lets it go on."""
    inside, release = threading.Event(), threading.Event()

    def hold(module, args):
        inside.set()
        release.wait(30)

    handle = model.register_forward_pre_hook(hold)
    result = {}

    def run():
        with torch.no_grad():
            result["logits"] = model(**inputs).logits

    thread = threading.Thread(target=run)
    thread.start()
    assert inside.wait(30)
    handle.remove()  # removed from the dict; the running call already has it
    return thread, result, release


def _hold_in_layer(model, hidden, index, weights):
    """A thread inside an experts module's call outside the model's forward (held by a route listener, inside the
    runtime's lock); returns it, its result dict and the event that lets it go on."""
    from expertflow.runtime import runtime_of

    inside, release = threading.Event(), threading.Event()

    def hold(*args):
        inside.set()
        release.wait(30)

    runtime_of(model).listeners.append(hold)
    result = {}

    def run():
        with torch.no_grad():
            result["out"] = model.model.layers[0].mlp.experts(hidden, index, weights)

    thread = threading.Thread(target=run)
    thread.start()
    assert inside.wait(30)
    return thread, result, release


@pytest.mark.parametrize("inside", ["the model's forward", "a layer"])
def test_unwrap_is_refused_while_another_thread_runs_the_model(inside):
    """unwrap would cancel the copies the running step waits for (it would compute from slots never filled): it is
    refused, the model stays wrapped and serves the step, and unwrap works once the step is done. The other thread is
    inside the model's forward call, or in an experts module called outside it."""
    model = make_tiny("mixtral")
    if inside == "a layer":
        torch.manual_seed(1)
        hidden, weights = torch.randn(3, 32), torch.rand(3, 2)
        index = torch.tensor([[0, 1], [2, 3], [1, 4]])
        with torch.no_grad():
            reference = model.model.layers[0].mlp.experts(hidden, index, weights)
    else:
        inputs = batch("mixtral")
        with torch.no_grad():
            reference = model(**inputs).logits
    snapshot = _snapshot(model)
    expertflow.wrap(model, cache_slots=2, device="cpu")
    if inside == "a layer":
        thread, result, release = _hold_in_layer(model, hidden, index, weights)
    else:
        thread, result, release = _hold_in_forward(model, inputs)
    try:
        with pytest.raises(WrapError, match="running a forward step in another thread: unwrap would cancel"):
            expertflow.unwrap(model)
        if inside != "a layer":
            assert expertflow.stats(model).steps == 0  # still wrapped, nothing computed yet
    finally:
        release.set()
        thread.join(30)
    assert torch.equal(result["out" if inside == "a layer" else "logits"], reference)
    expertflow.unwrap(model)
    assert _same(model, snapshot)


def test_a_forward_while_unwrap_restores_the_experts_is_told_unwrap_runs(monkeypatch):
    """Every layer's offloaded forward stays until all experts are back: a forward from another thread meanwhile is
    refused by the runtime (unwrap holds it), not run on a layer whose experts are half restored, and told why."""
    from expertflow.runtime import runtime_of

    model = make_tiny("mixtral")
    inputs = batch("mixtral")
    with torch.no_grad():
        reference = model(**inputs).logits
    expertflow.wrap(model, cache_slots=2, device="cpu")
    adapter = runtime_of(model).adapter
    restoring, go_on, seen = threading.Event(), threading.Event(), {}
    restore = type(adapter).restore_experts

    def slow_restore(self, layer, tensors):
        if layer.index == 0:  # about to put layer 0's experts back: a big copy, on a large model
            restoring.set()
            go_on.wait(30)
        restore(self, layer, tensors)

    monkeypatch.setattr(type(adapter), "restore_experts", slow_restore)
    thread = threading.Thread(target=expertflow.unwrap, args=(model,))
    thread.start()
    try:
        assert restoring.wait(30)
        with pytest.raises(RuntimeError, match="another thread is unwrapping this model") as error:
            with torch.no_grad():
                model(**inputs)
        seen["type"] = type(error.value)
    finally:
        go_on.set()
        thread.join(30)
    assert seen["type"] is RuntimeError
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, reference)


def test_wrapping_a_model_whose_part_is_wrapped_or_a_part_of_a_wrapped_model_names_what_to_unwrap():
    model = make_tiny("mixtral")
    expertflow.wrap(model.model, cache_slots=2, device="cpu")
    try:
        with pytest.raises(WrapError, match=r"part model \(MixtralModel\).*expertflow\.unwrap\(model\.model\)"):
            expertflow.wrap(model, cache_slots=2, device="cpu")
    finally:
        expertflow.unwrap(model.model)
    expertflow.wrap(model, cache_slots=2, device="cpu")
    try:
        with pytest.raises(WrapError, match=r"part 'model' of a MixtralForCausalLM that is already wrapped.*"
                                            r"expertflow\.unwrap\(<that MixtralForCausalLM>\)"):
            expertflow.wrap(model.model, cache_slots=2, device="cpu")
        assert expertflow.stats(model).steps == 0  # still wrapped, untouched
    finally:
        expertflow.unwrap(model)
    inner = model.model
    expertflow.wrap(model, cache_slots=2, device="cpu")
    del model  # dropped without unwrap: its store closes, and the part's experts with it
    gc.collect()
    with pytest.raises(WrapError, match=r"was part of a MixtralForCausalLM that was wrapped by expertflow and then "
                                        r"dropped without expertflow\.unwrap.*the experts are gone\. Load the "
                                        r"model again"):
        expertflow.wrap(inner, cache_slots=2, device="cpu")


def test_an_experts_modules_patched_forward_is_refused_by_name_before_anything_changes():
    """Wrapping replaces that forward and unwrap deletes it: the patch would be lost."""
    model = make_tiny("mixtral")
    experts = model.model.layers[1].mlp.experts
    experts.forward = patched = experts.forward
    snapshot = _snapshot(model)
    with pytest.raises(WrapError, match=r"experts module model\.layers\.1\.mlp\.experts .*patched forward.*"
                                        r"del model\.model\.layers\[1\]\.mlp\.experts\.forward"):
        expertflow.wrap(model, cache_slots=2, device="cpu")
    assert _same(model, snapshot) and experts.__dict__["forward"] is patched
    assert all("forward" not in m.__dict__ for m in model.modules() if m is not experts)


def _overlapping(p):
    """Two parameters of p's shape over one block of memory, one row apart."""
    block = torch.cat([p.data, p.data[:, :1]], dim=1)
    return nn.Parameter(block[:, :-1]), nn.Parameter(block[:, 1:])


# the same object, another object over the same memory (packed twice, untied at unwrap), or views that overlap
@pytest.mark.parametrize("share", [lambda p: (p, p), lambda p: (p, nn.Parameter(p.data)), _overlapping],
                         ids=["object", "memory", "views"])
def test_expert_weights_shared_between_layers_are_refused_before_anything_changes(share):
    model = make_tiny("mixtral")
    first, second = model.model.layers[0].mlp.experts, model.model.layers[1].mlp.experts
    first.down_proj, second.down_proj = share(first.down_proj)
    shared = second.down_proj
    inputs = batch("mixtral")
    reference = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    snapshot = _snapshot(model)
    with pytest.raises(WrapError, match=r"shared between layers model\.layers\.0\.mlp\.experts and "
                                        r"model\.layers\.1\.mlp\.experts are not supported"):
        expertflow.wrap(model, cache_slots=2, device="cpu")
    assert _same(model, snapshot) and second.down_proj is shared
    assert torch.equal(model.generate(**inputs, max_new_tokens=4, do_sample=False), reference)


def test_an_expert_of_another_dtype_than_its_layers_first_is_refused_before_anything_changes():
    """Switch's layout is read from expert_0: another expert in float16 failed an assertion while packing (and under
    python -O was packed as float32 and came back so)."""
    model = make_tiny("switch_transformers")
    experts = model.encoder.block[1].layer[1].mlp.experts
    experts["expert_1"].wi.weight.data = experts["expert_1"].wi.weight.data.half()
    snapshot = _snapshot(model)
    with pytest.raises(WrapError, match=r"expert 1 of encoder\.block\.1\.layer\.1\.mlp\.experts has wi of shape "
                                        r"\(\d+, \d+\) and dtype torch\.float16, where the layer's experts have"):
        expertflow.wrap(model, cache_slots=2, device="cpu")
    assert _same(model, snapshot) and experts["expert_1"].wi.weight.dtype == torch.float16


def test_a_weight_tied_by_memory_counts_once_in_the_device_bytes():
    """`lm_head.weight = nn.Parameter(embed.weight.data)` holds the memory once: counted twice, a gpu_budget that
    fits was refused."""
    from expertflow.runtime import runtime_of

    tied, untied = make_tiny("mixtral"), make_tiny("mixtral")
    tied.lm_head.weight = nn.Parameter(tied.model.embed_tokens.weight.data)
    sizes = []
    for model in (tied, untied):
        expertflow.wrap(model, cache_slots=2, device="cpu")
        sizes.append(runtime_of(model).plan.non_expert_bytes)
        expertflow.unwrap(model)
    embedding = tied.model.embed_tokens.weight
    assert sizes[1] - sizes[0] == embedding.numel() * embedding.element_size()
    # moved to another device, each parameter becomes a copy of its own there: both count
    from expertflow.adapters import find_adapter
    from expertflow.runtime import _non_expert_tensors

    tied.lm_head.weight = nn.Parameter(tied.model.embed_tokens.weight.data)
    adapter, layers = find_adapter(tied)
    held = {device: sum(t.numel() for t in _non_expert_tensors(tied, adapter, layers, torch.device(device)))
            for device in ("cpu", "cuda")}
    assert held["cuda"] - held["cpu"] == embedding.numel()


def _delegating_adapter(compute=None):
    """An adapter class that does everything through the experts-interface adapter, with `compute` as given (none:
    left out)."""
    from expertflow.adapters.base import Adapter
    from expertflow.adapters.experts3d import Experts3DAdapter

    inner = Experts3DAdapter()
    methods = {name: (lambda name: lambda self, *args: getattr(inner, name)(*args))(name)
               for name in ("find_layers", "expert_tensors", "expert_names", "remove_experts", "restore_experts",
                            "expert_state", "make_forward")}
    if compute is not None:
        methods["compute"] = compute
    return type("MyAdapter", (Adapter,), {"name": "mine", **methods})


@pytest.mark.parametrize("compute, match", [
    (None, r"adapter MyAdapter does not define compute\(module, hidden, top_k_index, top_k_weights, waves, plan\)"),
    (lambda self, module, hidden, index, weights, waves, plan: None, r"MyAdapter's compute is a method taking self"
                                                                     r".*@staticmethod"),
    (lambda cls, module, hidden, index, weights, waves, plan: None, r"MyAdapter's compute is a method taking cls"
                                                                    r".*@staticmethod"),
], ids=["left_out", "plain_method", "cls_without_classmethod"])
def test_an_adapter_without_a_static_compute_is_refused_at_wrap(compute, match, monkeypatch):
    import expertflow.adapters
    from expertflow.adapters.base import Adapter
    from expertflow.adapters.experts3d import Experts3DAdapter

    with pytest.raises(NotImplementedError):
        Adapter.compute(None, None, None, None, iter(()), (None, [], []))
    monkeypatch.setattr(expertflow.adapters, "_ADAPTERS", (_delegating_adapter(compute),))
    model = make_tiny("mixtral")
    snapshot = _snapshot(model)
    with pytest.raises(WrapError, match=match):
        expertflow.wrap(model, cache_slots=2, device="cpu")
    assert _same(model, snapshot)
    assert all("forward" not in m.__dict__ for m in model.modules())
    inputs = batch("mixtral")
    reference = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    # a static compute, and a plain function of the class that takes the module first (called on the class, it
    # gets the same arguments)
    for accepted in (staticmethod(lambda *args: Experts3DAdapter.compute(*args)),
                     lambda module, *args: Experts3DAdapter.compute(module, *args)):
        monkeypatch.setattr(expertflow.adapters, "_ADAPTERS", (_delegating_adapter(accepted),))
        expertflow.wrap(model, cache_slots=2, device="cpu")
        try:
            assert torch.equal(model.generate(**inputs, max_new_tokens=3, do_sample=False), reference)
        finally:
            expertflow.unwrap(model)


def test_an_adapter_whose_compute_is_a_classmethod_is_accepted(monkeypatch):
    """Called on the class, a classmethod gets the class bound and the same arguments a static method gets."""
    import expertflow.adapters
    from expertflow.adapters.experts3d import Experts3DAdapter

    compute = classmethod(lambda cls, *args: Experts3DAdapter.compute(*args))
    monkeypatch.setattr(expertflow.adapters, "_ADAPTERS", (_delegating_adapter(compute),))
    model = make_tiny("mixtral")
    inputs = batch("mixtral")
    reference = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    expertflow.wrap(model, cache_slots=2, device="cpu")
    try:
        assert torch.equal(model.generate(**inputs, max_new_tokens=3, do_sample=False), reference)
    finally:
        expertflow.unwrap(model)
