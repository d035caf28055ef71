"""The policy plug-in interface: which resident expert to evict, and (for predictive policies) what to prefetch.

Owns: decisions only. Does not know: tensors, devices, transfers or Hugging Face. A policy sees expert keys
`(layer, expert)` — `layer` is the index among the model's MoE layers (0..L-1) — and the events the slot table and
the request server report to it. The same policy objects drive the live runtime and the trace simulator, so both
make the same choices on the same routing.
"""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Callable, Iterable, Sequence

import numpy as np

ExpertKey = tuple[int, int]  # (moe layer index, expert id)

__all__ = ["ExpertKey", "Policy", "PolicyError", "register_policy", "make_policy", "policy_names", "policy_class",
           "routes_array", "prefetch_key", "policy_keys", "required_options", "WAVE"]


class _Wave:
    """`victim()`'s answer "not now": compute what the running request holds first (a wave), then ask again."""

    def __repr__(self) -> str:
        return "WAVE"


WAVE = _Wave()


class PolicyError(ValueError):
    """A policy broke its contract (a victim that is pinned or not resident, no victim when one is needed, a
    prefetch outside the model). Raised before anything is changed for that decision."""


def prefetch_key(policy: Policy, key, num_layers: int, num_experts: Callable[[int], int], where: str,
                 verb: str = "prefetch") -> ExpertKey:
    """`key` as the (layer, expert) of a prefetch `policy` asked for (or, with `verb="cancel"`, a cancellation), as a
    pair of ints; PolicyError unless it is a pair of integers naming an expert of the `num_layers` MoE layers
    (`num_experts(layer)` each) of `where`."""
    if not (isinstance(key, tuple) and len(key) == 2 and all(isinstance(i, numbers.Integral)
                                                             and not isinstance(i, (bool, np.bool_)) for i in key)):
        raise PolicyError(f"policy {policy.name!r} asked to {verb} {key!r}; give (layer, expert) tuples of integers")
    layer, expert = int(key[0]), int(key[1])
    if not (0 <= layer < num_layers and 0 <= expert < num_experts(layer)):
        experts = num_experts(layer) if 0 <= layer < num_layers else max(map(num_experts, range(num_layers)),
                                                                          default=0)
        raise PolicyError(f"policy {policy.name!r} asked to {verb} {key}, outside {where}'s {num_layers} MoE "
                          f"layers x {experts} experts")
    return layer, expert


def policy_keys(policy: Policy, keys, hook: str, num_layers: int, num_experts: Callable[[int], int],
                where: str) -> list[ExpertKey]:
    """What `policy`'s `hook` ("prefetches" or "cancellations") returned, as a list of (layer, expert) pairs of ints,
    every key checked by `prefetch_key` before any is acted on; PolicyError for None, a string or anything else not
    iterable, and for a bad key."""
    if keys is None or isinstance(keys, (str, bytes)) or not isinstance(keys, Iterable):
        raise PolicyError(f"policy {policy.name!r}: {hook}() returned {keys!r}; return a list of (layer, expert) "
                          f"tuples (an empty one for none)")
    verb = "prefetch" if hook == "prefetches" else "cancel"
    return [prefetch_key(policy, key, num_layers, num_experts, where, verb) for key in keys]


def routes_array(routes: Sequence[Sequence[int]], num_experts: int) -> np.ndarray:
    """`on_route`'s routes as an int64 array [T, K]: shorter rows padded with -1, and any id outside
    [0, num_experts) made -1 (none), as the runtime treats it."""
    if not len(routes):
        return np.zeros((0, 1), dtype=np.int64)
    try:
        ids = np.asarray(routes, dtype=np.int64).reshape(len(routes), -1)
    except ValueError:  # rows of different lengths
        width = max((len(route) for route in routes), default=0)
        ids = np.full((len(routes), max(width, 1)), -1, dtype=np.int64)
        for row, route in enumerate(routes):
            ids[row, :len(route)] = route
    return np.where((ids >= 0) & (ids < num_experts), ids, -1)


