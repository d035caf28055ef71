"""`wrap`, `unwrap` and `stats`: turn a Hugging Face MoE model into one whose experts live in host memory and are
served to each MoE layer from a device slot bank, and back.

Owns: the sequence of reversible steps of wrapping (validate → pack experts into the store → drop the model's expert
parameters → move the rest to the device → install the offloaded forwards), their rollback on failure, and the
per-forward bookkeeping (step counter, routing → cache request → compute). Does not know: Hugging Face classes (the
adapter does), eviction choices (the policy does) or streams (the transfer engine does).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import os
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from expertflow.adapters import MoELayer, find_adapter
from expertflow.adapters.base import Adapter
from expertflow.cache import ExpertCache
from expertflow.config import Config, check_policy_options, parse_bytes
from expertflow.policy import make_policy
from expertflow.policy.base import Policy, policy_class
from expertflow.counters import Stats
from expertflow.errors import WrapError
from expertflow.store import ExpertStore
from expertflow.transfer import FORKED as _FORKED, interrupts_deferred, make_engine

__all__ = ["wrap", "unwrap", "stats", "runtime_of", "WrapError", "OffloadRuntime"]

log = logging.getLogger(__name__)
_ATTR = "_expertflow_runtime"


_CALL_IMPL = nn.Module._call_impl.__code__  # the frame that runs a module's hooks and forward
_MODULE_APPLY = nn.Module._apply.__code__  # the frame that converts a module's tensors and its children's


def module_calls(frame, matches: Callable[[nn.Module], bool], first: bool = False) -> int:
    """How many calls of modules that `matches` the stack from `frame` outwards is inside (with `first`, 1 as soon as
    one is found)."""
    calls = 0
    while frame is not None:
        if frame.f_code is _CALL_IMPL and matches(frame.f_locals.get("self")):
            calls += 1
            if first:
                break
        frame = frame.f_back
    return calls

_THREADS = ("this wrapped model is running a forward step in another thread: a wrapped model serves one thread at "
            "a time (its cache, copy queue and route predictor hold the state of the running step). Use one wrapped "
            "model per thread, or hold a lock around each generate call")
_UNWRAPPING = ("another thread is unwrapping this model (expertflow.unwrap): it cannot run meanwhile. Once unwrap "
               "returns it runs unwrapped; wrap it again to serve it offloaded")
_STALE_COPY = ("this is a shallow copy of a wrapped model that has since been unwrapped (through the original or "
               "another copy): its experts are back in the model and its counters ended then. Call expertflow.unwrap "
               "on this copy too, which clears what it still carries, then wrap it again if you want it offloaded")
_DROPPED = ("the wrapped model this module belongs to was dropped without expertflow.unwrap, which closed its "
            "expert store and copy thread; keep the wrapped model (or a shallow copy) while you use its parts, or "
            "unwrap it before taking them apart")
_UNWRAP_UNFINISHED = ("expertflow.unwrap(model) failed part-way on this model ({done} of {total} MoE layers have their "
                      "experts back{moved}): it cannot run until unwrap is done; free memory if that was the cause and "
                      "call expertflow.unwrap(model) again")
_UNWRAP_INSIDE = ("expertflow.unwrap(model) was called from inside one of the model's MoE layers (a hook on a module "
                  "the layer runs): it would take the experts away mid-layer. Call it after the forward returns")
_UNWRAP_TWICE = ("another thread is unwrapping this model now: once its expertflow.unwrap(model) returns, the model is "
                 "unwrapped (or, if that unwrap failed, it says so and unwrap can be called again)")
_UNWRAP_BUSY = ("this wrapped model is running a forward step in another thread: unwrap would cancel the copies that "
                "step waits for and take its experts away mid-step. Call expertflow.unwrap(model) after that "
                "thread's generate/forward call returns (hold one lock around each generate call and the unwrap)")


class WrapTypeError(WrapError, TypeError):
    """A setting of the wrong kind (an unknown keyword, a config that is not a Config): a WrapError, and still the
    TypeError Python raises for an unknown keyword argument."""


@dataclass
class Plan:
    """Everything `wrap` decides before it changes the model."""

    device: torch.device
    num_slots: int
    slot_bytes: int
    total_experts: int
    expert_bytes: int  # bytes of all experts, packed
    non_expert_bytes: int


@dataclass
class OffloadRuntime:
    """The state a wrapped model carries (as `model._expertflow_runtime`)."""

    config: Config
    adapter: Adapter
    layers: list[MoELayer]
    store: ExpertStore
    cache: ExpertCache
    plan: Plan
    original_device: torch.device
    stats: Stats
    step: int = -1
    _last_layer: int = 10**9
    _step_start: int = 0  # the first MoE layer of the running step
    _entered: int | None = None  # the thread whose forward call of the model began and has run no MoE layer yet
    _pass: int = 0  # layers run again so far in the running step (a looped model's passes)
    _loops: dict[tuple[int, int], int] = field(default_factory=dict)  # (layer, pass) -> the layer run after it
    _planned_step: int = -1  # the step `plan_step` prepared
    _planned_occupancy: list[int] | None = None  # its `slots_per_layer` row, recorded when its first MoE layer runs
    listeners: list[Callable] = field(default_factory=list)  # called as fn(step, layer, top_k_index, weights)
    routes: "RouteForecast | None" = None  # the route predictor's hook, for policies that want predictions
    _finalizer: "weakref.finalize | None" = field(default=None, repr=False)  # closes engine and store if the model dies
    _busy: threading.Lock = field(default_factory=threading.Lock, repr=False)  # one layer or plan at a time
    _owner: int | None = None  # the thread running the current forward step
    _holder: int | None = None  # the thread inside `exclusive` (a layer, or a step's plan), holding `_busy`
    _unwrapping: bool = False  # `unwrap` holds `_busy`
    _forward_owner: int | None = None  # the thread inside the model's forward call (`enter_forward`)
    _hooks: list = field(default_factory=list, repr=False)  # removed by `close`: forward call, state dict
    _forwards: list[Callable] = field(default_factory=list, repr=False)  # each layer's (`_OffloadedForward` calls it)
    _watch: threading.Lock = field(default_factory=threading.Lock, repr=False)  # guards `_forward_owner`
    unwrapped: bool = False  # set by `unwrap`: a shallow copy of the model still carrying this runtime is stale
    unwrap_failed: bool = False  # set by an `unwrap` that failed part-way: the model cannot run until it is done
    forked: bool = False  # set in a child process forked after `wrap` (`after_fork`): its forwards are refused

    def __deepcopy__(self, memo):  # copy.deepcopy(model) and pickling reach the runtime through the model's __dict__
        _refuse_pickle()

    __reduce_ex__ = __deepcopy__

    def after_fork(self) -> None:
        """In a child process forked after `wrap`: only the forking thread lives on, so the copy thread is gone and a
        lock held by another of the parent's threads at the fork would stay held for good. Forwards are refused from
        now on (`_FORKED`); fresh locks let `unwrap` and `expertflow.stats` work."""
        self.forked = True
        # Fresh, even when this thread held them (a fork inside a layer): a child that goes on with the layer lets go
        # of the lock it took, and one that does not (a worker started from a hook) finds them free
        self._busy, self._watch = threading.Lock(), threading.Lock()
        self._owner = self._forward_owner = self._entered = self._holder = None
        self._unwrapping = False
        self.stats.lock = threading.RLock()
        self.cache.engine.after_fork()
        self.store.after_fork()

    def close(self) -> None:
        """Stop the copy thread, release the store's page-locking and detach the predictor's and the runtime's hooks
        (idempotent). The store's bytes stay readable (`unwrap` restores the experts from them). Every part is done
        even if one before it raises (on CUDA an asynchronous error can surface in the engine's), so that the model
        keeps no hook of a runtime that is gone, except releasing the store while the engine may still copy from it:
        that, and the finalizer, are left to a later `close` or to the model's collection. The first error is raised
        at the end (a Ctrl-C before any other)."""
        errors: list[BaseException] = []

        def attempt(part: Callable[[], object]) -> bool:
            try:
                part()
                return True
            except BaseException as error:  # Ctrl-C under an application's own handler too
                errors.append(error)
                return False

        attempt(self._collect_last_stalls)
        if attempt(self.cache.engine.close):
            attempt(self.store.close)  # after the engine: no copy reads the store any more
        attempt(self.cache.forget_copies)  # their views would keep store layers alive after `unwrap` frees them
        attempt(self._detach)
        if errors:
            raise next((error for error in errors if not isinstance(error, Exception)), errors[0])
        if self._finalizer is not None:
            self._finalizer.detach()

    def _collect_last_stalls(self) -> None:
        self.stats.add_stall(self.cache.engine.collect_stall(block=True))  # CUDA: the last waits' timing, kept

    def _detach(self) -> None:
        if self.routes is not None:
            self.routes.detach()
        while self._hooks:
            self._hooks.pop().remove()

    @property
    def device_bytes(self) -> int:
        """Bytes held on the compute device for weights: non-expert weights + the slot bank."""
        return self.plan.non_expert_bytes + self.cache.bank.nbytes

    @property
    def full_model_bytes(self) -> int:
        return self.plan.non_expert_bytes + self.plan.expert_bytes

    def plan_step(self, probs, next_probs=None) -> None:
        """The predictor's output `[T, L, E]` for the forward step about to run (and its next-token head's guess for
        the steps after, `[B, K, L, E]`, if it has one): plan it and prefetch its first layer now, before the model's
        embedding and first attention, so that those copies overlap them. Called by `RouteForecast` inside
        `exclusive(new_step=True)`."""
        step = self.step + 1  # `run_layer` counts the step at its first MoE layer
        # The step's occupancy is taken now, before the prefetches below, but recorded (`Stats.slots_per_layer`) only
        # when its first MoE layer runs: a forward that fails before that (a token id the embedding refuses, an error
        # or Ctrl-C in the first attention) counts no step and leaves no row. The next planned forward plans the same
        # step number again and its occupancy replaces this one; the policy gets `on_step` for that step once more
        # (the built-in policies keep the last call). A forward fed embeddings is not planned: it runs that step on
        # this plan, and records this occupancy.
        self._planned_occupancy = self.cache.occupancy()
        self._planned_step = step
        self.cache.policy.on_step(step, probs, next_probs)
        self.cache.prefetch(self.cache.policy.prefetches(step, 0))

    def watch_forward(self, model: nn.Module) -> None:
        """Hooks around the model's forward call: from its start (before the predictor's hook) to its end, even by
        an error, the calling thread owns the model's steps."""
        # one at a time: a handle registered before a failure (Ctrl-C) is kept, for `close` to remove
        self._hooks.append(model.register_forward_pre_hook(self.enter_forward, prepend=True))
        self._hooks.append(model.register_forward_hook(self.leave_forward, with_kwargs=True, always_call=True))

    def _held_by_another(self, me: int) -> bool:
        """Whether another thread is inside the forward call of the model (or of a shallow copy of it: both carry
        this runtime). The owner recorded by `enter_forward` is checked against its stack: a Ctrl-C skips
        `leave_forward`, and must not shut other threads out."""
        owner = self._forward_owner
        if owner in (None, me):
            return False
        return self._in_forward_call(sys._current_frames().get(owner))

    def _inside_forward(self) -> bool:
        """Whether the calling thread is inside the model's forward call (checked against its stack, as in
        `_held_by_another`: after a Ctrl-C the recorded owner can be stale)."""
        return self._forward_owner == threading.get_ident() and self._in_forward_call(sys._getframe(1))

    def _in_forward_call(self, frame) -> bool:
        """Whether the stack from `frame` outwards runs the forward call of a model that carries this runtime."""
        return module_calls(frame, lambda module: getattr(module, _ATTR, None) is self, first=True) > 0

    # The runtime's hooks, the experts' forwards and the predictor's hook run out of any compiled graph
    # (`torch.compile`): the runtime decides on the host, with locks, clocks and numpy, which a graph cannot hold.
    @torch.compiler.disable
    def enter_forward(self, module, args) -> None:
        if self.forked:
            raise RuntimeError(_FORKED)
        me = threading.get_ident()
        with self._watch:
            if self._held_by_another(me):
                raise RuntimeError(_THREADS)
            self._forward_owner = me
            self._entered = me  # its first MoE layer starts a step (`_starts_step`)

    @torch.compiler.disable
    def leave_forward(self, module, args, kwargs, output) -> None:
        with self._watch:
            me = threading.get_ident()
            if self._forward_owner == me:
                self._forward_owner = None
            if self._entered == me:  # a forward call that ran no MoE layer
                self._entered = None
        _refuse_backward_hook(module, args, kwargs, output)

    @contextlib.contextmanager
    def exclusive(self, new_step: bool):
        """One thread at a time: the cache, the copy queue, the policy and the predictor's session all hold the
        state of the running forward step. A second thread is refused (it would corrupt that state) while the first
        is inside the model's forward call (`watch_forward`), and, for layers run outside it, while the first is
        inside a layer or in the middle of its step. Ctrl-C is held back meanwhile, and raised in a wait for a copy or
        on leaving (`interrupts_deferred`), so that it never lands half-way through a change of that state."""
        if self.forked:  # also a layer run outside the model's forward call
            raise RuntimeError(_FORKED)
        me = threading.get_ident()
        with interrupts_deferred():
            busy = self._busy  # the lock taken is the one let go (a fork inside the layer gives the child another)
            if self._held_by_another(me) or not busy.acquire(blocking=False):
                raise RuntimeError(_UNWRAPPING if self._unwrapping else _THREADS)
            self._holder = me
            try:
                if self.unwrap_failed:
                    raise WrapError(self.unwrap_unfinished())
                if new_step:
                    self._owner = me
                elif self._owner != me:
                    raise RuntimeError(_THREADS)
                yield
            finally:
                self._holder = None
                busy.release()

    def run_layer(self, layer: MoELayer, hidden: torch.Tensor, top_k_index: torch.Tensor,
                  top_k_weights: torch.Tensor) -> torch.Tensor:
        """One MoE layer's experts: group rows by expert, fetch the experts through the cache, compute."""
        if hidden.shape[0] == 0:  # no tokens: an empty output, as transformers' experts give, and no step counted
            return torch.zeros_like(hidden)
        new_step = self._starts_step(layer)
        with self.exclusive(new_step):
            return self._run_layer(layer, hidden, top_k_index, top_k_weights, new_step)

    def unwrap_unfinished(self) -> str:
        done = sum(not layer.removed for layer in self.layers)
        moved = f", not all moved back to {self.original_device}" if done == len(self.layers) else ""
        return _UNWRAP_UNFINISHED.format(done=done, total=len(self.layers), moved=moved)

    def _starts_step(self, layer: MoELayer) -> bool:
        """A step is a forward call of the model: its first MoE layer starts one (`enter_forward`), and so does the
        first MoE layer of another stack (an encoder–decoder's decoder runs after its encoder, once per generated
        token). Layers run outside the model's forward call (generate runs an encoder–decoder's encoder on its own)
        run in order, so there a lower index starts a new step; inside it, a lower index is a looped model running
        some of its layers again in the same step."""
        if layer.starts_pass or self._entered == threading.get_ident():
            return True
        return layer.index <= self._last_layer and not self._inside_forward()  # the stack is read for loops only

    def _run_layer(self, layer: MoELayer, hidden: torch.Tensor, top_k_index: torch.Tensor,
                   top_k_weights: torch.Tensor, new_step: bool) -> torch.Tensor:
        if new_step:
            self._entered = None
            self._pass = 0
            self._step_start = layer.index
            self.step += 1
            planned = self._planned_step == self.step  # then its occupancy is the one `plan_step` took
            with self.stats.lock:  # one group: a reset from another thread comes before all three or after them
                self.stats.steps += 1
                self.stats.tokens += hidden.shape[0]
                self.cache.snapshot_occupancy(counts=self._planned_occupancy if planned else None)
            if not planned and self.step == 0:  # later steps' first layers were asked for after the step before's last
                self.cache.prefetch(self.cache.policy.prefetches(self.step, layer.index))
        elif layer.index <= self._last_layer:  # a looped model's next pass: learn where it goes back to
            self._loops[self._last_layer, self._pass] = layer.index
            self._pass += 1
        self._last_layer = layer.index
        for listener in self.listeners:
            listener(self.step, layer.index, top_k_index, top_k_weights)
        num_experts = layer.num_experts
        flat = top_k_index.reshape(-1)
        valid = (flat >= 0) & (flat < num_experts)  # else: no expert of this layer (an expert-parallel sentinel)
        keyed = torch.where(valid, flat, num_experts)
        order = torch.argsort(keyed, stable=True)
        # Host sync: the cache must know which experts to fetch before anything can be computed.
        counts = torch.bincount(keyed, minlength=num_experts + 1)[:num_experts].tolist()
        starts, total = [], 0
        for c in counts:
            starts.append(total)
            total += c
        experts = [e for e, c in enumerate(counts) if c]
        policy = self.cache.policy
        if type(policy).on_route is not Policy.on_route:
            # Host sync: learning policies read per-token routes.
            routes = torch.where(valid, flat, -1).view(hidden.shape[0], -1)  # -1 = none, as policies are promised
            policy.on_route(self.step, layer.index, routes.tolist())
        self.cache.cancel(policy.cancellations())  # asked after every routing, as the simulator does
        after = layer.index + 1
        back = self._loops.get((layer.index, self._pass)) if self._loops else None
        if back is not None:  # a looped model's pass ends here: the next one starts at `back`, in this step
            upcoming = (self.step, back)
        elif after == len(self.layers):  # the next step starts where this one did (a decoder's first MoE layer)
            upcoming = (self.step + 1, self._step_start)
        else:
            upcoming = (self.step + 1 if self.layers[after].starts_pass else self.step, after)
        waves = self.cache.request(self.step, layer.index, experts, upcoming)
        try:
            out = type(self.adapter).compute(layer.module, hidden, top_k_index, top_k_weights, waves,
                                             (order, starts, counts))
        finally:
            waves.close()  # an error or Ctrl-C in the compute: release pins and gates now, not with the traceback
        return _InferenceOnly.apply(out) if out.requires_grad else out


