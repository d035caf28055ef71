"""CUDA checks (skipped without a GPU): pinned store, side-stream copies with events, exact tokens in fp32."""

from __future__ import annotations

import pytest
import torch

import expertflow
from expertflow.adapters import find_adapter
from families import batch, make_tiny

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "deepseek_v3", "gpt_oss", "switch_transformers"])
@pytest.mark.parametrize("fraction", [0.0, 0.25, 1.0])
def test_cuda_offload_matches_gpu_model(family, fraction):
    model = make_tiny(family)
    inputs = batch(family)
    total = sum(layer.num_experts for layer in find_adapter(model)[1])
    reference_model = make_tiny(family).cuda()
    reference = reference_model.generate(**{k: v.cuda() for k, v in inputs.items()}, max_new_tokens=12,
                                         do_sample=False)
    expertflow.wrap(model, cache_slots=max(1, round(total * fraction)), device="cuda")
    try:
        runtime = expertflow.runtime.runtime_of(model)
        assert runtime.store.buffers[0].is_pinned()
        assert next(model.parameters()).is_cuda
        out = model.generate(**{k: v.cuda() for k, v in inputs.items()}, max_new_tokens=12, do_sample=False)
        stats = expertflow.stats(model)
    finally:
        expertflow.unwrap(model)
    assert torch.equal(out, reference)
    assert stats.hits + stats.misses == stats.needs
    assert not next(model.parameters()).is_cuda  # unwrap puts the model back where it was


def test_cuda_budget_string_sizes_the_bank():
    model = make_tiny("mixtral")
    expertflow.wrap(model, gpu_budget="64MiB", device="cuda")
    try:
        runtime = expertflow.runtime.runtime_of(model)
        assert runtime.device_bytes <= 64 * 2**20
    finally:
        expertflow.unwrap(model)
