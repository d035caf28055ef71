"""Bad input gets a clear error that names the fix, and a failed wrap leaves the model exactly as it was."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import expertflow
from expertflow.adapters import UnsupportedModelError
from expertflow.runtime import WrapError
from families import batch, make_tiny


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


def test_accelerator_needs_a_cache_size(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    model = make_tiny("mixtral")
    snapshot = _snapshot(model)
    with pytest.raises(WrapError, match="cache_slots=N .* or gpu_budget"):
        expertflow.wrap(model, device="cuda")
    assert _same(model, snapshot)



def test_a_cuda_device_this_machine_does_not_have(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    model = make_tiny("mixtral")
    snapshot = _snapshot(model)
    with pytest.raises(WrapError, match=r"device='cuda:3' but this machine has 1 CUDA device\(s\), numbered from 0"):
        expertflow.wrap(model, device="cuda:3", cache_slots=2)
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


def test_predictor_of_another_model_is_refused():
    from expertflow.predictor import default_predictor_path
    model = make_tiny("mixtral")  # the shipped predictor is for the built-in 6-layer, 32-expert model
    snapshot = _snapshot(model)
    with pytest.raises(WrapError, match="trained for another model: MoE layers 6 .*experts per layer 32"):
        expertflow.wrap(model, policy="expertflow", predictor=str(default_predictor_path()), device="cpu")
    assert _same(model, snapshot) and _copy_threads() == 0


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
    loss = model(**inputs, labels=inputs["input_ids"]).loss
    with pytest.raises(RuntimeError, match="inference only"):
        loss.backward()
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
    with pytest.warns(UserWarning, match="policy 'lru' does not use route predictions"):
        expertflow.wrap(model, policy="lru", predictor=str(default_predictor_path()), cache_slots=2, device="cpu")
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
