"""Failures inside `wrap` and `unwrap` themselves: a rollback or an unwrap that is interrupted, runs out of memory
or fails after the runtime is built must leave a model that is either as it was or says what to do, never one that
has silently lost experts or keeps a dead runtime's hooks; and failures in the cache's bookkeeping that must leave no
expert looking resident without its bytes, nor a copy held for good."""

from __future__ import annotations

import logging
import signal
import threading

import pytest
import torch

import expertflow
from expertflow.adapters.experts3d import Experts3DAdapter
from expertflow.cache import ExpertCache
from expertflow.runtime import WrapError, runtime_of
from families import batch, make_tiny

GEN = dict(max_new_tokens=4, do_sample=False)


def _state(model) -> dict[str, torch.Tensor]:
    return {key: value.clone() for key, value in model.state_dict().items()}


def _same(model, state: dict[str, torch.Tensor]) -> bool:
    now = model.state_dict()
    return now.keys() == state.keys() and all(torch.equal(now[key], state[key]) for key in state)


def _copy_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("expertflow")]


def _on_restore(monkeypatch, call: int, action) -> list:
    """`action()` runs when the experts of a layer go back for the `call`-th time (it may raise); returns the calls
    seen."""
    restore, calls = Experts3DAdapter.restore_experts, []

    def restoring(self, layer, tensors):
        calls.append(1)
        if len(calls) == call:
            action()
        return restore(self, layer, tensors)

    monkeypatch.setattr(Experts3DAdapter, "restore_experts", restoring)
    return calls


def _raising(error: BaseException):
    def action(*args, **kwargs):
        raise error

    return action


def _ctrl_c() -> None:
    signal.raise_signal(signal.SIGINT)  # Python raises it at once here, unless it is held back


def _close_then_raise(monkeypatch, target, error: BaseException) -> None:
    """`target.close` does its work, then raises `error` (on CUDA an asynchronous error surfaces there)."""
    close = target.close

    def closing(self):
        close(self)
        raise error

    monkeypatch.setattr(target, "close", closing)


@pytest.fixture
def qwen():
    model = make_tiny("qwen2_moe")
    inputs = batch("qwen2_moe")
    with torch.no_grad():
        reference = model.generate(**inputs, **GEN)
    return model, inputs, reference


@pytest.mark.usefixtures("pythons_ctrl_c")
def test_ctrl_c_during_a_failed_wraps_rollback_is_held_until_every_expert_is_back(qwen, monkeypatch):
    """`wrap` fails after packing (here the device move); a Ctrl-C that lands while the rollback puts the experts back
    is raised only once they all are: the model is as it was, not left with experts modules emptied."""
    model, inputs, reference = qwen
    state, threads = _state(model), _copy_threads()
    calls = _on_restore(monkeypatch, 1, _ctrl_c)
    monkeypatch.setattr(type(model), "to", _raising(RuntimeError("out of device memory")))
    with pytest.raises(KeyboardInterrupt):
        expertflow.wrap(model, cache_slots=2, device="cpu")
    monkeypatch.undo()
    assert len(calls) > 1 and _same(model, state) and _copy_threads() == threads
    with torch.no_grad():
        assert torch.equal(model.generate(**inputs, **GEN), reference)


@pytest.mark.usefixtures("pythons_ctrl_c")
def test_ctrl_c_just_after_unwrap_takes_the_runtimes_lock_is_held_until_it_is_done(qwen):
    """A Ctrl-C landing as `unwrap` has taken the lock, before the code that lets it go, kept it taken: the model
    stayed wrapped, and every later generate and unwrap was refused as if another thread were running it."""
    model, inputs, reference = qwen
    state = _state(model)
    expertflow.wrap(model, cache_slots=2, device="cpu")
    runtime = runtime_of(model)

    class Lock:
        def __init__(self, lock):
            self.lock = lock

        def acquire(self, blocking=True):
            taken = self.lock.acquire(blocking)
            _ctrl_c()
            return taken

        def release(self):
            self.lock.release()

    lock = runtime._busy
    runtime._busy = Lock(lock)
    with pytest.raises(KeyboardInterrupt):
        expertflow.unwrap(model)
    assert not hasattr(model, "_expertflow_runtime") and _same(model, state) and lock.acquire(blocking=False)
    with torch.no_grad():
        assert torch.equal(model.generate(**inputs, **GEN), reference)


