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
from expertflow.transfer import LOW, CpuTransferEngine, Gate
from expertflow.runtime import runtime_of
from families import batch, make_tiny, random_predictor

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")

GEN = dict(max_new_tokens=3, do_sample=False)


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """A child forked after torch ran its thread pool can hang inside torch, wrapped or not: one thread here (as
    conftest sets for every test), whatever the run set before."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


_UNDER_PYTHONS_HANDLER = pytest.mark.skipif(signal.getsignal(signal.SIGINT) is not signal.default_int_handler,
                                             reason="Ctrl-C is held back only under Python's own handler")


def _ctrl_c_state() -> dict:
    """Whether Python's own Ctrl-C handler is in place, and whether a layer holds Ctrl-C back."""
    return {"default handler": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
            "held": transfer._Deferral.held}


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


def _wait_for(pid: int, timeout: float = 60.0) -> int:
    """The exit code of child `pid`; kill it and fail if it runs past `timeout`."""
    deadline = time.monotonic() + timeout
    while (done := os.waitpid(pid, os.WNOHANG)) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(f"the forked child still ran after {timeout:.0f} s (hung)")
        time.sleep(0.05)
    return os.waitstatus_to_exitcode(done[1])


@pytest.mark.parametrize("slots, link", [(64, None), (1, None), (3, "20MB/s")],
                         ids=["every expert resident", "one slot", "emulated link"])
def test_a_child_forked_inside_a_layer_that_goes_on_with_its_forward_is_refused_not_left_waiting(slots, link):
    """A fork from the forward's own thread (a listener here; a policy hook alike): the child returns into the layer
    and carries on. Its copies (queued, running or new) fail with the fork's explanation instead of waiting for a
    thread it does not have, and the layer's end lets go of the runtime's lock; then `unwrap` and generation work."""
    model = make_tiny("mixtral")
    inputs = batch("mixtral")
    reference = model.generate(**inputs, **GEN)
    expertflow.wrap(model, cache_slots=slots, device="cpu", policy="lru", link_bandwidth=link)
    forks = []

    def fork_here(step, layer, top_k_index, weights):
        if step == 1 and layer == 0 and not forks:
            forks.append(os.fork())

    runtime_of(model).listeners.append(fork_here)
    try:
        outcome = _attempt(lambda: model.generate(**inputs, **GEN))
    except BaseException:
        if forks == [0]:
            os._exit(3)  # the child never returns into the test runner
        raise
    if forks == [0]:  # the child, back from the fork inside the layer
        code = 4
        try:
            expertflow.unwrap(model)
            if "through a fork" in outcome and torch.equal(model.generate(**inputs, **GEN), reference):
                code = 0
        finally:
            os._exit(code)
    try:
        assert _wait_for(forks[0]) == 0, "the child was not refused with the fork's explanation, or unwrap failed"
        assert outcome == "ran"  # the parent's generate went on
    finally:
        expertflow.unwrap(model)


@_UNDER_PYTHONS_HANDLER
def test_a_worker_started_inside_a_layer_of_the_main_thread_gets_pythons_ctrl_c_handler_and_can_unwrap():
    """The layer holds Ctrl-C back and the runtime's lock, and the child never goes on with it (a worker process
    started from a hook): the fork gives Python's handler back in the child, and its `unwrap` is not refused."""
    model = make_tiny("mixtral")
    expertflow.wrap(model, cache_slots=3, device="cpu", policy="lru")
    seen = {}

    def start_a_worker(step, layer, top_k_index, weights):
        if not seen:
            seen["held"] = transfer._Deferral.held
            seen["child"] = _in_child(lambda: {**_ctrl_c_state(), "unwrap": _unwrapped(model)})

    runtime_of(model).listeners.append(start_a_worker)
    try:
        model.generate(**batch("mixtral"), **GEN)
    finally:
        expertflow.unwrap(model)
    if threading.current_thread() is threading.main_thread():
        assert seen["held"], "the layer should hold Ctrl-C back on the main thread"
    assert seen["child"] == {"default handler": True, "held": False, "unwrap": "ran"}


def _unwrapped(model) -> str:
    try:
        expertflow.unwrap(model)
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        return f"{type(exc).__name__}: {exc}"
    return "ran"