class Policy:
    """Base class. Subclasses set a unique class attribute `name`, override `victim`, and may override the event
    hooks and `prefetches`; `@register_policy` makes the name usable by `expertflow.wrap(policy=...)` and the
    simulator. A guide with an example: docs/cache_engine.md, "Writing a policy".

    The policy sees no slot table: it tracks what is resident from `on_insert` / `on_evict`.
    Event order for one request R(step, layer) = experts E (ascending):
      on_route(step, layer, per-token routes) → on_request(step, layer, E) → on_access(key) for every e in E (hits
      and misses) → for each miss, in ascending order: victim(key, ...) → [on_evict(victim)] → on_insert(key)
      → prefetches(step', layer') for the next request (once E's slots are ready, before E computes)
      → on_request_end(step, layer, E) after E has computed.
    `victim` is also asked when a prefetch needs a slot: then `evictable` also admits experts the running request
    holds whose bytes have arrived (the copy into such a slot is held until the request has computed that expert).
    """

    name = "base"
    needs_future = False  # True for oracles (belady) that only the simulator can run
    wants_predictions = False  # True for policies fed the route predictor's output through `on_step`

    def __init__(self, capacity: int, num_layers: int, num_experts: int) -> None:
        self.capacity = check_capacity(capacity)
        self.num_layers = num_layers
        self.num_experts = num_experts

    # -- events -----------------------------------------------------------------------------------------------------
    def on_step(self, step: int, probs, next_probs=None) -> None:
        """Predicted expert probabilities `[T, L, E]` (numpy) of the T tokens of forward step `step`, given before
        the step's forward runs (only to policies with `wants_predictions`). `next_probs` `[R, K, L, E]`, when the
        predictor has a next-token head: for each of the step's R sequences, its guess for the K tokens that will
        follow the sequence's last one (those of the next K steps)."""

    def on_route(self, step: int, layer: int, routes: Sequence[Sequence[int]]) -> None:
        """The router of layer `layer` chose: `routes[t]` are token t's experts (top-k order; -1 = none) in `step`.

        Called before `on_request` for the same (step, layer). Learning policies (lookahead, predictive) use it.
        """

    def on_request(self, step: int, layer: int, experts: Sequence[int]) -> None:
        """A request starts: `experts` (ascending) are needed by layer `layer` in forward step `step`."""

    def on_access(self, key: ExpertKey) -> None:
        """`key` is needed now (called for hits and misses alike, in handling order)."""

    def on_insert(self, key: ExpertKey) -> None:
        """`key` was given a slot (demand load or prefetch)."""

    def on_evict(self, key: ExpertKey) -> None:
        """`key` lost its slot."""

    def on_request_end(self, step: int, layer: int, experts: Sequence[int]) -> None:
        """The request's compute finished; its pins are released."""

    # -- decisions --------------------------------------------------------------------------------------------------
    def victim(self, key: ExpertKey, evictable: Callable[[ExpertKey], bool], free_slots: int) -> ExpertKey | None:
        """Choose the resident expert to evict so that `key` can be loaded.

        Return None to take a free slot (only allowed when free_slots > 0), or a resident key for which
        `evictable(key)` is true. Return None with free_slots == 0 only when nothing is evictable.

        Or return `WAVE` (demand loads of a request that already holds a slot): the request computes the experts
        it holds, releases them, and asks again — so a policy can keep a request inside part of the cache (a
        layer's share, say) even while other slots are free or evictable. Asked again with nothing pinned, it must
        give a victim or a free slot. A prefetch that gets `WAVE` is not issued.
        """
        raise NotImplementedError

    def prefetches(self, step: int, layer: int) -> list[ExpertKey]:
        """Experts to load at low priority before layer `layer` of `step` runs (demand-only policies: none)."""
        return []

    def cancellations(self) -> list[ExpertKey]:
        """Prefetched experts no longer wanted (asked right after `on_route`); the caller evicts those whose
        transfer has not finished and is not pinned, cancelling queued copies."""
        return []


