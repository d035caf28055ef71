"""`expertflow`: the predictive expert cache policy, driven by the route-path predictor's per-token, per-layer expert
probabilities for the whole forward step. The same object runs in the live runtime and in the simulator.

Owns: the demand estimate of the running step, the eviction order (predicted next use), the prefetch choice and the
live corrections. Does not know: slots, tensors, transfers or time.

How it decides, per forward step s with predicted probabilities P[t, l, e] of its T tokens:
  * demand d[l, e] = 1 − Π_t (1 − P[t, l, e]): the chance that layer l needs expert e in this step;
  * each layer's share of the slots is proportional to its predicted demand Σ_e d[l, e] (earliest layers first when
    rounding); with `use_quota` prefetches never push a layer above its share (off by default: the margin below
    already keeps prefetches from crowding out experts needed soon, and the quota turned prefetches into demand
    loads);
  * eviction = predicted Belady: the resident expert with the furthest *expected next use* goes first. Counting in
    requests from now (layer `cur`; −1 before the step's first layer), an expert of a later layer is next used at
    l − cur with probability d, else in a later step; an expert of a layer that already ran is next used in a later
    step. When that later use comes depends on what the predictor gives:
      - with its next-token head (the usual case): n_k[l, e] = 1 − Π_r (1 − N[r, k, l, e]), the chance that the
        k-th next step needs the expert, from the head's guess N for each of the K tokens that will follow each
        sequence's last one (not known until their steps). The next use is taken as the first of the next K steps
        that uses the expert, each independently with chance w·n_k + (1 − w)·f (w = `next_weight`, 1 by default),
        and after those geometric with chance f per step, f being an exponential average of how often the expert
        was really used per step. The expectation is truncated at `wait_cap` steps (E[min(wait, C)]): that far
        ahead only the fallback speaks, and its long geometric tails would otherwise decide between experts that
        are both unlikely to be needed before the cache has turned over (None = no truncation);
      - without it: a geometric wait with chance q = β·d + (1 − β)·f per step, where for a layer that already ran
        f is blended (weight `temporal`) with a guess of the next step's routes from this step's, by step-to-step
        transition counts P(e' at step s+1 | e at step s) of the same layer and batch row learned online
        (consecutive tokens of a sequence route alike, but far less than the head predicts);
    f alone is the recency/frequency fallback where no prediction says anything;
  * prefetch (low priority), in layer order for the next `horizon` layers of this step, the experts with d ≥ θ that
    are not resident, most probable first, and only into a free slot or in place of a victim whose expected next
    use is more than `margin` requests later than the candidate's (fewer, surer prefetches: a wrong one costs a
    transfer that delays misses, and a victim needed soon costs a second one). The victim may be an expert the
    running layer is still using (slot hand-off, `expertflow.slots`): the copy starts once that layer has computed
    it. Once the last layer's experts are in place, the next step's first layer is prefetched the same way from the
    next-token head's guess n_1 (only experts with n_1 ≥ `speculate`): live, the link would otherwise wait through
    the last layer, the LM head, sampling and the predictor's next run;
  * live correction: once layer l's router has chosen, d[l] becomes the true routes, queued prefetches for layer l
    that it did not choose are offered for cancellation, and d of layer l + 1 is refined with transition counts
    learned online (P(e' at l+1 | e at l), the lookahead heuristic) blended with weight `refine`;
  * optional hot set: the `hot_fraction` most used experts (by f; at least one) are kept unless nothing else can go
    (among them the furthest expected next use first, ties to the least recently used); membership
    changes with hysteresis (enter within the top `size`, leave only when ranked below 1.25 × `size`) so that it
    does not thrash.
  * optional `waves` (off by default; live: `wrap(..., policy_options={"waves": True})`): a demand miss whose best
    victim is expected sooner (by more than `wave_gap` requests) than one of the running request's own experts
    (already computed once the wave is) answers `WAVE`, so the request is computed in parts and its own experts are
    evicted first. This leaves the request model in which a request's experts stay pinned until it ends (and with it
    the lower bound), as the per-layer cache run in waves (`benchmarks/lru_layer_waves.py`) does. With waves a
    `margin` above a step (8 requests with 6 layers) pays: a prefetch victim needed within a step is a worse one
    than the wave would take; and a `wave_gap` of 2 keeps waves from splitting for small differences, each wave
    costing host work live (docs/cache_engine.md, item 7). A prefetch does not wait for a wave: it takes a victim or
    is dropped. With `defer_to_waves` it is also dropped when its victim is expected sooner, by more than `wave_gap`,
    than the latest later-step use among the resident experts its layer's request is predicted to need (d ≥ θ; hot
    ones excepted): once that request has computed them, a wave can take their slots instead (speculative prefetches
    for the next step's first layer keep the margin rule only).
  * optional `on_demand_target` (None by default): the margin is steered so that on-demand loads stay near this share
    of needs. At the start of each request the share of its experts that are not resident (neither cached nor on their
    way: the loads its own demand will issue) enters a running average (starting at the target) in which each need
    weighs 1%; the margin then moves by 0.2 request per need times (target − average), within [0, `wait_cap` steps of
    requests] (16 steps with no cap). A larger margin means fewer, surer prefetches: more hits, more on-demand loads
    (with waves; without them the hits hardly change). Where that trade is best depends on the batch and the cache
    size (with waves and half the experts cached, margins of 24–32 requests keep 6–7% of needs on demand at batch 1,
    4–5 keep 6–11% at batch 16), which one fixed margin cannot follow (docs/benchmarks.md, "An on-demand budget").
Without predictions (no predictor) d holds only the routes observed in the running step and the next layer's guess
refined from them, nothing is prefetched, and the policy reduces to frequency-weighted recency. Predicted
probabilities are clipped to [0, 1], a NaN counting as 0.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence

import numpy as np

from expertflow.policy.base import WAVE, ExpertKey, Policy, is_integer, register_policy, routes_array

__all__ = ["ExpertFlowPolicy"]

_SHARE_WEIGHT = 0.01  # with on_demand_target: weight of one need in the running on-demand share
_MARGIN_STEP = 0.2  # requests the margin moves per need, per unit of (target − share)
_UNCAPPED_STEPS = 16  # with wait_cap=None: the margin's ceiling in steps
_HOT_OFFSET = 1e9  # taken from a hot expert's expected wait, so that it goes last (`expected_next_use`)
_MAX_WAIT_CAP = 10_000  # steps: the expected wait sums over each, for every (layer, expert); None sums in closed form


@register_policy
class ExpertFlowPolicy(Policy):
    name = "expertflow"
    wants_predictions = True

    def __init__(self, capacity: int, num_layers: int, num_experts: int, theta: float = 0.6, horizon: int = 1,
                 beta: float = 0.5, ema: float = 0.05, refine: float = 0.3, hot_fraction: float = 0.0,
                 margin: float = 4.0, use_quota: bool = False, temporal: float = 0.3, next_weight: float = 1.0,
                 speculate: float = 0.8, wait_cap: int | None = 16, waves: bool = False,
                 wave_gap: float = 0.0, defer_to_waves: bool = False,
                 on_demand_target: float | None = None) -> None:
        super().__init__(capacity, num_layers, num_experts)
        for name, value in (("use_quota", use_quota), ("waves", waves), ("defer_to_waves", defer_to_waves)):
            if not isinstance(value, bool):
                raise ValueError(f"{name}={value!r} must be True or False")
        for name, value in (("theta", theta), ("beta", beta), ("ema", ema), ("refine", refine),
                            ("hot_fraction", hot_fraction), ("margin", margin), ("temporal", temporal),
                            ("next_weight", next_weight), ("speculate", speculate), ("wave_gap", wave_gap)):
            if not _is_real(value) or not _finite(value):
                raise ValueError(f"{name}={_shown(value)} must be a finite number")
        for name, value in (("beta", beta), ("ema", ema), ("refine", refine), ("hot_fraction", hot_fraction),
                            ("temporal", temporal), ("next_weight", next_weight)):
            if not 0 <= value <= 1:
                raise ValueError(f"{name}={value!r} is a weight or share: give a number from 0 to 1")
        for name, value, unit in (("theta", theta, "a probability threshold (above 1: no prefetches for this step's "
                                  "layers; `speculate` governs the next step's)"),
                                  ("speculate", speculate, "a probability threshold (0 or above 1: off)"),
                                  ("margin", margin, "a number of requests"), ("wave_gap", wave_gap,
                                                                               "a number of requests")):
            if value < 0:
                raise ValueError(f"{name}={value!r} must be {unit} of at least 0")
        if wave_gap and not waves:
            raise ValueError(f"wave_gap={wave_gap!r} only applies when serving in waves: add waves=True, or drop "
                             "wave_gap")
        if defer_to_waves and not waves:
            raise ValueError("defer_to_waves=True only applies when serving in waves: add waves=True, or drop "
                             "defer_to_waves")
        if on_demand_target is not None and (not _is_real(on_demand_target) or not 0 < on_demand_target < 1):
            raise ValueError(f"on_demand_target={_shown(on_demand_target)} must be a share of needs between 0 and 1 "
                             "(such as 0.08), or None to keep the margin fixed")
        if not is_integer(horizon) or horizon < 1:
            raise ValueError(f"horizon={_shown(horizon)} must be a number of layers of at least 1")
        if wait_cap is not None and (not is_integer(wait_cap) or not 1 <= wait_cap <= _MAX_WAIT_CAP):
            raise ValueError(f"wait_cap={_shown(wait_cap)} must be a number of steps from 1 to {_MAX_WAIT_CAP:,} (a "
                             "whole number; the expectation is computed over each step up to it), or None for no cap")
        horizon, wait_cap = int(horizon), None if wait_cap is None else int(wait_cap)
        theta, beta, ema, refine, hot_fraction, margin, temporal, next_weight, speculate, wave_gap = (
            float(v) for v in (theta, beta, ema, refine, hot_fraction, margin, temporal, next_weight, speculate,
                               wave_gap))  # a Fraction or a huge int would make every array they touch one of objects
        self.theta, self.horizon, self.beta, self.ema = theta, horizon, beta, ema
        self.refine, self.hot_fraction, self.margin, self.use_quota = refine, hot_fraction, margin, use_quota
        self.temporal, self.next_weight, self.speculate, self.waves = temporal, next_weight, speculate, waves
        self.wave_gap, self.defer_to_waves = wave_gap, defer_to_waves
        self.wait_cap = wait_cap
        self.on_demand_target = on_demand_target
        self.margin_cap = float((wait_cap or _UNCAPPED_STEPS) * num_layers)
        if on_demand_target is not None:
            self.margin = min(max(float(margin), 0.0), self.margin_cap)
        self.on_demand_share = on_demand_target  # running average of the on-demand share (with a target only)
        self.next_demand: np.ndarray | None = None  # [K, L, E] chance each expert is needed in each next step
        shape = (num_layers, num_experts)
        self.demand = np.zeros(shape)  # d[l, e] for the running step
        self.freq = np.full(shape, 1.0 / max(num_experts, 1))  # f[l, e]: EMA of per-step use
        self.resident = np.zeros(shape, dtype=bool)
        self.hot = np.zeros(shape, dtype=bool)
        self.trans = np.full((max(num_layers - 1, 0), num_experts, num_experts), 1e-3)  # counts a → b at l → l+1
        self.step_trans = np.full((num_layers, num_experts, num_experts), 1e-3)  # counts a → b at s → s+1, layer l
        self.next_guess = self.freq.copy()  # guessed use in the next step, for layers that already ran
        self._layer_routes: list[tuple[int, np.ndarray] | None] = [None] * num_layers  # last routes of each layer
        self.quota = _integer_shares(capacity, np.ones(num_layers)) if num_layers else np.zeros(0)
        self.step, self.cur = -1, 0
        self._step_before = -1  # the forward step before `step` (steps are ordered, not necessarily consecutive)
        self._predicted_step = -1
        self._targets: set[ExpertKey] = set()
        self._targets_all: set[ExpertKey] = set()  # offered for prefetch this step and not yet routed
        self._demanding: set[ExpertKey] = set()
        self._cancel: list[ExpertKey] = []
        self._prev_routes: tuple[int, int, np.ndarray] | None = None
        self.clock = 0
        self.last_use = np.zeros(shape)
        self._wait: np.ndarray | None = None  # expected_next_use before ties and hot set; None = to recompute
        self._later: np.ndarray | None = None  # with `_wait`: the wait for each expert's first use in a later step

    # -- prediction ---------------------------------------------------------------------------------------------
    def on_step(self, step: int, probs: np.ndarray, next_probs: np.ndarray | None = None) -> None:
        """Predicted probabilities `[T, L, E]` of the tokens of forward step `step`, before its first layer, and the
        next-token head's `[R, K, L, E]` for the K tokens that will follow each sequence's last one (the next K steps),
        if the predictor has one."""
        self._wait = None
        probs = self._checked(_chances(probs), "probs", (2, 3), "[T, L, E]").reshape(-1, self.num_layers,
                                                                                    self.num_experts)
        self.demand = 1.0 - np.prod(1.0 - probs, axis=0) if len(probs) else self.demand * 0
        self.next_demand = None
        if next_probs is not None:
            after = self._checked(_chances(next_probs), "next_probs", (3, 4), "[R, K, L, E]")
            if after.size:  # a head with rows and steps
                after = after.reshape(len(after), -1, self.num_layers, self.num_experts)  # [R, K, L, E]
                self.next_demand = 1.0 - np.prod(1.0 - after, axis=0)  # [K, L, E]
        self._predicted_step = step
        self._enter(step)
        self.cur = -1  # no layer of this step has run yet: all of them are ahead
        share = self.demand.sum(axis=1)
        total = share.sum()
        self.quota = _integer_shares(self.capacity, share if total > 0 else np.ones(self.num_layers))

    def _checked(self, chances: np.ndarray, name: str, ndims: tuple[int, ...], shape: str) -> np.ndarray:
        """`chances` as `on_step` takes them: `ndims` dimensions, the last two this model's layers and experts."""
        if chances.ndim not in ndims or chances.shape[-2:] != (self.num_layers, self.num_experts):
            raise ValueError(f"{name} of shape {chances.shape}: expected {shape} with L = {self.num_layers} MoE layers "
                             f"and E = {self.num_experts} experts (a prediction for another model, or transposed?)")
        return chances

    # -- events -------------------------------------------------------------------------------------------------
    def on_route(self, step: int, layer: int, routes: Sequence[Sequence[int]]) -> None:
        self._wait = None
        chosen = np.zeros(self.num_experts)
        ids = routes_array(routes, self.num_experts)
        valid = ids[ids >= 0]
        chosen[valid] = 1.0
        if step != self._predicted_step:  # no prediction for this step: keep only what was observed
            if step != self.step:
                self.demand[:] = 0.0
            self.next_demand = None  # the head spoke of the steps after the predicted one, not of those after this
        self._enter(step)
        self.cur = layer
        self.demand[layer] = chosen
        self.freq[layer] = (1 - self.ema) * self.freq[layer] + self.ema * chosen
        self._cancel = [(layer, int(e)) for e in np.flatnonzero(chosen == 0) if (layer, int(e)) in self._targets_all]
        self._targets_all = {k for k in self._targets_all if k[0] > layer}
        self._learn_and_refine(step, layer, ids)
        self._update_hot()

    def _enter(self, step: int) -> None:
        if step != self.step:
            self._step_before, self.step = self.step, step

    def _learn_and_refine(self, step: int, layer: int, ids: np.ndarray) -> None:
        prev = self._prev_routes
        if prev is not None and prev[0] == step and prev[1] == layer - 1:
            _count_transitions(self.trans[layer - 1], prev[2], ids)
        self._prev_routes = (step, layer, ids)
        before = self._layer_routes[layer]
        if before is not None and before[0] == self._step_before:
            _count_transitions(self.step_trans[layer], before[1], ids)
        self._layer_routes[layer] = (step, ids)
        if len(ids):
            self.next_guess[layer] = _transition_guess(self.step_trans[layer], ids)
        if self.refine > 0 and layer + 1 < self.num_layers and len(ids):
            guess = _transition_guess(self.trans[layer], ids)
            self.demand[layer + 1] = (1 - self.refine) * self.demand[layer + 1] + self.refine * guess

    def _update_hot(self) -> None:
        if self.hot_fraction <= 0:
            return
        # a share of the cache under one slot: one; rounded first so that 0.29 of 100 slots is 29, not 28.999…
        size = max(1, int(round(self.hot_fraction * self.capacity, 9)))
        order = np.argsort(-self.freq, axis=None)
        rank = np.empty(order.size, dtype=np.int64)
        rank[order] = np.arange(order.size)
        rank = rank.reshape(self.freq.shape)
        self.hot = (self.hot & (rank < int(np.ceil(1.25 * size)))) | (rank < size)

    def on_request(self, step: int, layer: int, experts: Sequence[int]) -> None:
        self._wait = None
        if self.on_demand_target is not None and len(experts):
            self._steer_margin(layer, experts)
        self._enter(step)
        self.cur = layer
        self._demanding = {(layer, e) for e in experts}
        self._targets = set()

    def on_request_end(self, step: int, layer: int, experts: Sequence[int]) -> None:
        self._demanding = set()  # else, with one MoE layer, the next step's first prefetches would look like demand

    def _steer_margin(self, layer: int, experts: Sequence[int]) -> None:
        """Fold this request's on-demand share (its experts not resident, so loaded by its own demand) into the running
        average and move the margin: up while the average is below `on_demand_target`, down while it is above."""
        needs = len(experts)
        share = sum(not self.resident[layer, e] for e in experts) / needs
        weight = 1.0 - (1.0 - _SHARE_WEIGHT) ** needs  # each need weighs the same in the average
        self.on_demand_share += weight * (share - self.on_demand_share)
        step = _MARGIN_STEP * needs * (self.on_demand_target - self.on_demand_share)
        self.margin = min(max(self.margin + step, 0.0), self.margin_cap)

    def on_access(self, key: ExpertKey) -> None:
        self.clock += 1
        self.last_use[key] = self.clock

    def on_insert(self, key: ExpertKey) -> None:
        self.resident[key] = True
        if key not in self._demanding:
            self.clock += 1
            self.last_use[key] = self.clock

    def on_evict(self, key: ExpertKey) -> None:
        self.resident[key] = False

    # -- decisions ----------------------------------------------------------------------------------------------
    def expected_next_use(self) -> np.ndarray:
        """Expected requests until each (layer, expert) is needed again, from the current layer."""
        if self._wait is None:  # changes with routes, predictions and the current layer, not with each eviction
            self._wait = self._expected_wait()
        enu = self._wait - 1e-6 * self.last_use / max(self.clock, 1)  # ties: least recently used goes first
        return np.where(self.hot, enu - _HOT_OFFSET, enu)

    def _expected_wait(self) -> np.ndarray:
        layers = np.arange(self.num_layers)[:, None]
        ran = layers <= self.cur
        ahead = ~ran
        delta_now = (layers - self.cur).astype(float)
        delta_next = np.where(ahead, delta_now + self.num_layers, self.num_layers - self.cur + layers)
        if self.next_demand is not None and self._predicted_step == self.step:
            later = self._later = self._wait_after_this_step(delta_next)
            return np.where(ahead, self.demand * delta_now + (1 - self.demand) * later, later)
        freq = np.where(ran, self.temporal * self.next_guess + (1 - self.temporal) * self.freq, self.freq)
        q = np.clip(self.beta * self.demand + (1 - self.beta) * freq, 1e-3, 1.0)
        later = self._later = delta_next + self.num_layers * (1 - q) / q  # geometric wait beyond the next use slot
        return np.where(ahead, self.demand * delta_now + (1 - self.demand) * later, later)

    def _wait_after_this_step(self, delta_next: np.ndarray) -> np.ndarray:
        """Expected requests until the first use in a later step: in the k-th next one with the head's chance
        (independently), after the head's K steps geometric with chance f per step; truncated at `wait_cap` steps."""
        f = np.clip(self.freq, 1e-3, 1.0)
        chance = np.clip(self.next_weight * self.next_demand + (1 - self.next_weight) * f, 1e-3, 1.0)  # [K, L, E]
        if self.wait_cap is not None:  # the head's steps within the cap, then f for each step up to it
            extra = max(self.wait_cap - len(chance), 0)
            chance = np.concatenate([chance[:self.wait_cap], np.broadcast_to(f, (extra,) + f.shape)])
        unused = np.cumprod(np.concatenate([np.ones((1,) + f.shape), 1 - chance]), axis=0)  # no use before step j
        when = delta_next + self.num_layers * np.arange(len(chance))[:, None, None]  # [J, L, 1]: use in step j
        if self.wait_cap is None:  # unused after the head's steps: a geometric wait, in expectation
            rest = delta_next + self.num_layers * (len(chance) + (1 - f) / f)
        else:  # every wait counted up to the cap
            cap = self.wait_cap * self.num_layers
            when, rest = np.minimum(when, cap), cap
        return (unused[:-1] * chance * when).sum(axis=0) + unused[-1] * rest

    def victim(self, key: ExpertKey, evictable: Callable[[ExpertKey], bool], free_slots: int) -> ExpertKey | None:
        # a prefetch: the keys `prefetches` offered, which a request's demand loads never are (`on_request` clears
        # them first); with one MoE layer the next step's may be experts of the request still running
        prefetch = key in self._targets
        if prefetch and self.use_quota and self.resident[key[0]].sum() >= self.quota[key[0]]:
            return WAVE  # this layer already holds its predicted share: not even a free slot (the prefetch is dropped)
        if free_slots > 0:
            return None
        enu = self.expected_next_use()
        keys = np.argwhere(self.resident)
        # furthest expected next use first; exact ties (hot experts' waits, offset far below the rest, lose their
        # recency term to rounding) to the least recently used
        order = np.lexsort((self.last_use[self.resident], -enu[self.resident]))
        # the candidate's own wait (a hot one's offset keeps it resident, not a licence to evict what is needed sooner)
        bar = enu[key] + _HOT_OFFSET * self.hot[key] + self.margin if prefetch else -np.inf
        if prefetch and self.defer_to_waves and key[0] > self.cur:  # a wave needs its own expert later by > gap
            bar = max(bar, np.nextafter(self._wave_would_free(key[0]) - self.wave_gap, -np.inf))
        for i in order:
            cand = (int(keys[i][0]), int(keys[i][1]))
            if enu[cand] <= bar:
                return None  # every remaining resident is needed too soon (the margin, or what a wave frees)
            if cand not in self._targets and evictable(cand):
                if self.waves and not prefetch and self._own_expected_later(enu, evictable, enu[cand]):
                    return WAVE  # computing the request in parts frees its own experts, the better victims
                return cand
        return None

    def _wave_would_free(self, layer: int) -> float:
        """The latest wait after this step among the resident experts that layer `layer`'s request is predicted to
        need (d ≥ θ) and that are not in the hot set: once that request has computed them, a wave can evict them
        (−inf if there are none)."""
        own = self.resident[layer] & (self.demand[layer] >= self.theta) & ~self.hot[layer]
        return float(self._later[layer][own].max()) if own.any() else -np.inf

    def _own_expected_later(self, enu: np.ndarray, evictable: Callable[[ExpertKey], bool], than: float) -> bool:
        """Whether one of the running request's experts that it holds (pinned) is expected more than `wave_gap`
        requests later than `than`."""
        return any(self.resident[k] and not evictable(k) and enu[k] > than + self.wave_gap for k in self._demanding)

    def prefetches(self, step: int, layer: int) -> list[ExpertKey]:
        offered: list[ExpertKey] = []
        if step == self._predicted_step:
            rows, theta = [(l, self.demand[l]) for l in range(layer, min(self.num_layers, layer + self.horizon))], \
                self.theta
        elif (self.speculate > 0 and step > self._predicted_step and layer == 0
              and self.next_demand is not None):
            rows, theta = [(0, self.next_demand[0, 0])], self.speculate  # the next step's first layer: guess
        else:
            return []  # the next step's tokens are not known yet
        for l, row in rows:
            room = self.quota[l] - self.resident[l].sum() if self.use_quota else np.inf
            for e in np.argsort(-row, kind="stable"):
                if row[e] < theta or room <= 0:  # with `use_quota`: no more than the layer's share (`victim`)
                    break
                if not self.resident[l, e]:
                    offered.append((l, int(e)))
                    room -= 1
        self._targets = set(offered)
        self._targets_all |= self._targets
        return offered

    def cancellations(self) -> list[ExpertKey]:
        """Prefetched experts of the layer that just routed which its router did not choose (cancel if queued)."""
        out, self._cancel = self._cancel, []
        return out