def test_a_failure_after_the_runtime_is_built_rolls_it_back_too(qwen):
    """An error once the runtime is attached (here a logging handler that raises on wrap's log line) leaves no
    runtime, hook, guard or copy thread on the model."""
    model, inputs, reference = qwen
    state, threads = _state(model), _copy_threads()
    pre_hooks, hooks = dict(model._forward_pre_hooks), dict(model._forward_hooks)

    class Raising(logging.Handler):
        def emit(self, record):
            raise RuntimeError("the log is full")

    logger = logging.getLogger("expertflow")
    handler, level = Raising(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logging.raiseExceptions, raising = True, logging.raiseExceptions
    handler.handleError = lambda record: (_ for _ in ()).throw(RuntimeError("the log is full"))
    try:
        with pytest.raises(RuntimeError, match="the log is full"):
            expertflow.wrap(model, cache_slots=2, device="cpu")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logging.raiseExceptions = raising
    assert not hasattr(model, "_expertflow_runtime") and "save_pretrained" not in model.__dict__
    assert dict(model._forward_pre_hooks) == pre_hooks and dict(model._forward_hooks) == hooks
    assert _same(model, state) and _copy_threads() == threads
    with torch.no_grad():
        assert torch.equal(model.generate(**inputs, **GEN), reference)
    expertflow.wrap(model, cache_slots=2, device="cpu")  # and it can be wrapped again
    expertflow.unwrap(model)


def test_unwrap_gives_back_an_instances_own_save_pretrained_and_apply(qwen):
    """A `save_pretrained` or `_apply` set on the instance (by its user, or a library) stands behind the guards while
    wrapped: a conversion the guard allows goes to that `_apply`; unwrap (as a failed wrap's rollback) puts both back
    (they were deleted)."""
    model, _, _ = qwen
    calls = []

    def own_save(*args, **kwargs):
        calls.append("save")

    def own_apply(fn, *args, **kwargs):
        calls.append("apply")
        return type(model.model)._apply(model.model, fn, *args, **kwargs)

    model.save_pretrained, model.model._apply = own_save, own_apply
    try:
        expertflow.wrap(model, cache_slots=2, device="cpu")
        calls.clear()  # what wrap did itself
        with pytest.raises(WrapError, match="without its experts"):
            model.save_pretrained("anywhere")
        model.float()  # allowed: nothing changes
        assert "apply" in calls and "save" not in calls
        expertflow.unwrap(model)
        assert model.__dict__["save_pretrained"] is own_save and model.model.__dict__["_apply"] is own_apply
    finally:
        del model.save_pretrained, model.model._apply


@pytest.mark.parametrize("failing", ["runtime", "engine"])
def test_a_rollback_puts_the_experts_back_even_if_closing_the_runtime_fails(qwen, monkeypatch, failing):
    """A failure after the runtime is attached, then one while the rollback closes it (on CUDA an asynchronous error
    can surface in the engine's close, before the runtime's hooks are removed): the experts still come back, and no
    hook of the dead runtime stays on the model (its state_dict hooks would give the emptied store's experts)."""
    from expertflow.runtime import OffloadRuntime
    from expertflow.transfer import CpuTransferEngine

    model, inputs, reference = qwen
    state = _state(model)
    hooks = (dict(model._forward_pre_hooks), dict(model._forward_hooks))
    _close_then_raise(monkeypatch, OffloadRuntime if failing == "runtime" else CpuTransferEngine,
                      RuntimeError("device error"))
    monkeypatch.setattr(logging.getLogger("expertflow.runtime"), "info", _raising(RuntimeError("the log is full")))
    with pytest.raises(RuntimeError, match="device error"):
        expertflow.wrap(model, cache_slots=2, device="cpu")
    monkeypatch.undo()
    assert not hasattr(model, "_expertflow_runtime") and _same(model, state)
    assert (dict(model._forward_pre_hooks), dict(model._forward_hooks)) == hooks
    model.load_state_dict(state)  # no guard left
    with torch.no_grad():
        assert torch.equal(model.generate(**inputs, **GEN), reference)


def test_an_engine_that_failed_to_close_is_still_closed_when_the_model_is_dropped(monkeypatch):
    """The engine's close fails before it stops the copy thread: the unwrap fails, and the model is then dropped
    without another unwrap. The finalizer, kept because the close failed, still stops the copy thread."""
    import gc

    from expertflow.transfer import CpuTransferEngine

    model = make_tiny("qwen2_moe")
    threads = _copy_threads()
    expertflow.wrap(model, cache_slots=2, device="cpu")
    calls = []

    def failing_close(self):
        calls.append(1)
        raise RuntimeError("device error")

    monkeypatch.setattr(CpuTransferEngine, "close", failing_close)
    with pytest.raises(WrapError, match="device error"):
        expertflow.unwrap(model)
    assert _copy_threads() != threads
    monkeypatch.undo()
    del model
    gc.collect()
    assert calls and _copy_threads() == threads


def test_closing_the_runtime_raises_a_ctrl_c_before_an_earlier_error(qwen, monkeypatch):
    """Two parts of the close fail: an error, then a Ctrl-C (under an application's own handler). The Ctrl-C is what
    the caller gets, not the error, and a second unwrap finishes."""
    from expertflow.transfer import CpuTransferEngine

    model, inputs, reference = qwen
    expertflow.wrap(model, cache_slots=2, device="cpu")
    monkeypatch.setattr(CpuTransferEngine, "collect_stall", _raising(RuntimeError("device error")))
    _close_then_raise(monkeypatch, CpuTransferEngine, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        expertflow.unwrap(model)
    monkeypatch.undo()
    expertflow.unwrap(model)
    with torch.no_grad():
        assert torch.equal(model.generate(**inputs, **GEN), reference)


def test_a_failure_building_the_runtime_then_in_its_close_leaves_no_guard(qwen, monkeypatch):
    """A failure inside the runtime's construction after the guards are in, then one closing it: the guards go too
    (the runtime is not attached yet, so the rollback would not find them), or the model refuses `half()` and
    `save_pretrained` for good."""
    import weakref

    import expertflow.runtime as runtime_module
    from expertflow.transfer import CpuTransferEngine

    class FailingRegistry(weakref.WeakValueDictionary):
        def __setitem__(self, key, value):
            raise RuntimeError("registration failed")

    model, inputs, reference = qwen
    monkeypatch.setattr(runtime_module, "_LIVE", FailingRegistry())
    _close_then_raise(monkeypatch, CpuTransferEngine, RuntimeError("device error"))
    with pytest.raises(RuntimeError, match="device error"):
        expertflow.wrap(model, cache_slots=2, device="cpu")
    monkeypatch.undo()
    assert not any("_apply" in module.__dict__ or "save_pretrained" in module.__dict__ for module in model.modules())
    with torch.no_grad():
        assert torch.equal(model.generate(**inputs, **GEN), reference)


def test_an_unwrap_whose_close_fails_says_so_and_can_be_finished(qwen, monkeypatch):
    """Closing the runtime is part of the guarded step: an error there (on CUDA, one surfacing in the engine's close)
    is a `WrapError` that says to call unwrap again, the model refuses to run meanwhile (not "it was unwrapped"), and
    a second unwrap finishes it."""
    from expertflow.transfer import CpuTransferEngine

    model, inputs, reference = qwen
    state = _state(model)
    expertflow.wrap(model, cache_slots=2, device="cpu")
    _close_then_raise(monkeypatch, CpuTransferEngine, RuntimeError("device error"))
    with pytest.raises(WrapError, match="0 of .* MoE layers.*unwrap\\(model\\) again.*device error"):
        expertflow.unwrap(model)
    monkeypatch.undo()
    with pytest.raises(WrapError, match="unwrap\\(model\\) again"), torch.no_grad():
        model.generate(**inputs, **GEN)
    assert _same(model, state)  # the experts from the store
    expertflow.unwrap(model)
    assert not hasattr(model, "_expertflow_runtime") and _same(model, state)
    assert not model._forward_pre_hooks and not model._forward_hooks
    with torch.no_grad():
        assert torch.equal(model.generate(**inputs, **GEN), reference)


def test_a_hook_registered_before_a_failing_registration_is_removed(qwen, monkeypatch):
    """`wrap` fails registering the forward hook that follows the runtime's pre-hook: the pre-hook goes too (else it
    would keep the dead runtime, its host store and slot bank, alive on the model)."""
    model, _, _ = qwen
    pre_hooks = dict(model._forward_pre_hooks)

    def failing(*args, **kwargs):
        raise RuntimeError("no more hooks")

    monkeypatch.setattr(type(model), "register_forward_hook", failing)
    with pytest.raises(RuntimeError, match="no more hooks"):
        expertflow.wrap(model, cache_slots=2, device="cpu")
    assert dict(model._forward_pre_hooks) == pre_hooks


def test_an_unwrap_that_fails_part_way_says_so_and_can_be_finished(qwen, monkeypatch):
    """Out of memory while the experts go back: `unwrap` names how far it got and the fix; meanwhile the model
    refuses to run or save instead of serving from a closed runtime or writing a checkpoint without experts; each
    layer's host bytes are freed once its experts are back (a second call needs no more memory than the first);
    calling `unwrap` again finishes it, bit for bit."""
    model, inputs, reference = qwen
    state = _state(model)
    expertflow.wrap(model, cache_slots=2, device="cpu")
    runtime = runtime_of(model)
    total = len(runtime.layers)
    _on_restore(monkeypatch, 2, _raising(MemoryError("out of host memory")))
    with pytest.raises(WrapError, match=f"1 of {total} MoE layers.*unwrap\\(model\\) again.*out of host memory"):
        expertflow.unwrap(model)
    monkeypatch.undo()
    assert runtime.store.buffers[0].numel() == 0 and runtime.store.buffers[1].numel() > 0
    with pytest.raises(WrapError, match="unwrap\\(model\\) again"), torch.no_grad():
        model.generate(**inputs, **GEN)
    with pytest.raises(WrapError, match="save_pretrained"):
        model.save_pretrained("/nonexistent")
    with pytest.raises(WrapError, match="unwrap\\(model\\) again"):
        expertflow.stats(model)
    assert _same(model, state)  # state_dict: the experts not back yet from the store
    with pytest.raises(WrapError, match="cannot load expert weights"):
        model.load_state_dict({key: value for key, value in state.items() if "layers.3.mlp.experts" in key},
                              strict=False)
    expertflow.unwrap(model)
    assert not hasattr(model, "_expertflow_runtime") and _same(model, state)
    with torch.no_grad():
        assert torch.equal(model.generate(**inputs, **GEN), reference)


def test_an_unwrap_cut_short_by_an_exception_not_an_error_says_so_and_can_be_finished(qwen, monkeypatch):
    """A `KeyboardInterrupt` raised by code (an application's own SIGINT handler raises it wherever it lands) while the
    experts go back: the model is marked unfinished as for an error, its state_dict still has every expert, and a
    second unwrap finishes it."""
    model, inputs, reference = qwen
    state = _state(model)
    expertflow.wrap(model, cache_slots=2, device="cpu")
    _on_restore(monkeypatch, 2, _raising(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        expertflow.unwrap(model)
    monkeypatch.undo()
    assert _same(model, state)
    with pytest.raises(WrapError, match="unwrap\\(model\\) again"):
        expertflow.stats(model)
    with pytest.raises(WrapError, match="unwrap\\(model\\) again"), torch.no_grad():
        model.generate(**inputs, **GEN)
    expertflow.unwrap(model)
    assert _same(model, state)
    with torch.no_grad():
        assert torch.equal(model.generate(**inputs, **GEN), reference)


@pytest.mark.usefixtures("pythons_ctrl_c")
def test_ctrl_c_during_unwrap_is_held_until_every_expert_is_back(qwen, monkeypatch):
    """A Ctrl-C (Python's own handler) while unwrap puts the experts back is raised once they all are: the model is
    unwrapped, not left unfinished."""
    model, inputs, reference = qwen
    expertflow.wrap(model, cache_slots=2, device="cpu")
    total = len(runtime_of(model).layers)
    calls = _on_restore(monkeypatch, 1, _ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        expertflow.unwrap(model)
    monkeypatch.undo()
    assert len(calls) == total and not hasattr(model, "_expertflow_runtime")
    with torch.no_grad():
        assert torch.equal(model.generate(**inputs, **GEN), reference)


@pytest.mark.parametrize("family", ["qwen2_moe", "switch_transformers"])
def test_unwrap_frees_each_layers_host_copy_once_its_experts_are_back(family, monkeypatch):
    """The README's memory bound for unwrap: each layer's host bytes are freed once its experts are back (not kept by
    a view), and a layer's stacked copy is gone before the next layer's is made."""
    import weakref

    model = make_tiny(family)
    expertflow.wrap(model, cache_slots=3, device="cpu")
    store = runtime_of(model).store
    per_layer = [buffer.untyped_storage().nbytes() for buffer in store.buffers]
    stacked, held, made = store.stacked, {}, []

    def watched(layer, name):
        alive = sum(ref() is not None for index, ref in made if index != layer)
        held.setdefault(layer, (sum(buffer.untyped_storage().nbytes() for buffer in store.buffers), alive))
        out = stacked(layer, name)
        made.append((layer, weakref.ref(out)))
        return out

    monkeypatch.setattr(store, "stacked", watched)
    expertflow.unwrap(model)
    assert list(held.values()) == [(sum(per_layer[i:]), 0) for i in range(len(per_layer))]
    assert sum(buffer.untyped_storage().nbytes() for buffer in store.buffers) == 0


def test_unwrap_takes_the_guards_off_before_moving_the_model_back(qwen):
    """A model wrapped onto another device than the one it came from (a GPU, the usual case): the conversion guards
    refuse moving it away from the serving device, so unwrap must take them off first. The guards are put in as for
    another serving device, which a CPU can stand in for only this way."""
    import dataclasses

    from expertflow import runtime as runtime_module

    model, inputs, reference = qwen
    expertflow.wrap(model, cache_slots=2, device="cpu")
    runtime = runtime_of(model)
    runtime_module._uninstall_guards(model)
    runtime.plan = dataclasses.replace(runtime.plan, device=torch.device("meta"))
    runtime_module._install_guards(model, runtime)  # they now refuse moving the model to the CPU
    expertflow.unwrap(model)
    assert not hasattr(model, "_expertflow_runtime")
    with torch.no_grad():
        assert torch.equal(model.generate(**inputs, **GEN), reference)


def test_a_shallow_copy_after_an_unwrap_that_failed_then_finished_is_told_it_is_stale(qwen, monkeypatch):
    """The unwrap that finishes clears the failed mark: whatever reads the runtime a shallow copy still carries finds
    it unwrapped, not unfinished."""
    import copy

    model, _, _ = qwen
    expertflow.wrap(model, cache_slots=2, device="cpu")
    runtime = runtime_of(model)
    shallow = copy.copy(model)
    _on_restore(monkeypatch, 2, _raising(MemoryError("out of host memory")))
    with pytest.raises(WrapError):
        expertflow.unwrap(model)
    monkeypatch.undo()
    expertflow.unwrap(model)
    assert runtime.unwrapped and not runtime.unwrap_failed
    with pytest.raises(WrapError, match="shallow copy"):
        expertflow.stats(shallow)


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


def test_stats_from_another_thread_while_unwrap_runs_are_the_live_stats(qwen, monkeypatch):
    """Only an unwrap that failed makes `stats` refuse: polled while an unwrap is still putting experts back, it
    answers as before."""
    model, _, _ = qwen
    expertflow.wrap(model, cache_slots=2, device="cpu")
    restoring, go_on, seen = threading.Event(), threading.Event(), []
    restore = Experts3DAdapter.restore_experts

    def slow(self, layer, tensors):
        restoring.set()
        go_on.wait(30)
        return restore(self, layer, tensors)

    monkeypatch.setattr(Experts3DAdapter, "restore_experts", slow)
    thread = threading.Thread(target=expertflow.unwrap, args=(model,))
    thread.start()
    try:
        assert restoring.wait(30)
        seen.append(expertflow.stats(model))
    finally:
        go_on.set()
        thread.join(30)
    assert seen and not hasattr(model, "_expertflow_runtime")


def test_unwrap_leaves_no_store_layer_held_by_copies_never_awaited():
    """Prefetches left queued at the end of a generate hold views of their store layers: `unwrap` drops them, so each
    layer's host bytes go once its experts are back, also while a shallow copy keeps the runtime."""
    import copy

    model = make_tiny("qwen2_moe")
    inputs = batch("qwen2_moe")
    expertflow.wrap(model, cache_slots=2, device="cpu", policy="lookahead")
    runtime = runtime_of(model)
    with torch.no_grad():
        model.generate(**inputs, **GEN)
    runtime.cache.prefetch([(layer, e) for layer in range(len(runtime.layers)) for e in range(8)])  # some left queued
    shallow = copy.copy(model)
    held = len(runtime.cache._tickets)
    expertflow.unwrap(model)
    assert held and not runtime.cache._tickets and shallow is not None


def test_an_unwrap_whose_last_move_fails_says_so_and_can_be_finished(qwen, monkeypatch):
    """Every expert is back but moving the model to its original device fails (out of host memory on a GPU-wrapped
    model): the model refuses to run, convert and give stats, with the fix, until `unwrap` is called again."""
    model, inputs, reference = qwen
    state = _state(model)
    expertflow.wrap(model, cache_slots=2, device="cpu")
    to, calls = type(model).to, []

    def failing_once(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("out of host memory")
        return to(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "to", failing_once)
    with pytest.raises(WrapError, match="not all moved back to cpu.*unwrap\\(model\\) again.*out of host memory"):
        expertflow.unwrap(model)
    with pytest.raises(WrapError, match="unwrap\\(model\\) again"), torch.no_grad():
        model.generate(**inputs, **GEN)
    with pytest.raises(WrapError, match="unwrap\\(model\\) again"):
        expertflow.stats(model)
    with pytest.raises(WrapError):
        model.half()
    expertflow.unwrap(model)
    monkeypatch.undo()
    assert not hasattr(model, "_expertflow_runtime") and _same(model, state)
    with torch.no_grad():
        assert torch.equal(model.generate(**inputs, **GEN), reference)


def test_unwrap_from_inside_a_layer_is_refused_as_such():
    """A hook on a module an MoE layer runs (a Switch expert's `act`) that calls `unwrap` is refused with what it did,
    not told that another thread is running."""
    model = make_tiny("switch_transformers")
    inputs = batch("switch_transformers")
    inputs["decoder_input_ids"] = inputs["input_ids"][:, :3]
    errors = []

    def unwrapping(module, args, output):
        try:
            expertflow.unwrap(model)
        except WrapError as error:
            errors.append(str(error))

    experts = model.encoder.block[1].layer[1].mlp.experts
    handles = [experts[f"expert_{e}"].act.register_forward_hook(unwrapping) for e in range(len(experts))]
    expertflow.wrap(model, cache_slots=3, device="cpu")
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        for handle in handles:
            handle.remove()
        expertflow.unwrap(model)
    assert errors and all("from inside one of the model's MoE layers" in error for error in errors)


def test_unwrap_while_another_thread_unwraps_is_refused_as_such(qwen, monkeypatch):
    """The thread that ran the last step calls `unwrap` while another thread's unwrap is restoring: it is told so,
    not that it called unwrap from inside a layer."""
    model, inputs, _ = qwen
    expertflow.wrap(model, cache_slots=3, device="cpu")
    with torch.no_grad():
        model.generate(**inputs, **GEN)  # this thread ran the last step
    restore, started, go = Experts3DAdapter.restore_experts, threading.Event(), threading.Event()

    def held(self, layer, tensors):
        started.set()
        go.wait(60)
        return restore(self, layer, tensors)

    monkeypatch.setattr(Experts3DAdapter, "restore_experts", held)
    other = threading.Thread(target=expertflow.unwrap, args=(model,), daemon=True)
    other.start()
    try:
        assert started.wait(60)
        with pytest.raises(WrapError, match="another thread is unwrapping this model"):
            expertflow.unwrap(model)
    finally:
        go.set()
        other.join(60)
    assert not hasattr(model, "_expertflow_runtime")


def test_an_error_settling_an_evicted_experts_queued_prefetch_cancels_it(qwen, monkeypatch):
    """The error of the test above, when the evicted expert's copy is a prefetch still queued: that copy is cancelled,
    not left to land later over the slot's next occupant (every expert is computed from its own bytes)."""
    model, inputs, _ = qwen
    expertflow.wrap(model, cache_slots=14, device="cpu", policy="prev-step", link_bandwidth="200KB/s")
    try:
        cache = runtime_of(model).cache
        request, wrong = cache.request, []

        def checked(step, layer, experts, upcoming=None):
            waves = request(step, layer, experts, upcoming)
            try:
                for wave in waves:
                    for expert, views in wave:
                        own = cache.store.expert_tensors(layer, expert)
                        if not all(torch.equal(views[name], own[name]) for name in own):
                            wrong.append((step, layer, expert))
                    yield wave
            finally:
                waves.close()

        cache.request = checked
        leaves, armed = ExpertCache._leaves, [False]

        def fails_on_a_queued_copy(self, key, ticket):
            if armed[0] and ticket is not None and ticket.state == "queued":
                armed[0] = False
                raise RuntimeError("bookkeeping failed")
            return leaves(self, key, ticket)

        monkeypatch.setattr(ExpertCache, "_leaves", fails_on_a_queued_copy)
        with torch.no_grad():
            model.generate(**inputs, **GEN)
            armed[0] = True
            with pytest.raises(RuntimeError, match="bookkeeping failed"):
                model.generate(**inputs, **GEN)
            assert not armed[0]
            for _ in range(2):
                model.generate(**inputs, **GEN)
        assert wrong == []
    finally:
        expertflow.unwrap(model)
