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
    assert not runtime.store._registrations  # page-locking released
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


@pytest.mark.parametrize("policy", ["lru", "lru-layer", "lfu", "lookahead", "prev-step", "expertflow"])
def test_cuda_every_policy_on_the_tiny_moe_gives_the_gpu_models_tokens(policy):
    """The built-in model with its trained predictor: prefetches, hand-offs and per-expert gates on real streams."""
    from transformers import AutoTokenizer

    from expertflow.models import tiny_moe

    model = tiny_moe(dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model.name_or_path)
    tokenizer.padding_side = "left"
    prompts = ["Translate to French: the cat sleeps on the mat.", "def add(a, b):", "What is 12 times 7?",
               "Summarize: the meeting was moved to Friday because the room was booked."]
    inputs = {k: v.cuda() for k, v in tokenizer(prompts, return_tensors="pt", padding=True).items()}
    gen = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False)
    reference = tiny_moe(dtype=torch.float32).eval().cuda().generate(**inputs, **gen)
    total = model.config.num_hidden_layers * model.config.num_local_experts
    for slots in (1, total // 4, total // 2):
        expertflow.wrap(model, cache_slots=slots, policy=policy, device="cuda")
        try:
            routes = expertflow.runtime.runtime_of(model).routes
            predictor_device = None if routes is None else routes.predictor.device.type
            out = model.generate(**inputs, **gen)
            stats = expertflow.stats(model).copy()
        finally:
            expertflow.unwrap(model)
        differ = int((out != reference).sum())
        assert differ == 0, f"{policy} at {slots} slots: {differ} tokens differ from the GPU model's"
        assert stats.hits + stats.misses == stats.needs
        assert stats.loads == stats.on_demand_loads + stats.prefetches
        if policy == "expertflow" and slots > 1:
            assert predictor_device == "cuda" and stats.predictor_s > 0


def _slow_reader(dst: torch.Tensor) -> torch.Tensor:
    """A compute-stream read of `dst` that starts ~50 ms from now (what a layer still reading a slot looks like)."""
    torch.cuda._sleep(100_000_000)
    return dst.clone()


def test_cuda_gated_prefetch_waits_for_the_compute_that_still_reads_its_slot():
    from expertflow.transfer import LOW, CudaTransferEngine, Gate

    engine = CudaTransferEngine(torch.device("cuda"))
    src = torch.full((1 << 20,), 7, dtype=torch.uint8).pin_memory()
    dst = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    gate = Gate()
    held = engine.submit(src, dst, LOW, gate=gate)
    behind = engine.submit(src, torch.zeros_like(dst), LOW)
    torch.cuda.synchronize()
    assert held.state == "queued" and behind.state == "queued", "a held copy holds the prefetch queue behind it"
    assert engine.cancel(behind) and behind.state == "cancelled"
    snapshot = _slow_reader(dst)
    engine.open_gate(gate, engine.slot_released())
    engine.wait(held)
    torch.cuda.synchronize()
    assert int(snapshot.sum()) == 0, "the copy overwrote the slot before the compute that read it"
    assert bool((dst == 7).all())


def test_cuda_demand_copy_waits_for_its_after_events_and_jumps_queued_prefetches():
    from expertflow.transfer import HIGH, LOW, CudaTransferEngine

    engine = CudaTransferEngine(torch.device("cuda"))
    src = torch.full((1 << 20,), 3, dtype=torch.uint8).pin_memory()
    dst = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    snapshot = _slow_reader(dst)
    demand = engine.submit(src, dst, HIGH, after=[engine.slot_released()])
    engine.wait(demand)
    check = dst.clone()  # compute stream, after the wait: must see the copy
    torch.cuda.synchronize()
    assert int(snapshot.sum()) == 0 and bool((check == 3).all())
    _slow_reader(dst)
    targets = [torch.zeros_like(dst) for _ in range(engine.MAX_LOW_IN_FLIGHT + 2)]
    blocked = [engine.slot_released()]  # in-flight prefetches wait ~50 ms on the device (and for the zero-fills)
    prefetches = [engine.submit(src, target, LOW, after=blocked) for target in targets]
    queued = [t for t in prefetches if t.state == "queued"]
    assert len(queued) == 2, "only MAX_LOW_IN_FLIGHT prefetches go to the stream; the rest stay cancellable"
    engine.promote(queued[0])
    assert queued[0].state == "running" and engine.cancel(queued[1])
    torch.cuda.synchronize()
    assert all(engine.is_done(t) for t in prefetches if t.state != "cancelled")


def test_cuda_stall_is_timed_on_the_device():
    from expertflow.transfer import HIGH, CudaTransferEngine

    engine = CudaTransferEngine(torch.device("cuda"))
    src = torch.full((1 << 20,), 5, dtype=torch.uint8).pin_memory()
    dst = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    filled = engine.slot_released()  # the copy lands after the zero-fill, as the cache orders a slot's copies
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)  # ~50 ms on another stream: the copy waits for it, the compute stream is idle
        busy = torch.cuda.Event()
        busy.record(side)
    ticket = engine.submit(src, dst, HIGH, after=[filled, busy])
    assert engine.wait(ticket) == 0.0, "no host wait on CUDA"
    check = dst.clone()
    stall = engine.collect_stall(block=True)
    assert 0.01 < stall < 1.0, stall
    assert bool((check == 5).all())
    spare = torch.zeros_like(dst)
    done = engine.submit(src, spare, HIGH, after=[engine.slot_released()])
    torch.cuda.synchronize()
    engine.wait(done)
    assert engine.collect_stall(block=True) == 0.0, "a copy that already landed is no stall"