def _integer_shares(capacity: int, weights: np.ndarray) -> np.ndarray:
    """`capacity` slots split in proportion to `weights` ([L], not all 0) as integers that add up to it: each layer
    its share rounded down, the slots left over one each to the layers with a fraction left, earliest layers first."""
    share = capacity * weights / weights.sum()
    out = np.floor(share + 1e-9)
    left = int(round(capacity - out.sum()))
    for layer in np.flatnonzero(share - out > 1e-9)[:left]:
        out[layer] += 1
    return out


def _is_real(value) -> bool:
    """A number (NumPy's included), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def _finite(value: numbers.Real) -> bool:
    """Whether a real number is finite as a float (an integer past float's range is not: nothing here takes one)."""
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def _shown(value) -> str:
    """A value for a message, an integer of hundreds of digits cut short."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}…({len(text)} characters)"


def _chances(probs) -> np.ndarray:
    """Predicted probabilities as float64 in [0, 1]; a NaN (a broken predictor, an fp16 overflow) says nothing: 0."""
    chances = np.asarray(probs, dtype=np.float64)
    if chances is probs or chances.base is not None:  # the caller's memory: work on a copy
        chances = chances.copy()
    return np.clip(np.nan_to_num(chances, nan=0.0, copy=False), 0.0, 1.0, out=chances)


def _one_hot(ids: np.ndarray, num_experts: int) -> np.ndarray:
    """Routes `ids` ([T, k], −1 = none) as a [T, E] 0/1 matrix."""
    out = np.zeros((len(ids), num_experts))
    rows, cols = np.nonzero(ids >= 0)
    out[rows, ids[rows, cols]] = 1.0
    return out


def _count_transitions(counts: np.ndarray, before: np.ndarray, after: np.ndarray) -> None:
    """Add one to counts[a, b] for every expert a of a row of `before` and b of the same row of `after` (batches of
    different sizes, e.g. prefill then decode, are not paired)."""
    if len(before) == len(after) and len(before):
        counts += _one_hot(before, len(counts)).T @ _one_hot(after, len(counts))


def _transition_guess(counts: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Chance that each expert is chosen after routes `ids` ([T, k]): per token the sum of P(b | a) over its experts a
    (capped at 1), combined over tokens as independent."""
    table = counts / counts.sum(axis=1, keepdims=True)
    per_token = np.clip(_one_hot(ids, len(counts)) @ table, 0.0, 1.0)  # [T, E]
    return 1.0 - np.prod(1.0 - per_token, axis=0)