class _InferenceOnly(torch.autograd.Function):
    """Passes a layer's expert output through; a backward pass through it is refused with a clear error (the slots
    its experts were computed from have been reused since, so autograd could not differentiate them anyway)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor) -> torch.Tensor:
        return out.clone()  # not a view: the model may add to it in place

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        _InferenceOnly.backward_refused(grad)

    @staticmethod
    def backward_refused(grad: torch.Tensor) -> None:
        raise RuntimeError("expertflow runs inference only: gradients cannot flow through offloaded experts. Run "
                           "the model under torch.no_grad() (generate does), or call expertflow.unwrap(model) to "
                           "train it")


@torch.compiler.disable  # see `OffloadRuntime.enter_forward`
def _refuse_backward_hook(module, args, kwargs, output) -> None:
    """A forward hook on each module inside a wrapped model that holds experts (`_install_guards`)."""
    if output is not None and torch.is_grad_enabled():
        # the caller's own tensors handed back are left alone: those passed in, also inside tuples, lists and dicts
        # (`encoder_outputs`), but not a cache's, which this forward has filled
        given = {id(t) for t in _output_tensors((args, kwargs), set(), caches=False)}
        _refuse_backward_from(output, given)


def _refuse_backward_from(output, given: set[int] = frozenset()) -> None:
    """Refuse a backward pass at the wrapped model's outputs (logits, loss, hidden states, the KV cache's tensors, …),
    before autograd reaches any weight: `_InferenceOnly` alone refuses it only once the pass reaches the last MoE
    layer, after the weights behind it (the final norm, the head, a layer's key projection) have their gradients.
    Tensors the caller passed in (ids in `given`: `inputs_embeds` comes back as the first hidden state) are the
    caller's own and are left alone."""
    for tensor in _output_tensors(output, set()):
        if tensor.grad_fn is not None and id(tensor) not in given:
            tensor.register_hook(_InferenceOnly.backward_refused)


def _output_tensors(value, seen: set[int], caches: bool = True):
    """The tensors in a model's output: in tuples, lists and dicts (`ModelOutput`), and with `caches` in
    transformers' cache objects (a cache's layers, an encoder-decoder cache's two caches), each once."""
    if id(value) in seen:
        return
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _output_tensors(item, seen, caches)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _output_tensors(item, seen, caches)
    elif caches and _is_cache(value):
        for item in vars(value).values():
            yield from _output_tensors(item, seen, caches)


def _is_cache(value) -> bool:
    """A transformers cache or one of its layers (transformers is loaded: the wrapped model is one of its models)."""
    utils = sys.modules.get("transformers.cache_utils")
    return utils is not None and isinstance(value, (utils.Cache, utils.CacheLayerMixin))


def runtime_of(model: nn.Module) -> OffloadRuntime:
    """The runtime of a wrapped model; WrapError if the model is not wrapped."""
    _check_module(model, "stats")
    runtime = getattr(model, _ATTR, None)
    if runtime is None:
        raise WrapError(f"{type(model).__name__} is not wrapped by expertflow; "
                        + (_wrapped_part(model, "stats") or "call expertflow.wrap(model) first"))
    if runtime.unwrapped:
        raise WrapError(_STALE_COPY)
    if runtime.unwrap_failed:
        raise WrapError(runtime.unwrap_unfinished())
    return runtime


def stats(model: nn.Module) -> Stats:
    """The live counters of a wrapped model (the same object keeps updating); safe to call from another thread while
    the model runs."""
    runtime = runtime_of(model)
    runtime.stats.add_stall(runtime.cache.engine.collect_stall(block=True))  # CUDA: the device waits still timing
    return runtime.stats


def wrap(model: nn.Module, config: Config | None = None, **overrides) -> nn.Module:
    """Offload the experts of a Hugging Face MoE model to host memory and serve them from a device slot bank.

    Returns the same model object. On any error the model is left exactly as it was. A keyword override replaces
    the config's value: `cache_slots` or `gpu_budget` also the config's other sizing setting, another `policy` also
    its `policy_options`.
    """
    # Under the caller's inference mode the slot bank, the store and the moved weights would be inference tensors,
    # which the copy thread and any later use outside the mode may not write: build them as normal tensors.
    with _as_wrap_error():
        config = _make_config(config, overrides)
    with torch.inference_mode(False), torch.no_grad(), _no_autocast():
        return _wrap(model, config)


@contextlib.contextmanager
def _as_wrap_error():
    """A bad setting (Config's ValueError / TypeError, a policy constructor's refusal of an option value) is raised
    by `wrap` as a WrapError with the same message; an unknown keyword stays a TypeError too."""
    try:
        yield
    except WrapError:
        raise
    except TypeError as error:
        raise WrapTypeError(str(error)) from error
    except ValueError as error:
        raise WrapError(str(error)) from error


def _wrap(model: nn.Module, config: Config) -> nn.Module:
    _check_model(model)
    adapter, layers = find_adapter(model)
    _check_layers(adapter, layers)
    plan = _plan(model, config, adapter, layers)
    with _as_wrap_error():  # the constructor checks the option values: before any expert moves
        if config.policy_options is not None:  # checked again: the Config's dict may have been changed since
            check_policy_options(config.policy, config.policy_options)
        policy = make_policy(config.policy, plan.num_slots, len(layers), max(layer.num_experts for layer in layers),
                             **(config.policy_options or {}))
    original_device = _model_device(model)
    predictor = _load_predictor(model, config, plan.device, layers) if _uses_predictor(model, config) else None
    done: list[MoELayer] = []
    store = ExpertStore(plan.slot_bytes, pin_memory=plan.device.type == "cuda" and config.pin_memory,
                        device=plan.device if plan.device.type == "cuda" else None)
    try:
        for layer in layers:  # pack one layer, then drop its parameters: never two copies of more than one layer
            store.add_layer(layer.layout, [adapter.expert_tensors(layer, e) for e in range(layer.num_experts)])
            done.append(layer)  # before removing: a removal cut short is restored too
            adapter.remove_experts(layer)
        model.to(plan.device)
        _build_runtime(model, config, adapter, layers, store, plan, original_device, predictor, policy)
        log.info("expertflow: %d MoE layers, %d experts offloaded, %d device slots (%s), policy %s",
                 len(layers), plan.total_experts, plan.num_slots, plan.device, config.policy)
    except BaseException:
        # Ctrl-C held back: a rollback cut short would lose the experts not yet back (the store is their only copy)
        with interrupts_deferred():
            try:
                runtime = model.__dict__.get(_ATTR)
                if runtime is not None:  # built, then something failed (a Ctrl-C, a logging handler)
                    try:
                        runtime.close()
                    finally:  # the experts come back even if closing fails
                        _uninstall_guards(model)
                        del model.__dict__[_ATTR]
            finally:
                try:
                    _restore(model, adapter, done, store, original_device)
                finally:
                    store.close()
        raise
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """Put the experts back into the model, on the device the model had before `wrap`. Returns the model.

    The experts come back as the same parameter objects, with their attributes and `requires_grad` (an optimizer
    built before `wrap` still holds them). Refused, with nothing changed, while another thread is inside the model's
    forward call or one of its layers."""
    _check_module(model, "unwrap")
    runtime = getattr(model, _ATTR, None)
    if runtime is None:
        part = _wrapped_part(model, "unwrap")
        raise WrapError(f"{type(model).__name__} is not wrapped by expertflow: "
                        + (part or "there is nothing to unwrap"))
    if runtime.unwrapped:  # a shallow copy of a model unwrapped through another reference: only its leftovers go
        _uninstall_guards(model)
        delattr(model, _ATTR)
        return model
    me = threading.get_ident()
    busy = runtime._busy
    # Ctrl-C held back until the model is unwrapped, from before the lock is taken (one landing between taking it and
    # the `try` that lets it go would keep it taken). The runtime and the guards stay until the experts are back: if
    # restoring fails (out of memory), the model refuses to run, convert or save, and `unwrap` can be called again.
    # Normal tensors even under inference mode, and no autocast, as in `wrap`.
    with interrupts_deferred(), _no_autocast(), torch.inference_mode(False), torch.no_grad():
        # Holding the runtime's lock keeps a forward that starts meanwhile out of the layers (it gets `_THREADS`).
        if runtime._held_by_another(me) or not busy.acquire(blocking=False):
            if runtime._holder == me:
                raise WrapError(_UNWRAP_INSIDE)
            raise WrapError(_UNWRAP_TWICE if runtime._unwrapping else _UNWRAP_BUSY)
        try:
            if runtime._held_by_another(me):  # a forward call entered between the check and the lock
                raise WrapError(_UNWRAP_BUSY)
            runtime._unwrapping = True
            try:
                runtime.close()
                _restore_experts(runtime.adapter, runtime.layers, runtime.store, runtime.original_device)
                _uninstall_guards(model)
                model.to(runtime.original_device)  # the offloaded forwards, which refuse now, go only after it
            except BaseException as error:
                runtime.unwrap_failed = True
                # state_dict gives the experts not back yet from the store again, and load_state_dict refuses them
                _install_guards(model, runtime, [layer for layer in runtime.layers if layer.removed])
                if isinstance(error, Exception):
                    raise WrapError(f"{runtime.unwrap_unfinished()} ({type(error).__name__}: {error})") from error
                raise
            _restore(model, runtime.adapter, runtime.layers, runtime.store, runtime.original_device)
            delattr(model, _ATTR)
            runtime.unwrapped, runtime.unwrap_failed = True, False  # a shallow copy is told it is stale, not unfinished
        finally:
            runtime._unwrapping = False
            busy.release()
    return model


@contextlib.contextmanager
def _no_autocast():
    """`wrap` and `unwrap` move weights and compute nothing: a caller's autocast must not apply to them (torch.stack
    of bf16 experts under float16 CPU autocast raises)."""
    with contextlib.ExitStack() as stack:
        for device_type in ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",):
            stack.enter_context(torch.autocast(device_type, enabled=False))
        yield


def _build_runtime(model, config, adapter, layers, store, plan, original_device, predictor,
                   policy: Policy) -> OffloadRuntime:
    engine = make_engine(plan.device, config.link_bytes_per_s)
    runtime = None
    try:
        stats_obj = Stats()
        if engine.busy_time() is not None:
            stats_obj.time_link(engine.busy_time)
        stats_obj.time_stalls(engine.collect_stall)
        cache = ExpertCache(store, plan.num_slots, policy, plan.device, engine, stats_obj)
        runtime = OffloadRuntime(config, adapter, layers, store, cache, plan, original_device, stats_obj)
        if predictor is not None:
            runtime.routes = RouteForecast(predictor, stats_obj, _WeakMethod(runtime.plan_step),
                                           _WeakMethod(runtime.exclusive))
            runtime.routes.attach(model)
        runtime.watch_forward(model)
        runtime._forwards = [adapter.make_forward(layer, _WeakMethod(runtime.run_layer)) for layer in layers]
        for layer in layers:
            layer.module.forward = _OffloadedForward(runtime, layer.index, model)
        _install_guards(model, runtime)
        # A wrapped model dropped without `unwrap` still stops its copy thread and releases the store's page-locking
        # (neither the engine nor the store refers to the runtime). Tied to the runtime, which the model and every
        # shallow `copy.copy` of it carry, and which what it holds refers to only weakly (`_WeakMethod`,
        # `_OffloadedForward`): it runs as soon as the last of them is dropped.
        runtime._finalizer = weakref.finalize(runtime, _close_engine_and_store, engine, store)
        _LIVE[id(runtime)] = runtime
        setattr(model, _ATTR, runtime)
    except BaseException:
        try:
            if runtime is not None:
                runtime.close()  # the copy thread and the predictor's hook
            else:
                engine.close()
        finally:  # even if closing fails: the model is not left refusing to convert or save
            _uninstall_guards(model)
        raise
    return runtime


_LIVE: "weakref.WeakValueDictionary[int, OffloadRuntime]" = weakref.WeakValueDictionary()  # runtimes still held


def _after_fork_in_child() -> None:
    for runtime in list(_LIVE.values()):
        runtime.after_fork()


if hasattr(os, "register_at_fork"):  # not on Windows, which has no fork
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _close_engine_and_store(engine, store: ExpertStore) -> None:
    engine.close()
    store.close()


def _install_guards(model: nn.Module, runtime: OffloadRuntime, layers: list[MoELayer] | None = None) -> None:
    """Instance-level refusals of what would silently break a wrapped model: converting or moving it, or any module
    that holds experts (the experts would stay behind in the store's dtype and the slot bank's device; checked before
    anything is converted, so a refusal changes nothing), and `save_pretrained` (the checkpoint would lack the
    experts) on every such module that has one. Deep copies and pickling are refused by `_OffloadedForward`.
    `state_dict` gives the experts from the store (views of its host bytes), and `load_state_dict` refuses expert
    tensors before anything is loaded (they would not reach the store or the slots). `layers`: those whose experts
    are in the store (all of them unless an `unwrap` failed part-way)."""
    layers = runtime.layers if layers is None else layers
    # every dtype the experts are kept in (a half model may keep some expert weights in fp32): a conversion that
    # changes any of them would leave those experts behind
    dtypes = tuple(dict.fromkeys(spec.dtype for layer in runtime.layers for spec in layer.layout.tensors))
    device = runtime.plan.device
    names = {id(m): name for name, m in model.named_modules()}
    holders = {""}  # the model itself and every module on the path to an experts module
    for layer in runtime.layers:
        parts = names[id(layer.module)].split(".")
        holders.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    expert_keys = []  # the experts' state_dict names
    for layer in layers:
        base = names[id(layer.module)]
        expert_keys += [f"{base}.{key}" for key in runtime.adapter.expert_state(layer, runtime.store)]
        runtime._hooks.append(_after_state_dict(layer.module, _ExpertState(runtime, layer)))
    for name in holders:
        module = model.get_submodule(name)
        # weak: no cycle through __dict__. An instance's own `_apply` / `save_pretrained` (set by its user) is kept
        # by the guard, which hands a conversion it allows to it, and `_uninstall_guards` puts it back.
        module._apply = _guarded_apply(weakref.ref(module), dtypes, device, weakref.ref(model),
                                       _unguarded(module, "_apply"))
        if hasattr(module, "save_pretrained"):
            module.save_pretrained = _RefuseSavePretrained(_unguarded(module, "save_pretrained"))
        under = [key[len(name) + 1:] if name else key for key in expert_keys if not name or key.startswith(name + ".")]
        runtime._hooks.append(_before_load_state_dict(module, _ExpertLoadGuard(under)))
        if name:  # called on its own (the base model inside, for its hidden states): refused at its outputs too
            runtime._hooks.append(module.register_forward_hook(_refuse_backward_hook, with_kwargs=True))


class _Uncopyable:
    """What a wrapped model holds (its experts' forwards, its state-dict hooks): a deep copy or pickle of the model
    reaches it and is refused with the fix."""

    def __deepcopy__(self, memo):
        _refuse_pickle()

    __reduce_ex__ = __deepcopy__


def _after_state_dict(module: nn.Module, hook: Callable):
    """`register_state_dict_post_hook` (torch 2.5 on), or the older private form, which runs the same hook."""
    register = getattr(module, "register_state_dict_post_hook", None) or module._register_state_dict_hook
    return register(hook)


def _before_load_state_dict(module: nn.Module, hook: Callable):
    """`register_load_state_dict_pre_hook` (torch 2.5 on), or the older private form with the same arguments."""
    if hasattr(module, "register_load_state_dict_pre_hook"):
        return module.register_load_state_dict_pre_hook(hook)
    return module._register_load_state_dict_pre_hook(hook, with_module=True)


class _ExpertState(_Uncopyable):
    """state_dict post-hook of an experts module: its expert tensors from the store. It keeps its layer without the
    module, which each call is given: the module holds this hook and the hook the store (a copy of every expert), so
    a reference back would keep both alive after the model is dropped, until a cyclic garbage collection."""

    def __init__(self, runtime: OffloadRuntime, layer: MoELayer) -> None:
        self.adapter, self.store = runtime.adapter, runtime.store  # no cycle through the model
        self.layer = copy.copy(layer)  # with what the adapter set on it (`removed`, its own attributes)
        self.layer.module = None

    def __call__(self, module, state_dict, prefix, local_metadata) -> None:
        layer = copy.copy(self.layer)
        layer.module = module
        for key, tensor in self.adapter.expert_state(layer, self.store).items():
            state_dict[prefix + key] = tensor


class _ExpertLoadGuard(_Uncopyable):
    """load_state_dict pre-hook of a module holding experts: `keys` are their names relative to it."""

    def __init__(self, keys: list[str]) -> None:
        self.keys = keys

    def __call__(self, module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                 error_msgs) -> None:
        found = [prefix + key for key in self.keys if prefix + key in state_dict]
        if found:
            raise WrapError(f"load_state_dict on a wrapped model cannot load expert weights ({found[0]} and "
                            f"{len(found) - 1} more): they live in expertflow's host store and device slots. Call "
                            "expertflow.unwrap(model), load, then wrap again (or leave the experts out of the dict)")


class _RefuseSavePretrained(_Uncopyable):
    """A wrapped model's (and each module's inside it that holds experts) `save_pretrained`; `replaced`: the
    instance's own `save_pretrained` it stands in for, if any."""

    expertflow_guard = True

    def __init__(self, replaced: Callable | None) -> None:
        self.replaced = replaced

    def __call__(self, *args, **kwargs):
        raise WrapError("save_pretrained on a wrapped model would write a checkpoint without its experts (they live "
                        "in expertflow's host store); call expertflow.unwrap(model) first, save, then wrap again")


def _unguarded(module: nn.Module, name: str) -> Callable | None:
    """The instance attribute `name` of `module` that a guard stands in for: its own, or the one an earlier guard
    (of a wrap whose unwrap failed part-way) kept."""
    value = module.__dict__.get(name)
    return value.replaced if getattr(value, "expertflow_guard", False) else value


class _WeakMethod(_Uncopyable):
    """A runtime's method, held weakly by what the runtime holds (its experts' forwards, its predictor's hook): no
    reference cycle keeps the runtime alive once no model (or shallow copy) carries it."""

    def __init__(self, method: Callable) -> None:
        self._ref = weakref.WeakMethod(method)

    def __call__(self, *args, **kwargs):
        method = self._ref()
        if method is None:
            raise WrapError(_DROPPED)
        return method(*args, **kwargs)


class _OffloadedForward(_Uncopyable):
    """An experts module's forward while wrapped: the adapter's forward of MoE layer `index`, which the runtime holds
    (held weakly here: the adapter's forward holds its layer, and so this module). Deep copies and pickling of any
    part of the model reach it (or the runtime) and are refused with the fix; a shallow `copy.copy` shares it and
    still works. It knows the wrapped model (weakly), for the error that refuses to wrap a part of it."""

    def __init__(self, runtime: OffloadRuntime, index: int, model: nn.Module) -> None:
        self.runtime = weakref.ref(runtime)
        self.index = index
        self.model = weakref.ref(model)
        self.model_type = type(model).__name__

    @torch.compiler.disable  # see `OffloadRuntime.enter_forward`
    def __call__(self, *args, **kwargs):
        runtime = self.runtime()
        if runtime is None:
            raise WrapError(_DROPPED)
        return runtime._forwards[self.index](*args, **kwargs)


def _refuse_pickle(*args):
    raise WrapError("a wrapped model cannot be copied or pickled: its experts live in expertflow's host store and slot "
                    "bank; call expertflow.unwrap(model) first (then wrap the copies you need)")


def _guarded_apply(ref: weakref.ref, dtypes: tuple[torch.dtype, ...], device: torch.device,
                   wrapped: weakref.ref, replaced: Callable | None = None) -> Callable:
    """A module's `_apply` that refuses a conversion changing the dtype or device of any of the experts' tensors:
    `fn` is tried on one probe per dtype in `dtypes` (the experts' dtypes), on `device` (where they are served).
    One it allows goes to `replaced` (the instance's own `_apply`) if there is one, else to the class's."""
    def _apply(fn, *args, **kwargs):
        for dtype in dtypes:
            probe = torch.zeros(1, dtype=dtype, device=device)
            moved = fn(probe)
            if isinstance(moved, torch.Tensor) and (moved.dtype != probe.dtype or moved.device != probe.device):
                _refuse_conversion(moved, dtypes, probe.device, wrapped())
        module = ref()
        if module is None:  # a shallow copy's guard, the copied module's: it names the original, since dropped
            raise WrapError("this is a shallow copy of a wrapped model whose original has been dropped; it still "
                            "generates, but it cannot be converted or moved, even to where it is. Keep the original "
                            "while the copy is used, or call expertflow.unwrap on the copy first")
        if replaced is not None:
            return replaced(fn, *args, **kwargs)
        return type(module)._apply(module, fn, *args, **kwargs)

    _apply.expertflow_guard = True
    _apply.replaced = replaced
    return _apply


def _refuse_conversion(moved: torch.Tensor, dtypes: tuple[torch.dtype, ...], device: torch.device,
                       wrapped: nn.Module | None) -> None:
    """The refusal of a conversion to `moved`'s dtype and device; it names the wrapped part to unwrap when the module
    being converted encloses the wrapped one."""
    kept = " and ".join(str(dtype) for dtype in dtypes)
    what = f"converting it to {moved.dtype} on {moved.device} would leave them behind"
    root = _converted_root()
    part = next((name for name, m in root.named_modules() if m is wrapped), None) if root else None
    if part:  # a module enclosing the wrapped one: `nn.Module._apply` has converted the parts before it
        raise WrapError(f"part {part} ({type(wrapped).__name__}) of this model is wrapped by expertflow, whose experts "
                        f"are {kept} in host memory and served on {device}; {what}. Call "
                        f"expertflow.unwrap({_expression(part)}), then convert the model (the parts before it may "
                        "already be converted: the same call converts the rest), then wrap the whole model")
    raise WrapError(f"this model is wrapped by expertflow, whose experts are {kept} in host memory and served on "
                    f"{device}; {what}. Call expertflow.unwrap(model), convert the model, then wrap it again")


def _converted_root() -> nn.Module | None:
    """The module whose conversion (`.to`, `.half`, …) is running: the outermost `nn.Module._apply` on the stack
    (guarded modules run their own `_apply`, so an unguarded one encloses them)."""
    frame, root = sys._getframe(2), None
    while frame is not None:
        if frame.f_code is _MODULE_APPLY:
            root = frame.f_locals.get("self")
        frame = frame.f_back
    return root


def _uninstall_guards(model: nn.Module) -> None:
    beam = model.__dict__.get("_reorder_cache")  # a shallow copy's own reference to the predictor's stand-in too
    if isinstance(beam, _BeamReorder):
        del model.__dict__["_reorder_cache"]
        if beam.replaced is not None:
            model.__dict__["_reorder_cache"] = beam.replaced
    for module in model.modules():
        for name in ("_apply", "save_pretrained"):
            guard = module.__dict__.get(name)
            if getattr(guard, "expertflow_guard", False):
                del module.__dict__[name]
                if guard.replaced is not None:  # the instance's own, as it was before `wrap`
                    module.__dict__[name] = guard.replaced


def _uses_predictor(model: nn.Module, config: Config) -> bool:
    """Whether `wrap` loads a route predictor: for a predictive policy on a decoder-only model. The predictor reads
    the tokens the model is called with; an encoder–decoder model's decoder is called with its own ids (and the
    encoder outside the model's forward), so there `expertflow` plans from the observed routes alone."""
    wants = policy_class(config.policy).wants_predictions
    encoder_decoder = bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))
    if config.predictor is not None and not (wants and not encoder_decoder):
        why = ("the route predictor is not run on encoder-decoder models (policy 'expertflow' plans from the observed "
               "routes there)" if wants else f"policy {config.policy!r} does not use route predictions")
        warnings.warn(f"predictor={config.predictor!r} is ignored: {why}", stacklevel=4)  # at the `wrap` call
    return wants and not encoder_decoder