def test_cuda_copy_into_a_slot_still_waits_for_an_older_copy_after_the_copy_between_is_cancelled():
    """A prefetch B that evicts a still-loading A waits for A's copy; when B is cancelled before it is issued (here
    by a demand C that needs the slot), C must still wait for A's copy, or A's bytes can land last over C's."""
    from expertflow.cache import ExpertCache
    from expertflow.counters import Stats
    from expertflow.policy import make_policy
    from expertflow.store import ExpertLayout, ExpertStore
    from expertflow.transfer import CudaTransferEngine

    layout = ExpertLayout.from_tensors([("w", (1 << 18,), torch.float32)])
    store = ExpertStore(layout.nbytes, pin_memory=True)
    store.add_layer(layout, [{"w": torch.full((1 << 18,), float(e))} for e in range(4)])
    engine = CudaTransferEngine(torch.device("cuda"))
    engine.MAX_LOW_IN_FLIGHT = 1  # the prefetch window is full once A is issued
    cache = ExpertCache(store, 1, make_policy("lru", 1, 1, 4), torch.device("cuda"), engine, Stats())
    try:
        with torch.cuda.stream(engine.low_stream):
            torch.cuda._sleep(200_000_000)  # A's copy lands ~0.1 s from now
        cache.prefetch([(0, 0)])  # A: issued behind the sleep
        cache.policy.on_access((0, 0))
        cache.prefetch([(0, 1)])  # B: evicts the loading A, held on the host
        cache.policy.on_access((0, 1))
        seen = [views["w"].clone() for wave in cache.request(0, 0, [2]) for _, views in wave]  # C evicts B
        torch.cuda.synchronize()
        assert bool((seen[0] == 2).all()), "C was computed before its bytes were in place"
        assert bool((cache.bank.views(0, 0, layout)["w"] == 2).all()), "A's older copy landed over C's"
    finally:
        engine.close()
        store.close()


def test_cuda_store_is_page_locked_and_a_failed_registration_leaves_no_pending_error():
    from expertflow.store import ExpertLayout, ExpertStore, _clear_cuda_error

    layout = ExpertLayout.from_tensors([("w", (1 << 16,), torch.float32)])
    store = ExpertStore(layout.nbytes, pin_memory=True, device="cuda")
    store.add_layer(layout, [{"w": torch.full((1 << 16,), float(e))} for e in range(3)])
    try:
        assert store.pin_memory and store.buffers[0].is_pinned()
        again = int(torch.cuda.cudart().cudaHostRegister(store.buffers[0].data_ptr(), 4096, 0))
        assert again != 0  # already registered: the error is now pending on this thread
        _clear_cuda_error(store.device)
        assert float((torch.ones(4, device="cuda") * 2).sum()) == 8.0  # the next kernel launch does not raise it
    finally:
        store.close()
    assert not store.buffers[0].is_pinned()