def is_integer(value) -> bool:
    """A whole number, Python's or numpy's, not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def check_capacity(capacity: int) -> int:
    """A number of slots: a whole number (True or 2.0 is not one) of at least 1, as an int."""
    if not is_integer(capacity) or capacity < 1:
        raise ValueError(f"capacity={capacity!r} must be a whole number of slots, at least 1")
    return int(capacity)


_REGISTRY: dict[str, type[Policy]] = {}


def register_policy(cls: type[Policy]) -> type[Policy]:
    """Class decorator: make a policy available by its `name` (which must be its own and not taken)."""
    if "name" not in cls.__dict__:
        raise ValueError(f"policy class {cls.__qualname__} has no `name` of its own (it would take {cls.name!r} "
                         "from its base class); set a class attribute name = 'my-policy'")
    if cls.victim is Policy.victim:
        raise ValueError(f"policy class {cls.__qualname__} must override victim(key, evictable, free_slots)")
    try:  # a constructor that cannot be called as make_policy calls it would fail only when the policy is built
        inspect.signature(cls).bind_partial(1, 1, 1, **({"future": []} if cls.needs_future else {}))
    except TypeError as exc:
        call = "capacity, num_layers, num_experts" + (", future=..." if cls.needs_future else "")
        raise ValueError(f"policy class {cls.__qualname__} cannot be built as ({call}) ({exc}); its __init__ must "
                         "take " + ("those three, and future as a keyword (needs_future)" if cls.needs_future
                                    else "those three first") + " (options of its own may follow)") from None
    taken = _REGISTRY.get(cls.name)
    if taken is not None and (taken.__module__, taken.__qualname__) != (cls.__module__, cls.__qualname__):
        raise ValueError(f"policy name {cls.name!r} is taken by {taken.__module__}.{taken.__qualname__}; choose "
                         "another name")
    _REGISTRY[cls.name] = cls
    return cls


def policy_names(include_oracles: bool = True) -> list[str]:
    _load_builtin()
    return [n for n, c in _REGISTRY.items() if include_oracles or not c.needs_future]


def policy_class(name: str) -> type[Policy]:
    """The registered class of `name` (to read class attributes such as `needs_future` before building one)."""
    _load_builtin()
    if name not in _REGISTRY:
        raise ValueError(f"unknown policy {name!r}; known policies: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def make_policy(name: str, capacity: int, num_layers: int, num_experts: int, **kwargs) -> Policy:
    """Build a registered policy by name; unknown names get an error listing the known ones."""
    _load_builtin()
    if name not in _REGISTRY:
        raise ValueError(f"unknown policy {name!r}; known policies: {', '.join(sorted(_REGISTRY))}")
    missing = [option for option in required_options(_REGISTRY[name]) if option not in kwargs]
    if missing:  # before the constructor runs: a TypeError from inside it is its own
        raise TypeError(f"policy {name!r} needs the option(s) {', '.join(missing)}, which have no default: give them "
                        "in policy_options")
    return _REGISTRY[name](capacity, num_layers, num_experts, **kwargs)


def required_options(cls: type[Policy]) -> list[str]:
    """The options of a policy class's constructor that have no default (after capacity, num_layers and num_experts;
    `future`, which the simulator gives an oracle, left out)."""
    params = list(inspect.signature(cls).parameters.values())
    taken = {p.name for p in [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][:3]}
    return [p.name for p in params if p.name not in taken and p.name != "future" and p.default is p.empty
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def _load_builtin() -> None:
    # Importing the package registers the built-in policies (kept lazy so that base has no import cycle).
    import expertflow.policy  # noqa: F401