def recorded_name(model: nn.Module) -> str:
    """The model name a trace of `model` records (and a predictor trained on it keeps): its `name_or_path`, else its
    class name."""
    return str(getattr(model, "name_or_path", "") or type(model).__name__)


def _load_predictor(model: nn.Module, config: Config, device: torch.device, layers: list[MoELayer]):
    """The predictor of `config.predictor`, or the shipped one when the model is the built-in tiny MoE, on the compute
    device (on a GPU its small kernels cost far less than the CPU's share of a step). It must have been trained for
    this model's MoE layers, experts and top-k (where the config gives `num_experts_per_tok`), with no larger a
    vocabulary; one trained on traces of another model name (by last path part, as `predictor eval` compares them)
    is used with a warning, since a renamed copy of the same model is as likely as another model of the same shape."""
    from expertflow.predictor import default_predictor_path, load_predictor
    from expertflow.predictor.data import same_model

    path = config.predictor
    if path is None:
        from expertflow.models import is_tiny_moe

        if is_tiny_moe(str(getattr(model, "name_or_path", ""))) and default_predictor_path().exists():
            path = str(default_predictor_path())
    if path is None:
        raise WrapError(f"policy {config.policy!r} is driven by a route predictor: pass predictor=DIR (train one with "
                        "`expertflow trace record` + `expertflow predictor train`), or use policy='lru'")
    if not os.path.isdir(path):
        raise WrapError(f"predictor={path!r} is not a directory; give a trained predictor directory "
                        "(config.json + model.safetensors)")
    try:
        predictor = load_predictor(path, device)
    except (OSError, ValueError, KeyError) as error:
        raise WrapError(f"predictor={path!r} could not be loaded ({error}); give a directory written by "
                        "`expertflow predictor train`") from error
    c = predictor.config
    model_config = getattr(model, "config", None)
    text_config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    vocab = getattr(text_config, "vocab_size", None)
    found = {"MoE layers": (c.num_layers, len(layers)),
             "experts per layer": (c.num_experts, max(layer.num_experts for layer in layers))}
    top_k = getattr(text_config, "num_experts_per_tok", None)
    if isinstance(top_k, int) and not isinstance(top_k, bool):  # the routed experts per token, where the config says
        found["top-k"] = (c.top_k, top_k)
    wrong = [f"{what} {theirs} (the model has {ours})" for what, (theirs, ours) in found.items() if theirs != ours]
    if isinstance(vocab, int) and c.vocab_size > vocab:  # smaller is fine: trained without the model's config, the
        wrong.append(f"vocabulary {c.vocab_size} (the model has {vocab})")  # largest id seen + 1
    if wrong:
        raise WrapError(f"predictor={path!r} was trained for another model: {', '.join(wrong)}; train one for this "
                        "model (`expertflow trace record` + `expertflow predictor train`)")
    trained = str(predictor.info.get("model") or "")
    name = recorded_name(model)
    if not same_model(trained, name):
        warnings.warn(f"predictor={path!r} was trained on traces of {trained!r}, this model is {name!r}: its shape "
                      "fits, but routes predicted for another model make poor prefetches (the outputs stay exact); "
                      "train one on this model's traces, or ignore this if it is the same model", stacklevel=4)
    return predictor