def test_the_link_time_of_a_child_forked_during_a_copy_stands_still():
    """A copy was on the emulated link at the fork: the child's `link_busy_s` does not go on counting it."""
    model = make_tiny("mixtral")
    inputs = batch("mixtral")
    expertflow.wrap(model, cache_slots=1, device="cpu", policy="lru", link_bandwidth="2MB/s")
    engine = runtime_of(model).cache.engine
    worker = threading.Thread(target=lambda: _attempt(lambda: model.generate(**inputs, **GEN)))
    worker.start()

    def twice():
        running = getattr(engine, "_running", None)
        first = expertflow.stats(model).link_busy_s
        time.sleep(0.3)
        return {"caught a copy": running is not None and running.state == "failed", "first": first,
                "later": expertflow.stats(model).link_busy_s}

    try:
        for _ in range(20):  # until the fork lands while a copy is on the link, while the generate runs
            while engine._running_since is None and worker.is_alive():
                time.sleep(0.001)
            child = _in_child(twice)
            if child["caught a copy"] or child["first"] != child["later"] or not worker.is_alive():
                break
    finally:
        worker.join(60)
        expertflow.unwrap(model)
    assert child["first"] == child["later"], child
    assert child["caught a copy"], "no fork landed while a copy was on the link"


@_UNDER_PYTHONS_HANDLER
def test_a_child_forked_while_the_main_thread_holds_ctrl_c_back_gets_pythons_handler_again():
    """A layer on the main thread holds Ctrl-C back; another thread forks meanwhile. In the child that thread is the
    main thread, and the layer that would give Python's handler back is not running there: the fork gives it back."""
    model = make_tiny("mixtral")
    expertflow.wrap(model, cache_slots=3, device="cpu", policy="lru")
    seen = {}

    def fork_from_another_thread(step, layer, top_k_index, weights):
        if not seen:
            seen["parent held"] = transfer._Deferral.held
            forker = threading.Thread(target=lambda: seen.update(child=_in_child(_ctrl_c_state)))
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


@pytest.mark.parametrize("state", ["queued", "running"])
def test_a_copy_taken_off_its_queue_but_not_yet_recorded_at_the_fork_fails_in_the_child(state):
    """The fork can land while the copy thread holds a copy it has taken off its queue and not yet recorded as the
    running one: in the child that copy is in no queue, and waiting for it, promoting or cancelling it must not wait
    for good or fail otherwise than with the fork's explanation."""
    engine = CpuTransferEngine()
    ticket = engine.submit(torch.ones(16, dtype=torch.uint8), torch.zeros(16, dtype=torch.uint8), LOW, tag="x",
                           gate=Gate())  # held: the copy thread leaves it alone
    with engine._cv:  # as the copy thread takes it, caught by the fork before it records it
        engine._queues[LOW].remove(ticket)
        ticket.state = state

    def child():
        engine.after_fork()  # what the runtime's fork hook does for its engine
        return {"promote": _attempt(lambda: engine.promote(ticket)), "cancel": engine.cancel(ticket),
                "wait": _attempt(ticket.wait)}

    try:
        seen = _in_child(child, timeout=20)
    finally:
        engine.close()
    assert seen["promote"] == "ran" and seen["cancel"] is False, seen
    assert "through a fork" in seen["wait"], seen


def test_a_kept_stats_object_keeps_no_slot_bank_or_store_alive_on_the_cpu():
    """The copy thread's last copy holds views of the slot bank and a whole store layer; the engine, which a kept
    `expertflow.stats(model)` holds, must not keep it once the copy is over."""
    import gc
    import weakref

    model = make_tiny("mixtral")
    expertflow.wrap(model, cache_slots=3, device="cpu", policy="lru")
    model.generate(**batch("mixtral"), **GEN)
    stats = expertflow.stats(model)
    runtime = runtime_of(model)
    buffers = [weakref.ref(runtime.cache.bank.data)] + [weakref.ref(b) for b in runtime.store.buffers]
    del runtime
    expertflow.unwrap(model)
    gc.collect()
    assert stats.needs > 0
    assert [ref() is None for ref in buffers] == [True] * len(buffers)
