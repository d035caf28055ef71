"""A process forked after `wrap` (a worker pool started from a loaded model): only the forking thread lives on in the
child, so the copy thread is gone and a lock held by another thread stays held. The child's forwards are refused
with the fix instead of waiting for copies no thread will make, and `expertflow.stats` and `unwrap` work there (after
which the model runs unwrapped, or can be wrapped again). The parent is not affected."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import pytest
import torch

import expertflow
from expertflow import transfer
from expertflow.runtime import runtime_of
from families import batch, make_tiny, random_predictor

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")

GEN = dict(max_new_tokens=3, do_sample=False)


def _in_child(body, timeout: float = 60.0) -> dict:
    """Run `body()` in a forked child and return the dict it returns; fail if the child hangs or dies."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave without running the parent's cleanups
        try:
            result = body()
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            result = {"child raised": f"{type(exc).__name__}: {exc}"}
        os.write(write, json.dumps(result).encode())
        os._exit(0)
    os.close(write)
    deadline = time.monotonic() + timeout
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(read)
            pytest.fail(f"the forked child still ran after {timeout:.0f} s (hung)")
        time.sleep(0.05)
    with os.fdopen(read, "rb") as pipe:
        data = pipe.read()
    assert data, "the forked child died without reporting"
    return json.loads(data)


def _attempt(call) -> str:
    try:
        call()
    except RuntimeError as exc:
        return str(exc)
    return "ran"


def _child_checks(model, inputs, reference) -> dict:
    """What the child finds: its forward refused, its counts readable, `unwrap` working, then the right tokens."""
    refused = _attempt(lambda: model.generate(**inputs, **GEN))
    counts = expertflow.stats(model).as_dict()
    expertflow.unwrap(model)
    return {"refused": refused, "needs": counts["needs"],
            "equal": torch.equal(model.generate(**inputs, **GEN), reference)}


@pytest.mark.parametrize("policy", ["lru", "expertflow"])
def test_a_child_forked_after_wrap_is_refused_with_the_fix_and_can_unwrap(policy, tmp_path):
    model = make_tiny("mixtral")
    inputs = batch("mixtral")
    reference = model.generate(**inputs, **GEN)
    options = dict(cache_slots=3, device="cpu", policy=policy, link_bandwidth="20MB/s")
    if policy == "expertflow":
        options["predictor"] = random_predictor(model, tmp_path)
    expertflow.wrap(model, **options)
    try:
        assert torch.equal(model.generate(**inputs, **GEN), reference)  # leaves prefetches queued or on the link
        child = _in_child(lambda: _child_checks(model, inputs, reference))
        assert "through a fork" in child["refused"] and "expertflow.unwrap(model)" in child["refused"], child
        assert child["needs"] > 0 and child["equal"], child
        assert torch.equal(model.generate(**inputs, **GEN), reference)  # the parent goes on as before
    finally:
        expertflow.unwrap(model)


def test_a_child_forked_while_another_thread_generates_is_not_told_to_wait_for_it():
    """The generating thread is inside a layer at the fork: the child inherits the runtime's locks held by a thread it
    does not have. It is refused for the fork (not for "another thread", which it could wait for forever), and its
    `unwrap` is not refused."""
    model = make_tiny("mixtral")
    inputs = batch("mixtral")
    reference = model.generate(**inputs, **GEN)
    expertflow.wrap(model, cache_slots=3, device="cpu", policy="lru")
    inside, forked = threading.Event(), threading.Event()

    def hold_in_the_first_layer(step, layer, top_k_index, weights):
        if not inside.is_set():
            inside.set()
            assert forked.wait(60)

    runtime_of(model).listeners.append(hold_in_the_first_layer)
    out = {}
    worker = threading.Thread(target=lambda: out.update(tokens=model.generate(**inputs, **GEN)))
    worker.start()
    try:
        assert inside.wait(60)
        child = _in_child(lambda: _child_checks(model, inputs, reference))
    finally:
        forked.set()
        worker.join(60)
        expertflow.unwrap(model)
    assert "through a fork" in child["refused"] and child["equal"], child
    assert torch.equal(out["tokens"], reference)


@pytest.mark.skipif(signal.getsignal(signal.SIGINT) is not signal.default_int_handler,
                    reason="Ctrl-C is held back only under Python's own handler")
def test_a_child_forked_while_the_main_thread_holds_ctrl_c_back_gets_pythons_handler_again():
    """A layer on the main thread holds Ctrl-C back; another thread forks meanwhile. In the child that thread is the
    main thread, and the layer that would give Python's handler back is not running there: the fork gives it back."""
    model = make_tiny("mixtral")
    expertflow.wrap(model, cache_slots=3, device="cpu", policy="lru")
    seen = {}

    def fork_from_another_thread(step, layer, top_k_index, weights):
        if not seen:
            seen["parent held"] = transfer._Deferral.held
            forker = threading.Thread(target=lambda: seen.update(child=_in_child(lambda: {
                "default handler": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
                "held": transfer._Deferral.held})))
            forker.start()
            forker.join(90)

    runtime_of(model).listeners.append(fork_from_another_thread)
    try:
        model.generate(**batch("mixtral"), **GEN)
    finally:
        expertflow.unwrap(model)
    assert seen["parent held"], "the layer should hold Ctrl-C back on the main thread"
    assert seen["child"] == {"default handler": True, "held": False}
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the parent's layer gave it back itself


def test_after_a_fork_closing_calls_no_cuda(monkeypatch):
    """On CUDA a forked child can make no CUDA call: after `after_fork`, `unwrap` (and the finalizer of a dropped
    model) close the engine without synchronizing the parent's streams or querying its events."""
    sys.path.insert(0, os.path.dirname(__file__))
    import emulated_cuda

    model = make_tiny("mixtral")
    inputs = batch("mixtral")
    reference = model.generate(**inputs, **GEN)
    with emulated_cuda.emulate(monkeypatch, seed=1, progress=0.05):  # copies lag: some are on the streams at the end
        expertflow.wrap(model, cache_slots=3, policy="prev-step", device="cpu")
        assert torch.equal(model.generate(**inputs, **GEN), reference)
        runtime_of(model).after_fork()  # what the fork hook does in the child

        def no_cuda(*args, **kwargs):
            raise RuntimeError("a CUDA call in a forked child")

        for name in ("synchronize", "query"):
            monkeypatch.setattr(emulated_cuda.FakeStream, name, no_cuda, raising=False)
            monkeypatch.setattr(emulated_cuda.FakeEvent, name, no_cuda, raising=False)
        assert "through a fork" in _attempt(lambda: model.generate(**inputs, **GEN))
        expertflow.stats(model).as_dict()
        expertflow.unwrap(model)
    assert torch.equal(model.generate(**inputs, **GEN), reference)