class RouteForecast:
    """Runs the route predictor at the start of every forward call of the model (a forward pre-hook) and hands the
    per-token probabilities (and the next-token head's, or None) to `on_ready` (the runtime's `plan_step`) at once,
    all inside `exclusive(new_step=True)`: the predictor's session is part of the running step's state.

    One session per KV cache object the model is called with, held weakly (it lives as long as its cache), so that
    batches served in turn, each with its own cache, keep their own histories. A session follows its cache: the
    tokens fed on top of it are decoded together (one per row, or several: candidate tokens, a continued prompt), a
    cache cut back (assisted and prompt-lookup decoding drop the candidates they reject) cuts the session back to
    match, and generate's beam-search reorders (through the model's `_reorder_cache`, which `attach` provides) reorder
    its rows. A forward without a cache holds whole sequences and gets a session of its own, which then follows the
    cache the model made and returned, if it did (a decoding loop that feeds `out.past_key_values` back)."""

    def __init__(self, predictor, stats: Stats, on_ready: Callable, exclusive: Callable) -> None:
        self.predictor = predictor
        self.stats = stats
        self.on_ready = on_ready
        self.exclusive = exclusive
        self._sessions: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # KV cache -> _FollowedCache
        self._unkeyed: tuple[int, _FollowedCache] | None = None  # a cache that takes no weak reference, by id
        self._signature = None  # of the model's forward, with its *args and **kwargs names: see `_arguments`
        self._handle = None
        self._after_handle = None
        self._model: weakref.ref | None = None  # the model `attach` gave a `_reorder_cache`
        self._uncached: _FollowedCache | None = None  # the session of the running forward, called without a cache

    def attach(self, model: nn.Module) -> None:
        self._signature = _forward_signature(model)
        self._handle = model.register_forward_pre_hook(self._before_forward, with_kwargs=True)
        self._after_handle = model.register_forward_hook(self._after_forward, always_call=True)
        model.__dict__["_reorder_cache"] = _BeamReorder(self, model)
        self._model = weakref.ref(model)

    def detach(self) -> None:
        for handle in (self._handle, self._after_handle):
            if handle is not None:
                handle.remove()
        self._handle = self._after_handle = self._uncached = None
        model = None if self._model is None else self._model()
        if model is not None and isinstance(model.__dict__.get("_reorder_cache"), _BeamReorder):
            replaced = model.__dict__.pop("_reorder_cache").replaced
            if replaced is not None:
                model.__dict__["_reorder_cache"] = replaced
        self._model = None
        self._sessions.clear()
        self._unkeyed = None

    @torch.compiler.disable  # see `OffloadRuntime.enter_forward`
    def _before_forward(self, module, args, kwargs):
        self._uncached = None
        named = self._arguments(args, kwargs)
        input_ids, cache = named.get("input_ids"), named.get("past_key_values", named.get("cache"))
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            self._forget(cache)  # fed embeddings: the session no longer follows the sequences; no plan this step
            return None
        # Continuous batching (`generate_batch`) packs its requests' tokens into one row, with a mask laid out by the
        # paged cache: every packed token is real and none is a candidate.
        packed = named.get("cu_seq_lens_q") is not None
        with self.exclusive(new_step=True):
            self._predict(input_ids, None if packed else named.get("attention_mask"), cache,
                          None if packed else named.get("logits_to_keep"))
        return None

    @torch.compiler.disable
    def _after_forward(self, module, args, output):
        """A forward called without a cache that returns the one the model made: the session that read its tokens
        follows it, as it would have followed a cache passed in (a decoding loop goes on with it)."""
        followed, self._uncached = self._uncached, None  # also after a forward that raised (`always_call`)
        if followed is None:
            return None
        cache = getattr(output, "past_key_values", None)
        if cache is None and isinstance(output, tuple):  # return_dict=False
            cache = next((item for item in output if _is_cache(item)), None)
        if cache is not None:
            with self.exclusive(new_step=False):
                self._remember(cache, followed, _cached_length(cache))
        return None

    def _arguments(self, args: tuple, kwargs: dict) -> dict:
        """The forward call's arguments by name, also those passed by position (`model(ids, mask)`)."""
        named = dict(kwargs)
        if self._signature is not None:
            signature, var_positional, var_keyword = self._signature
            try:
                bound = signature.bind_partial(*args, **kwargs).arguments
            except TypeError:  # not a call the forward accepts: it will say so itself
                bound = None
            if bound is not None:
                named = {name: value for name, value in bound.items() if name not in (var_positional, var_keyword)}
                named.update(bound.get(var_keyword, {}))
        if args and "input_ids" not in named:
            named["input_ids"] = args[0]
        return named

    def _predict(self, input_ids: torch.Tensor, mask, cache, logits_to_keep) -> None:
        start = time.perf_counter()
        ids = input_ids.to(self.predictor.device)
        cached = _cached_length(cache)
        known = _fed_mask(mask, tuple(ids.shape), cached)
        with torch.no_grad():
            chunk = self._continued_prompt(cache, tuple(ids.shape), cached, logits_to_keep)
            if chunk is None:
                self._read_whole_prompt(cache, ids.shape[0], cached)
            followed = self._following(cache, tuple(ids.shape), cached, known)
            if followed is not None:  # the session has followed this cache: its next tokens, in one step
                probs, keep = followed.session.decode(ids), None
            else:
                known = None if known is None else known.to(ids.device)
                # A new session for new sequences, and also when the model continues sequences no session has
                # followed (a prompt fed as embeddings, a right-padded batch): it then starts from the ids at hand.
                # Predictions only steer prefetching, so a shorter history costs hits, never exactness.
                followed = _FollowedCache(self.predictor.new_session(), cached or 0)
                prompt = _prompt_length(ids.shape[1], known, logits_to_keep, cached)
                probs = _start(followed.session, ids, known, prompt)
                if chunk is None and prompt == ids.shape[1]:
                    followed.prompt, followed.prompt_offset = (ids, known), cached or 0
                keep = None if known is None else (known > 0).reshape(-1)
                self._remember(cache, followed, cached)
                if cache is None:
                    self._uncached = followed  # `_after_forward` gives it the cache the model returns, if any
            if chunk is not None:  # the prompt so far, for the encoder to read once the prompt ends
                followed.prompt, followed.prompt_offset = chunk.prompt_with(ids, known), chunk.prompt_offset
                followed.chunked = True
            elif followed.prompt is not None and followed.session.length != followed.prompt[0].shape[1]:
                followed.prompt = None  # it has decoded
            probs = _kept_rows(probs, keep)
            after = followed.session.next_probs
            after = None if after is None else after.float().cpu().numpy()  # [B, K, L, E]: each row's next tokens
        with self.stats.lock:  # a reset from another thread is not undone by this addition
            self.stats.predictor_s += time.perf_counter() - start
        self.on_ready(probs, after)

    def _continued_prompt(self, cache, shape: tuple[int, int], cached: int | None, logits_to_keep):
        """The session that follows `cache` when this forward goes on with its prompt, as chunked prefill
        (`prefill_chunk_size`) feeds one over several forwards: a forward of several tokens on a cache that has
        only been fed a prompt (no decode step or cut since; a beam reorder keeps it, reordered), and that asks for
        no candidates' logits (`logits_to_keep` above 1). Else None."""
        if not cached or shape[1] < 2 or (logits_to_keep is not None and not (type(logits_to_keep) is int
                                                                               and logits_to_keep <= 1)):
            return None
        followed = self._lookup(cache)
        return followed if followed is not None and followed.holds_prompt(shape[0], cached) else None

    def _read_whole_prompt(self, cache, batch: int, cached: int | None) -> None:
        """The first forward after a prompt fed in chunks: the chunks were predicted going on from the first one
        (cheaply, the encoder reading that chunk only); the session now starts again from the whole prompt, so that
        the generated tokens are predicted as `predict` gives them. One prefill, whatever the number of chunks."""
        followed = None if not cached else self._lookup(cache)
        if followed is None or not followed.chunked or followed.prompt is None:
            return
        whole, (ids, known) = followed.holds_prompt(batch, cached), followed.prompt
        followed.prompt, followed.chunked = None, False
        if not whole:
            return  # not the prompt's sequences any more: the session goes on as it can
        session = self.predictor.new_session()
        session.prefill(ids, known)
        followed.session, followed.offset = session, followed.prompt_offset

    def _following(self, cache, shape: tuple[int, int], cached: int | None, known: torch.Tensor | None):
        """The session that follows `cache`, cut back to the positions the cache kept, if it can go on with this
        forward's tokens; else None."""
        if not cached:  # no cache, or an empty one: new sequences
            return None
        followed = self._lookup(cache)
        if followed is None:
            return None
        session, held = followed.session, cached - followed.offset  # the positions the session should hold
        if session.batch_size != shape[0] or session.right_padded or not 0 <= held <= session.length:
            return None
        if known is not None and not bool(known.all()):  # a host sync, as the predictions' copy to the host is
            return None  # padding among the new tokens (one alone too): `decode` takes real tokens
        if held < session.length:  # the model's cache dropped candidate tokens it rejected: so does the session
            session.crop(held)
        return followed

    def reorder(self, before, after, beam_idx: torch.Tensor) -> None:
        """Generate reordered the rows of KV cache `before` (into `after`, usually the same object) by `beam_idx`:
        reorder the session that follows it alike."""
        followed = self._lookup(before)
        if followed is None or not followed.session.batch_size:
            return
        with self.exclusive(new_step=True):
            followed.session.reorder(beam_idx)
            followed.reorder_prompt(beam_idx)  # the rows are the beams' now, and so are their prompts
        if after is not before:
            self._forget(before)
            self._remember(after, followed, _cached_length(after))

    def _lookup(self, cache):
        if cache is None:
            return None
        try:
            return self._sessions.get(cache)
        except TypeError:  # a cache that takes no weak reference
            return self._unkeyed[1] if self._unkeyed is not None and self._unkeyed[0] == id(cache) else None

    def _remember(self, cache, followed: _FollowedCache, cached: int | None) -> None:
        if cached is None:  # no cache (or one that does not tell its length): nothing to follow
            return
        try:
            self._sessions[cache] = followed
        except TypeError:
            self._unkeyed = (id(cache), followed)

    def _forget(self, cache) -> None:
        if cache is None:
            return
        try:
            self._sessions.pop(cache, None)
        except TypeError:
            self._unkeyed = None


