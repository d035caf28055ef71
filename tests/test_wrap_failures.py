"""Failures inside `wrap` and `unwrap` themselves: a rollback or an unwrap that is interrupted, runs out of memory
or fails after the runtime is built must leave a model that is either as it was or says what to do, never one that
has silently lost experts or keeps a dead runtime's hooks; and failures in the cache's bookkeeping that must leave no
expert looking resident without its bytes, nor a copy held for good."""

from __future__ import annotations

import threading

import pytest
import torch

import expertflow
from expertflow.cache import ExpertCache
from expertflow.runtime import runtime_of
from families import batch, make_tiny

GEN = dict(max_new_tokens=4, do_sample=False)


def _state(model) -> dict[str, torch.Tensor]:
    return {key: value.clone() for key, value in model.state_dict().items()}


def _same(model, state: dict[str, torch.Tensor]) -> bool:
    now = model.state_dict()
    return now.keys() == state.keys() and all(torch.equal(now[key], state[key]) for key in state)


def _copy_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("expertflow")]


@pytest.fixture
def qwen():
    model = make_tiny("qwen2_moe")
    inputs = batch("qwen2_moe")
    with torch.no_grad():
        reference = model.generate(**inputs, **GEN)
    return model, inputs, reference


def test_an_error_before_a_copy_is_queued_leaves_the_expert_not_resident(qwen, monkeypatch):
    """An error in the cache's bookkeeping between taking a slot and queueing its copy (here: while the evicted
    expert's copy is settled) must not leave the expert looking resident in a slot nothing fills: the next generate
    loads it again and gives the unwrapped tokens."""
    model, inputs, _ = qwen
    six = dict(GEN, max_new_tokens=6)
    with torch.no_grad():
        reference = model.generate(**inputs, **six)
    expertflow.wrap(model, cache_slots=5, device="cpu", policy="lfu")
    try:
        leaves = ExpertCache._leaves
        for failing in range(1, 7):
            calls = []

            def fails_once(self, key, ticket, calls=calls, failing=failing):
                calls.append(1)
                if len(calls) == failing:
                    raise RuntimeError("bookkeeping failed")
                return leaves(self, key, ticket)

            monkeypatch.setattr(ExpertCache, "_leaves", fails_once)
            with pytest.raises(RuntimeError, match="bookkeeping failed"), torch.no_grad():
                model.generate(**inputs, **six)
            monkeypatch.setattr(ExpertCache, "_leaves", leaves)
            with torch.no_grad():
                assert torch.equal(model.generate(**inputs, **six), reference), f"failure at call {failing}"
    finally:
        expertflow.unwrap(model)


def test_an_error_opening_a_held_copy_leaves_it_to_be_opened_when_the_request_ends(qwen):
    """A copy held until its slot's expert has computed (a hand-off): if letting it go raises, the request still lets
    it go as it ends, so the copies queued behind it are not held for good (the next generate would hang)."""
    model, inputs, reference = qwen
    expertflow.wrap(model, cache_slots=2, device="cpu", policy="lru")
    worker = None
    try:
        engine = runtime_of(model).cache.engine
        open_gate, calls = engine.open_gate, []

        def fails_once(*args, **kwargs):
            calls.append(1)
            if len(calls) == 5:
                raise RuntimeError("cannot open")
            return open_gate(*args, **kwargs)

        engine.open_gate = fails_once
        with pytest.raises(RuntimeError, match="cannot open"), torch.no_grad():
            model.generate(**inputs, **GEN)
        engine.open_gate = open_gate
        got = []
        worker = threading.Thread(target=lambda: got.append(model.generate(**inputs, **GEN)), daemon=True)
        with torch.no_grad():
            worker.start()
            worker.join(60)
        assert got and torch.equal(got[0], reference)
    finally:
        if worker is None or not worker.is_alive():
            expertflow.unwrap(model)