@dataclass
class _FollowedCache:
    """A predictor session that follows a KV cache, and the cache positions before its first token (a prompt fed as
    embeddings, which the session never saw)."""

    session: object  # PredictorSession
    offset: int
    # While only a prompt has been fed on the cache: its ids [B, S] and mask ([B, S] or None), from cache position
    # `prompt_offset`, and whether it came in chunks (then the session has not read all of it as its prompt)
    prompt: tuple[torch.Tensor, torch.Tensor | None] | None = None
    prompt_offset: int = 0
    chunked: bool = False

    def holds_prompt(self, batch: int, cached: int) -> bool:
        """Whether the cache, `cached` positions long, holds the prompt alone, in its `batch` rows."""
        return (self.prompt is not None and self.prompt[0].shape[0] == batch
                and cached - self.prompt_offset == self.prompt[0].shape[1])

    def reorder_prompt(self, beam_idx: torch.Tensor) -> None:
        """Row i of the held prompt becomes row `beam_idx[i]`'s, as the session's rows just did (beam search reorders
        them after a chunked prompt's last chunk too, before the whole prompt is read for the generated tokens)."""
        if self.prompt is None:
            return
        ids, known = self.prompt
        index = beam_idx.to(ids.device)
        self.prompt = ids[index], None if known is None else known[index.to(known.device)]

    def prompt_with(self, ids: torch.Tensor, known: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The prompt followed by `ids` [B, T] (mask `known`; None: all real)."""
        held, held_known = self.prompt
        mask = None
        if known is not None or held_known is not None:
            mask = torch.cat([torch.ones_like(held) if held_known is None else held_known.to(held.device, torch.long),
                              torch.ones_like(ids) if known is None else known.to(ids.device, torch.long)], dim=1)
        return torch.cat([held, ids], dim=1), mask


class _BeamReorder(_Uncopyable):
    """The wrapped model's `_reorder_cache` (an instance attribute: `RouteForecast.attach` sets it and `detach` takes
    it away), which beam search in `generate` calls, when a model has one, instead of the cache's own
    `reorder_cache`: reorders the cache as generate would have, then the predictor session that follows it, so that
    each row's predictions follow its beam."""

    def __init__(self, forecast: RouteForecast, model: nn.Module) -> None:
        self._forecast = weakref.ref(forecast)
        self._model = weakref.ref(model)
        replaced = model.__dict__.get("_reorder_cache")  # an instance attribute it stands in for, if any
        self.replaced = replaced.replaced if isinstance(replaced, _BeamReorder) else replaced  # not a stale stand-in

    def __call__(self, cache, beam_idx: torch.Tensor):
        model = self._model()
        own = self.replaced if self.replaced is not None else _class_reorder(model)
        if own is not None:
            after = own(cache, beam_idx)
        elif hasattr(cache, "reorder_cache"):
            cache.reorder_cache(beam_idx)
            after = cache
        else:  # what generate says without this stand-in
            raise ValueError(f"{type(model).__name__} cannot use beam search with a cache currently, as the cache "
                             "cannot be reordered")
        forecast = self._forecast()
        if forecast is not None:
            forecast.reorder(cache, after, beam_idx)
        return after


def _class_reorder(model: nn.Module | None) -> Callable | None:
    """The `_reorder_cache` the model's class defines (a few legacy models have one), bound; None if none."""
    if model is None:
        return None
    for klass in type(model).__mro__:
        if "_reorder_cache" in vars(klass):
            return vars(klass)["_reorder_cache"].__get__(model, type(model))
    return None


def _forward_signature(model: nn.Module):
    """(signature, name of its *args, name of its **kwargs) of the model's forward, or None if it has none."""
    import inspect  # only when attaching

    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return None
    kinds = {p.kind: name for name, p in signature.parameters.items()}
    return signature, kinds.get(inspect.Parameter.VAR_POSITIONAL), kinds.get(inspect.Parameter.VAR_KEYWORD)


def _cached_length(cache) -> int | None:
    """Positions the KV cache holds before this forward; None without a cache (or one that does not tell)."""
    if cache is None or not hasattr(cache, "get_seq_length"):
        return None
    return int(cache.get_seq_length())  # a static cache's is a tensor: a host sync per forward, needed to plan


def _fed_mask(mask, shape: tuple[int, int], cached: int | None) -> torch.Tensor | None:
    """[B, T] mask (1 = real token) of the T tokens a forward feeds, from its attention mask: a 2-D one of these
    tokens or of the whole history (generate's), or a prepared 4-D one (static cache), where a token is real when it
    may attend to itself (padding may be attended to by nothing, and no window or causal pattern hides a token from
    itself): its query row and, on a cache holding `cached` positions, key column `cached` + its index (the cache's
    keys, from position 0; a mask whose keys are fewer, as a sliding window's, is not read). None: read every token
    as real."""
    if isinstance(mask, dict):  # one prepared mask per kind of attention: any of them shows the padding; the full
        # one over every key the cache holds, where a sliding window's may hold fewer
        full = mask.get("full_attention")
        mask = full if isinstance(full, torch.Tensor) else next((m for m in mask.values()
                                                                 if isinstance(m, torch.Tensor)), None)
    batch, tokens = shape
    if not isinstance(mask, torch.Tensor) or mask.dim() not in (2, 4) or mask.shape[0] != batch:
        return None
    if mask.dim() == 2:
        return mask[:, -tokens:] if mask.shape[1] in (tokens, tokens + (cached or 0)) else None
    first = cached or 0  # the fed tokens' first key column
    if mask.shape[2] != tokens or mask.shape[3] < first + tokens:
        return None
    at = torch.arange(tokens, device=mask.device)
    own = mask[:, 0, at, first + at]  # [B, T]: each token's attention to itself
    if own.dtype != torch.bool:  # additive: 0 where attended, the dtype's lowest (or -inf) where not
        own = own > torch.finfo(own.dtype).min / 2 if own.is_floating_point() else own != 0
    return own.long()


def _prompt_length(tokens: int, known: torch.Tensor | None, logits_to_keep, cached: int | None) -> int:
    """How many of a forward's tokens start a session as its prompt (the encoder's input): all of them, but for the
    first forward of assisted and prompt-lookup decoding, which feeds the prompt and the first candidate tokens
    together and asks for the logits of the candidates and of the token after them (`logits_to_keep` = candidates +
    1; ordinary generation asks for 1): the candidates are not part of the prompt."""
    if cached != 0 or type(logits_to_keep) is not int or not 1 < logits_to_keep < tokens:
        return tokens
    candidates = logits_to_keep - 1
    if known is not None and not bool(known[:, -candidates:].all()):  # host sync, such forwards only
        return tokens  # padding among them: not candidates
    return tokens - candidates


def _start(session, ids: torch.Tensor, known: torch.Tensor | None, prompt: int) -> torch.Tensor:
    """Prefill `session` with the first `prompt` of `ids` [B, T] and decode the rest after them; probabilities
    [B, T, L, E] of all T."""
    probs = session.prefill(ids[:, :prompt], None if known is None else known[:, :prompt])
    if prompt == ids.shape[1]:
        return probs
    if session.right_padded:  # it cannot go on with `decode`: all of them as the prompt, then
        return session.prefill(ids, known)
    return torch.cat([probs, session.decode(ids[:, prompt:])], dim=1)


def _kept_rows(probs: torch.Tensor, keep: torch.Tensor | None):
    """[B, T, L, E] predictions as a numpy [B*T, L, E] of the real tokens (`keep`: the attention mask's)."""
    flat = probs.reshape(-1, probs.shape[-2], probs.shape[-1])
    if keep is not None and keep.shape[0] == flat.shape[0]:
        flat = flat[keep]
    return flat.float().cpu().numpy()


def _restore_experts(adapter: Adapter, layers: list[MoELayer], store: ExpertStore, device: torch.device) -> None:
    """Put back the experts of `layers` that are not back yet, one layer at a time, each layer's store bytes freed
    once it is back: host memory holds about one layer more than the experts (two for Switch, whose adapter copies
    each expert out of the stacked copy), and a restore cut short by lack of memory can be finished once memory is
    freed. Only when no copy reads the store any more."""
    for layer in layers:
        if layer.removed:
            tensors = {spec.name: store.stacked(layer.index, spec.name).to(device) for spec in layer.layout.tensors}
            adapter.restore_experts(layer, tensors)
            del tensors
            store.release_layer(layer.index)


def _restore(model, adapter: Adapter, layers: list[MoELayer], store: ExpertStore, device: torch.device) -> None:
    """Undo wrapping for `layers` (all of them, or those done before a failure). Every layer's experts come back
    before any offloaded forward is taken away: until then a forward from another thread reaches the runtime, which
    refuses it while `unwrap` holds it, instead of a layer whose experts are half back."""
    _restore_experts(adapter, layers, store, device)
    for layer in layers:
        if "forward" in layer.module.__dict__:
            del layer.module.forward
    model.to(device)


def _make_config(config: Config | None, overrides: dict) -> Config:
    if config is not None and not isinstance(config, Config):
        hint = {int: "; the cache size is a keyword: wrap(model, cache_slots=N)",
                float: "; a memory budget is a keyword: wrap(model, gpu_budget=...)",
                str: "; a policy name is a keyword: wrap(model, policy=NAME)"}.get(type(config), "")
        raise TypeError(f"config must be an expertflow.Config, got {type(config).__name__}{hint}")
    config = config or Config()
    if not overrides:
        return config
    # A keyword replaces the config's value, and with it what belongs to the value replaced: the other sizing
    # setting, and the options of another policy.
    implied = {}
    for one, other in (("cache_slots", "gpu_budget"), ("gpu_budget", "cache_slots")):
        if overrides.get(one) is not None and other not in overrides:
            implied[other] = None
    if "policy" in overrides and "policy_options" not in overrides and overrides["policy"] != config.policy:
        implied["policy_options"] = None
    return config.replace(**implied, **overrides)


def _check_module(model, call: str) -> None:
    """WrapError naming `call` (wrap, stats, unwrap) when `model` is not a torch module; for an object that holds one
    as `.model` (a transformers pipeline), the fix."""
    if isinstance(model, nn.Module):
        return
    held = " (it holds one as .model: pass that, as in expertflow." + call + "(pipe.model))" if isinstance(
        getattr(model, "model", None), nn.Module) else ""
    raise WrapError(f"expertflow.{call} expects a torch.nn.Module (a Hugging Face model), got "
                    f"{type(model).__name__}{held}")


def _check_model(model: nn.Module) -> None:
    _check_module(model, "wrap")
    runtime = getattr(model, _ATTR, None)
    if runtime is not None:
        raise WrapError(_STALE_COPY if runtime.unwrapped else "this model is already wrapped by expertflow; call "
                        "expertflow.unwrap(model) before wrapping it again (for example with another policy)")
    _check_wrapped_parts(model)
    meta = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if meta:
        raise WrapError(f"{len(meta)} of the model's weights are on the meta device, i.e. not loaded (e.g. {meta[0]});"
                        " load the checkpoint's weights first (from_pretrained without init_empty_weights or a meta "
                        "device_map), then call expertflow.wrap")
    if model.training:
        raise WrapError("the model is in training mode; expertflow runs inference only. Call model.eval() before "
                        "expertflow.wrap(model)")
    hooked = [name or type(model).__name__ for name, m in model.named_modules() if hasattr(m, "_hf_hook")]
    device_map = getattr(model, "hf_device_map", None)
    if hooked or (isinstance(device_map, dict) and len(set(map(str, device_map.values()))) > 1):
        raise WrapError(
            "the model was dispatched by accelerate (device_map / offload hooks on "
            f"{', '.join(hooked[:3]) or 'its modules'}); expertflow places the model itself. Load it without a "
            "device_map (or with device_map='cpu') and pass the CPU model to expertflow.wrap")
    devices = _model_devices(model)
    if len(devices) > 1:  # unwrap (and a failed wrap) put the whole model back on one device
        raise WrapError(f"the model's weights are on {len(devices)} devices ({', '.join(map(str, devices))}); "
                        "expertflow places the model itself and puts it back on one device at unwrap. Move it to one "
                        "device first (model.to('cpu')), then call expertflow.wrap")


def _wrapped_part(model: nn.Module, call: str) -> str | None:
    """For `stats` / `unwrap` of a model that is not wrapped itself: where a wrapped part of it is, and the `call`
    that reaches it; None when no part is wrapped."""
    for name, module in model.named_modules():
        if name and module.__dict__.get(_ATTR) is not None:
            return (f"part {name} ({type(module).__name__}) of it is, so call expertflow.{call}"
                    f"({_expression(name)})")
    return None


def _check_wrapped_parts(model: nn.Module) -> None:
    """Refuse a model a part of which is wrapped, or that is a part of a wrapped model: its experts are out (the
    adapter would not even find them), and only `unwrap` of that part or model puts them back."""
    for name, module in model.named_modules():
        if name and module.__dict__.get(_ATTR) is not None:
            raise WrapError(f"part {name} ({type(module).__name__}) of this model is already wrapped by expertflow; "
                            f"call expertflow.unwrap({_expression(name)}) first, then wrap the whole model")
    for name, module in model.named_modules():
        forward = module.__dict__.get("forward")
        if isinstance(forward, _OffloadedForward):
            owner, kind = forward.model(), forward.model_type
            if owner is None:  # dropped without unwrap: its store is closed, these experts are gone with it
                raise WrapError(f"this {type(model).__name__} was part of a {kind} that was wrapped by expertflow and "
                                f"then dropped without expertflow.unwrap (its experts module {name or 'itself'} was "
                                "offloaded), which closed its expert store: the experts are gone. Load the model "
                                "again, and keep the wrapped model (or unwrap it) while parts of it are in use")
            path = next((n for n, m in owner.named_modules() if m is model), "")
            raise WrapError(
                f"this {type(model).__name__} is part {repr(path) + ' ' if path else ''}of a {kind} that is already "
                f"wrapped by expertflow (its experts module {name or 'itself'} is offloaded); call "
                f"expertflow.unwrap(<that {kind}>) first, then wrap this part (or keep using the wrapped {kind})")


def _check_layers(adapter: Adapter, layers: list[MoELayer]) -> None:
    """What `wrap` cannot do with the experts modules the adapter found (before anything changes): an adapter
    without the compute the runtime calls, an experts module's forward patched on the instance (wrapping replaces it
    and unwrap deletes it), and expert weights shared between layers (each layer's are packed, then freed)."""
    _check_compute(type(adapter))
    for layer in layers:
        if "forward" in layer.module.__dict__:
            raise WrapError(f"the experts module {layer.name} ({type(layer.module).__name__}) has a patched forward "
                            "(an instance attribute), which expertflow would replace while wrapped and delete at "
                            f"unwrap; remove that patch (del {_expression(layer.name)}.forward) before wrapping")
    for layer in layers:  # each expert packs into its layer's layout: one of another shape or dtype cannot
        for e in range(layer.num_experts):
            tensors = adapter.expert_tensors(layer, e)
            for spec in layer.layout.tensors:
                t = tensors.get(spec.name)
                if t is None or tuple(t.shape) != spec.shape or t.dtype != spec.dtype:
                    found = f"no {spec.name}" if t is None else \
                        f"{spec.name} of shape {tuple(t.shape)} and dtype {t.dtype}"
                    raise WrapError(
                        f"expert {e} of {layer.name} has {found}, where the layer's experts have {spec.name} of shape "
                        f"{spec.shape} and dtype {spec.dtype}: give every expert of a layer the same tensors, shapes "
                        f"and dtype (e.g. model.to({spec.dtype})) before wrapping")
    # By the memory they take, not by object: two parameters over the same memory are shared weights too (they
    # would be packed twice, and come back untied)
    spans = sorted(((*_memory_span(layer.module.get_parameter(name)), i, name)
                    for i, layer in enumerate(layers) for name in adapter.expert_names(layer)))
    reach = None  # of the spans so far on this device, the one that reaches furthest: (device, end, layer, name)
    for device, start, end, i, name in spans:
        if end == start:  # no memory (an empty tensor)
            continue
        if reach is not None and reach[0] == device and start < reach[1] and reach[2] != i:
            first, first_name, layer = layers[reach[2]], reach[3], layers[i]
            raise WrapError(
                f"expert weights shared between layers {first.name} and {layer.name} are not supported "
                f"({first.name}.{first_name} and {layer.name}.{name} are the same memory): expertflow offloads each "
                "layer's experts on their own. Give each layer its own copy of them (e.g. "
                f"{_expression(layer.name)}.{name} = nn.Parameter(<that tensor>.detach().clone())) before "
                "wrapping")
        if reach is None or reach[0] != device or end > reach[1]:
            reach = device, end, i, name


def _memory_span(t: torch.Tensor) -> tuple[str, int, int]:
    """(device, first byte, end) of the memory a tensor's elements take (a view's, within its storage); a tensor
    without memory of its own to read (a subclass without storage) is given one byte of its own."""
    if t.numel() == 0 or t.device.type == "meta":
        return str(t.device), 0, 0
    try:
        start = t.data_ptr()
    except RuntimeError:
        return f"object on {t.device}", id(t), id(t) + 1
    last = sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()))
    return str(t.device), start, start + (last + 1) * t.element_size()


def _check_compute(adapter_class: type) -> None:
    """The runtime calls `compute` on the adapter's class for every MoE layer: refuse an adapter that lacks it (at
    wrap, not at the first forward), or has it as a method taking `self` or `cls` (it would get the experts module
    there); a plain function of the class, called that way, gets the arguments a static one does."""
    defined = next((vars(k)["compute"] for k in adapter_class.__mro__ if "compute" in vars(k)), None)
    name = adapter_class.__name__
    if defined is None or defined is vars(Adapter)["compute"]:
        raise WrapError(f"adapter {name} does not define compute(module, hidden, top_k_index, top_k_weights, waves, "
                        "plan), which the runtime calls for every MoE layer; add it as a @staticmethod (see "
                        "Adapter.compute in expertflow/adapters/base.py)")
    if isinstance(defined, (staticmethod, classmethod)):
        return
    try:
        first = next(iter(inspect.signature(defined).parameters), None) if callable(defined) else "self"
    except (TypeError, ValueError):  # a callable without a readable signature: the first forward will tell
        return
    if first in ("self", "cls"):
        what = f"a method taking {first}" if callable(defined) else "no function"
        raise WrapError(f"adapter {name}'s compute is {what}, but the runtime calls it on the class as "
                        f"{name}.compute(module, hidden, top_k_index, top_k_weights, waves, plan); make it a "
                        "@staticmethod taking those arguments")


def _expression(name: str) -> str:
    """A module path as Python that reaches it (`model.layers.0.mlp` -> `model.model.layers[0].mlp`)."""
    return "model" + "".join(f"[{part}]" if part.isdigit() else f".{part}" for part in name.split("."))


def _model_devices(model: nn.Module) -> list[torch.device]:
    """The devices of the model's parameters and buffers, in order of first appearance."""
    return list(dict.fromkeys(t.device for t in [*model.parameters(), *model.buffers()]))


def _model_device(model: nn.Module) -> torch.device:
    for tensor in list(model.parameters()) + list(model.buffers()):
        return tensor.device
    return torch.device("cpu")


def _resolve_device(config: Config) -> torch.device:
    if config.device is not None:
        try:
            device = torch.device(config.device)
        except RuntimeError as error:  # a string Config's pattern lets through but torch does not parse
            raise WrapError(f"device={config.device!r} is not a device torch knows ({error}); use 'cuda', 'cuda:N' "
                            "or 'cpu'") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise WrapError(f"device={config.device!r} but CUDA is not available here; use device='cpu'")
        if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
            raise WrapError(f"device={config.device!r} but this machine has {torch.cuda.device_count()} CUDA "
                            f"device(s), numbered from 0")
        return device
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _plan(model: nn.Module, config: Config, adapter: Adapter, layers: list[MoELayer]) -> Plan:
    device = _resolve_device(config)
    if config.link_bandwidth is not None and device.type != "cpu":
        raise WrapError(f"link_bandwidth emulates a link on the CPU device only, but the device is {device}; "
                        "drop link_bandwidth or set device='cpu'")
    slot_bytes = max(layer.layout.nbytes for layer in layers)
    total_experts = sum(layer.num_experts for layer in layers)
    expert_bytes = sum(layer.num_experts * layer.layout.nbytes for layer in layers)
    non_expert = sum(t.numel() * t.element_size() for t in _non_expert_tensors(model, adapter, layers, device))
    num_slots = _num_slots(model, config, device, slot_bytes, total_experts, non_expert)
    if device.type == "cuda":
        free = _device_available(model, device)
        needed = non_expert + num_slots * slot_bytes
        if needed > free:
            raise WrapError(
                f"the non-expert weights ({_size(non_expert)}) plus {num_slots} expert slots "
                f"({_size(num_slots * slot_bytes)}) need {_size(needed)} on {device}, but only {_size(free)} is free "
                "for them; lower cache_slots/gpu_budget or free device memory")
    return Plan(device, num_slots, slot_bytes, total_experts, expert_bytes, non_expert)


def _non_expert_tensors(model: nn.Module, adapter: Adapter, layers: list[MoELayer],
                        device: torch.device) -> list[torch.Tensor]:
    """Every parameter and buffer that stays on the device: all but the expert tensors the adapter takes out (an
    experts module's other tensors, a post-expert norm's say, stay and count)."""
    skip = {id(layer.module.get_parameter(name)) for layer in layers for name in adapter.expert_names(layer)}
    seen: set = set()
    out = []
    for t in [*model.parameters(), *model.buffers()]:
        # Two objects over the same memory (a weight tied as nn.Parameter(other.data)) are one tensor held, where
        # they stay; moved to the device, each parameter becomes a copy of its own.
        there = t.device.type == device.type and device.index in (None, t.device.index)
        same = (_memory_span(t), t.dtype, t.stride()) if there and t.numel() else (id(t),)
        if id(t) not in skip and same not in seen:
            seen.add(same)
            out.append(t)
    return out


def _device_available(model: nn.Module, device: torch.device) -> int:
    """Bytes the wrapped model may hold on CUDA `device`: what is free there, plus what the model's own tensors
    already hold there (its non-expert weights stay, its experts are freed), plus what PyTorch's caching allocator
    holds unused (e.g. from a model deleted earlier)."""
    free = torch.cuda.mem_get_info(device)[0]
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    held = {}
    on_cuda = [t for t in list(model.parameters()) + list(model.buffers()) if t.is_cuda]
    if on_cuda:
        index = device.index if device.index is not None else torch.cuda.current_device()
        for tensor in on_cuda:
            if tensor.device.index == index:
                storage = tensor.untyped_storage()
                held[storage.data_ptr()] = storage.nbytes()
    return free + max(cached, 0) + sum(held.values())


def _size(nbytes: int, up: bool = False) -> str:
    """`nbytes` in the largest binary unit it fills, to two decimals; `up` rounds up (for a minimum to ask for, which
    rounding down would leave short)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{-(-nbytes * 100 // scale) / 100:.2f} {unit}" if up else f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"


def _num_slots(model: nn.Module, config: Config, device: torch.device, slot_bytes: int, total_experts: int,
               non_expert: int) -> int:
    if config.cache_slots is not None:
        return min(config.cache_slots, total_experts)
    if config.gpu_budget is None:
        if device.type != "cpu":
            raise WrapError(f"on {device} give the expert cache size: cache_slots=N (total expert slots over all "
                            "layers) or gpu_budget='6GiB' (device memory for the whole model's weights)")
        return max(1, total_experts // 4)
    budget = config.gpu_budget
    if isinstance(budget, float):  # a share of what is free for the model (`_device_available`)
        free = _device_available(model, device) if device.type == "cuda" else _host_available()
        budget_bytes = int(free * budget)
    else:
        budget_bytes = parse_bytes(budget, what="gpu_budget")
    slots = (budget_bytes - non_expert) // slot_bytes
    if slots < 1:
        need = non_expert + slot_bytes
        bytes_hint = "" if isinstance(budget, (str, float)) else (
            "; an int gpu_budget is a number of bytes: for a fraction of the free memory give a float such as 1.0")
        raise WrapError(
            f"gpu_budget={config.gpu_budget!r} ({_size(budget_bytes)}) does not hold the non-expert weights "
            f"({_size(non_expert)}) plus one expert ({_size(slot_bytes)}); give at least {_size(need, up=True)}, or "
            f"use cache_slots{bytes_hint}")
    return min(int(slots), total_experts)


def _host_available() -> int:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):  # pragma: no cover - non-POSIX
        return 8 * 2**30
