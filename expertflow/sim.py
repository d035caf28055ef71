"""Trace-driven discrete-event simulator of the expert cache: replays a trace's requests against a policy.

Owns: the replay loop, the serial-link timing model and the per-policy report. Does not know: tensors, devices or
models. It serves every request through `expertflow.slots` (`SlotTable` + `serve_request`) with policies from the
registry, exactly as the live runtime does, so both count the same hits and loads on the same routing.

Semantics (the user's version is docs/simulation.md):
  * Requests R(step, layer) are served in (step, layer) order; R's experts are the distinct experts all tokens of
    the step chose at that layer. Capacity C counts expert slots shared by all layers.
  * Per request: `policy.on_route` with the per-token routes, then `serve_request`: resident experts are pinned
    first; a need is a *hit* when its expert is resident and ready when the request starts, every other need is a
    miss; missing experts get slots in ascending id order (demand loads); when every slot is pinned (or the policy
    answers `WAVE`) the request is served in waves, each split counted in `waves` as live. Pins are released when the
    request ends.
  * Prefetch: `policy.prefetches(step, layer)` for request R_{i+1} is called while R_i is being served, once R_i's
    last wave has its slots and its experts have arrived, before R_i computes (for the first request: before it
    starts). So a policy has seen the routes of R_i, not those of R_{i+1}, and the experts R_i has just used can be
    handed off (below). Each key that is not resident gets a slot from
    `SlotTable.allocate(handoff=True)` and a low-priority load; the first key that gets no slot ends the batch.
    The policy picks the victim; a demand load never evicts a pinned expert, but a prefetch may take the slot of a
    ready expert R_i has pinned (slot hand-off): R_i still computes from it, computing its handed-off experts
    first (one at a time, its compute split evenly over its experts), and the copy into a slot cannot start before
    R_i has computed that slot's expert (it holds the prefetch queue until then, as on a copy stream).
    Demand-only policies never prefetch, so their counts do not depend on this.
  * Counting mode: a load completes at once. Timed mode: one serial link, a transfer takes `transfer_ms`; the link
    starts queued transfers in order, demand (high priority) ahead of queued prefetches, never pre-empting the one
    in flight. A queued prefetch that a request needs is promoted to high priority. A request starts when the
    previous one ends; each wave waits until its experts have arrived (that wait is stall) and then computes for
    `layer_ms + token_ms × tokens in the step`, shared among the request's waves in proportion to their experts.
    A wave with more to come hands one of its slots to the next wave's first expert once it is ready
    (`Wave.start_next`): that copy, queued with the prefetches, starts at high priority once the expert it displaces
    has computed (first, alone), as live.
    An expert is ready once its transfer has finished at or before the moment in question.
  * Counts: needs = hits + misses; loads = every load issued (demand and prefetch); on_demand_loads = loads issued
    by requests; prefetch_hits = prefetched experts that a request then needed (as the runtime counts them);
    wasted_prefetches = prefetched experts evicted (their queued transfer cancelled) before any request needed them.
    Timed mode adds modeled_ms_per_token = end of the last request / tokens in the trace, stall_ms,
    late_prefetches = prefetch_hits whose copy had not landed when the request started (counted as misses), and
    link_busy_share = the share of that time the link spent copying (as the live `Stats.link_busy_s` over the wall
    time; the simulator has no host work between steps, where the link may wait live). The
    lower bound is max(total compute, Belady's loads × transfer_ms) / tokens: the best a policy that keeps each
    request's experts pinned until it ends can do. The lower bound with waves, which no policy can go below, pinned
    or not, puts `loads_lower_bound` (interval packing, below) in place of Belady's loads. When some request needs
    more experts than the cache holds, Belady's loads are no longer the minimum and only this second bound is one.
    Even when every request fits, a policy that serves requests in waves or lets a prefetch take a computed
    expert's slot (the hand-off above) may load less than Belady and run below the first bound.
  * Capacity from a fraction F of all L × E experts: round half up, clamped to [1, L × E]. Belady's loads are the
    minimum for pinned requests when every request fits in the cache (see `expertflow.policy.belady`).
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from expertflow.policy.base import ExpertKey, Policy, make_policy, policy_class, policy_keys, required_options
from expertflow.slots import RequestCounts, SlotTable, serve_request
from expertflow.trace import Request, Trace

__all__ = ["Timing", "Workload", "PolicyResult", "simulate", "simulate_policies", "capacity_from_fraction",
           "lower_bound_ms_per_token", "loads_lower_bound", "step_predictions", "prediction_pair",
           "true_predictions"]


@dataclass(frozen=True)
class Timing:
    """Timed-mode parameters, in milliseconds."""

    transfer_ms: float
    layer_ms: float
    token_ms: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.transfer_ms) and self.transfer_ms > 0):
            raise ValueError(f"transfer_ms={self.transfer_ms} must be a time above 0")
        for name in ("layer_ms", "token_ms"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise ValueError(f"{name}={getattr(self, name)} must be a time of at least 0")

    @classmethod
    def from_link(cls, link_gbps: float, expert_mb: float, layer_ms: float, token_ms: float = 0.0) -> Timing:
        """`link_gbps` in GB/s (10^9 bytes/s) and `expert_mb` in MB (10^6 bytes) give the transfer time."""
        for name, value in (("link_gbps", link_gbps), ("expert_mb", expert_mb)):
            if not value > 0:
                raise ValueError(f"{name}={value} must be positive")
        if layer_ms < 0 or token_ms < 0:
            raise ValueError(f"layer_ms={layer_ms} and token_ms={token_ms} must not be negative")
        return cls(transfer_ms=expert_mb * 1e6 / (link_gbps * 1e9) * 1e3, layer_ms=layer_ms, token_ms=token_ms)

    def compute_ms(self, tokens: int) -> float:
        return self.layer_ms + self.token_ms * tokens


@dataclass(frozen=True)
class Workload:
    """A trace prepared for replay: its requests and the flat need sequence (for oracles)."""

    requests: tuple[Request, ...]
    future: tuple[ExpertKey, ...]
    tokens: int
    num_layers: int
    num_experts: int

    @classmethod
    def from_trace(cls, trace: Trace) -> Workload:
        requests = tuple(trace.requests())
        future = tuple((r.layer, e) for r in requests for e in r.experts)
        return cls(requests, future, trace.num_tokens, trace.num_layers, trace.num_experts)


@dataclass
class PolicyResult:
    needs: int = 0
    hits: int = 0
    misses: int = 0
    hit_rate: float = 0.0
    loads: int = 0
    on_demand_loads: int = 0
    prefetches: int = 0
    prefetch_hits: int = 0
    wasted_prefetches: int = 0
    waves: int = 0  # extra parts: one for each time a request was split (its experts exceeded the free slots, or
    # its policy answered WAVE), as the live `Stats.waves`
    modeled_ms_per_token: float | None = None
    stall_ms: float | None = None
    late_prefetches: int | None = None
    link_busy_share: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


def capacity_from_fraction(fraction: float, num_layers: int, num_experts: int) -> int:
    """round_half_up(fraction × L × E), clamped to [1, L × E]."""
    if not 0 < fraction <= 1:
        raise ValueError(f"cache fraction {fraction} must be in (0, 1]")
    total = num_layers * num_experts
    # Rounded to 9 decimals first so that a product meant to end in .5 (0.35 × 90 = 31.499999999999996) rounds up.
    return max(1, min(total, math.floor(round(fraction * total, 9) + 0.5)))


class _Transfer:
    __slots__ = ("key", "issued", "high", "start", "finish", "cancelled", "gated")

    def __init__(self, key: ExpertKey, issued: float, high: bool, gated: bool = False) -> None:
        self.key, self.issued, self.high = key, issued, high
        self.start: float | None = None
        self.finish: float | None = None
        self.cancelled = False
        self.gated = gated  # into a handed-off slot: cannot start before the request has computed it (`release`)


class SerialLink:
    """One transfer at a time; high priority first among queued transfers; no pre-emption.

    Callers must `advance(now)` before issuing at `now`, so every queued transfer was issued no later than the moment
    the link next becomes free, and the choice at that moment sees exactly the transfers issued by then.
    """

    def __init__(self, transfer_ms: float) -> None:
        self.transfer_ms = transfer_ms
        self._high: deque[_Transfer] = deque()
        self._low: deque[_Transfer] = deque()
        self._started: deque[_Transfer] = deque()  # started, completion not yet reported
        self._free_at = 0.0
        self._busy_ms = 0.0  # every started transfer's whole time

    def issue(self, key: ExpertKey, now: float, high: bool, gated: bool = False) -> _Transfer:
        transfer = _Transfer(key, now, high, gated)
        (self._high if high else self._low).append(transfer)
        return transfer

    def promote(self, transfer: _Transfer) -> None:
        if transfer.start is None and not transfer.high:
            self._low.remove(transfer)
            transfer.high = True
            self._high.append(transfer)

    def cancel(self, transfer: _Transfer) -> None:
        transfer.cancelled = True
        if transfer.start is None:
            (self._high if transfer.high else self._low).remove(transfer)

    def _start_next(self, limit: float | None) -> bool:
        queue = self._high or self._low
        if not queue or queue[0].gated:  # in order, like a copy stream: a gated head holds the queue
            return False
        start = max(self._free_at, queue[0].issued)
        if limit is not None and start > limit:
            return False
        transfer = queue.popleft()
        transfer.start, transfer.finish = start, start + self.transfer_ms
        self._free_at = transfer.finish
        self._busy_ms += self.transfer_ms
        self._started.append(transfer)
        return True

    def advance(self, now: float) -> list[_Transfer]:
        """Start what the link would have started by `now`; return the transfers finished by `now`."""
        while self._start_next(now):
            pass
        done = []
        while self._started and self._started[0].finish <= now:
            done.append(self._started.popleft())
        return done

    @staticmethod
    def release(transfer: _Transfer, now: float) -> None:
        """The running request has computed the expert whose slot a gated transfer goes into: it may start at `now`."""
        transfer.gated = False
        transfer.issued = max(transfer.issued, now)

    def busy_until(self, now: float) -> float:
        """Milliseconds the link has spent copying up to `now` (the part of a transfer running past it excluded)."""
        return self._busy_ms - sum(t.finish - max(t.start, now) for t in self._started if t.finish > now)

    def finish_time(self, transfer: _Transfer) -> float:
        """Run the link until `transfer` has started (nothing else is issued meanwhile) and return its finish."""
        while transfer.start is None:
            assert self._start_next(None), "a waited-for transfer must be queued"
        return transfer.finish


class _Replay:
    """One policy over one workload."""

    def __init__(self, workload: Workload, policy: Policy, capacity: int, timing: Timing | None,
                 step_probs: dict[int, Any] | None = None) -> None:
        self.workload, self.policy, self.timing = workload, policy, timing
        self.step_probs = step_probs if policy.wants_predictions else None
        self._last_step: int | None = None
        self.table = SlotTable(capacity, policy)
        self.link = SerialLink(timing.transfer_ms) if timing else None
        self.counts = RequestCounts()
        self.result = PolicyResult()
        self.pending: dict[ExpertKey, _Transfer] = {}  # resident, transfer not yet finished
        self.gated: list[_Transfer] = []  # prefetches into slots handed off by the running request
        self.early: set[ExpertKey] = set()  # demand loads among them (`Wave.start_next`)
        self.unused_prefetch: set[ExpertKey] = set()
        self.late = 0  # prefetched experts still in flight when a request needed them
        self.now = 0.0
        self.stall = 0.0

    def run(self) -> PolicyResult:
        requests = self.workload.requests
        if requests and self.step_probs is None:  # with predictions, asked after the first `on_step`, as live
            self._prefetch(requests[0])
        for i, request in enumerate(requests):
            self._serve(request, requests[i + 1] if i + 1 < len(requests) else None)
        return self._finish()

    def _serve(self, request: Request, upcoming: Request | None) -> None:
        if self.link is not None:
            self._complete(self.link.advance(self.now))
        if self.step_probs is not None and request.step != self._last_step:
            # A new forward step: the predictor has run on its tokens before the first layer.
            probs = self.step_probs[request.step]
            self.policy.on_step(request.step, *(probs if isinstance(probs, tuple) else (probs,)))
            self._prefetch(request)
        self._last_step = request.step
        self.policy.on_route(request.step, request.layer, request.routes)
        self._cancel(self.policy.cancellations())
        for expert in request.experts:
            key = (request.layer, expert)
            if key in self.unused_prefetch:
                self.unused_prefetch.discard(key)
                self.result.prefetch_hits += 1
                self.late += key in self.pending
            if key in self.pending:
                self.link.promote(self.pending[key])
        compute = self.timing.compute_ms(request.tokens) if self.timing else 0.0
        served, parts = 0, self.counts.waves
        for wave in serve_request(self.table, request.step, request.layer, request.experts, self._demand_load,
                                  self.counts):
            served += len(wave.experts)
            if self.link is not None:
                ready = max([self.now] + [self.link.finish_time(self.pending[(request.layer, e)])
                                          for e in wave.experts if (request.layer, e) in self.pending])
                self.stall += ready - self.now
                self.now = ready
                self._complete(self.link.advance(self.now))  # the wave's experts are in place
            if served == len(request.experts) and upcoming is not None:
                self._prefetch(upcoming)  # last wave pinned and ready: prefetches may take its slots (hand-off)
            elif wave.more:
                wave.start_next()  # ready: the next wave's first expert may take one of its slots
            per_expert = compute / len(request.experts)
            for transfer in self.gated:  # handed-off experts compute first, in turn; each one's copy may then start
                self.now += per_expert
                self._complete(self.link.advance(self.now))  # what the link started meanwhile goes first
                self.link.release(transfer, self.now)
                if transfer.key in self.early:
                    self.early.discard(transfer.key)
                    self.link.promote(transfer)
            self.now += per_expert * (len(wave.experts) - len(self.gated))
            self.gated.clear()
        self.result.waves += max(self.counts.waves - parts - 1, 0)
        if not request.experts:
            if upcoming is not None:
                self._prefetch(upcoming)
            self.now += compute

    def _cancel(self, keys: Sequence[ExpertKey]) -> None:
        """Drop unwanted prefetches whose transfer has not finished (queued ones are cancelled on the link)."""
        for key in policy_keys(self.policy, keys, "cancellations", self.workload.num_layers,
                               lambda _: self.workload.num_experts, "the trace"):
            if key in self.pending and self.table.resident(key) and not self.table.pinned(key):
                self.table.evict(key)
                self._evicted(key)

    def _demand_load(self, key: ExpertKey, slot: int, evicted: ExpertKey | None, busy: bool = False) -> None:
        self._evicted(evicted)
        self._issue(key, high=not busy, gated=busy)  # into a handed-off slot: held, then raised (as the runtime)
        if busy and self.link is not None:  # counting mode: nothing is held, nothing to raise
            self.early.add(key)

    def _prefetch(self, request: Request) -> None:
        for key in policy_keys(self.policy, self.policy.prefetches(request.step, request.layer), "prefetches",
                               self.workload.num_layers, lambda _: self.workload.num_experts, "the trace"):
            if self.table.resident(key):
                continue
            got = self.table.allocate(key, handoff=True)
            if got is None:
                break
            held = self._evicted(got.evicted)
            self.result.prefetches += 1
            self.unused_prefetch.add(key)
            self._issue(key, high=False, gated=got.busy, held=held)

    def _issue(self, key: ExpertKey, high: bool, gated: bool = False, held: _Transfer | None = None) -> None:
        """`held`: the cancelled copy into the same slot, still held for a handed-off expert: the new copy waits in
        its place (live: it takes over the old copy's gate)."""
        self.result.loads += 1
        if self.link is None:
            self.table.mark_ready(key)
        else:
            self._complete(self.link.advance(self.now))  # the link must be up to date before a new issue
            transfer = self.pending[key] = self.link.issue(key, self.now, high, gated or held is not None)
            if held is not None:
                self.gated[self.gated.index(held)] = transfer
            elif gated:
                self.gated.append(transfer)

    def _evicted(self, key: ExpertKey | None) -> _Transfer | None:
        """Count and cancel what eviction of `key` ends; returns its copy if that was still held (gated)."""
        if key is None:
            return None
        if key in self.unused_prefetch:
            self.unused_prefetch.discard(key)
            self.result.wasted_prefetches += 1
        transfer = self.pending.pop(key, None)
        if transfer is None:
            return None
        self.link.cancel(transfer)
        return transfer if transfer.gated and transfer in self.gated else None

    def _complete(self, transfers: Sequence[_Transfer]) -> None:
        for transfer in transfers:
            if not transfer.cancelled and self.pending.get(transfer.key) is transfer:
                del self.pending[transfer.key]
                self.table.mark_ready(transfer.key)

    def _finish(self) -> PolicyResult:
        r, c = self.result, self.counts
        r.needs, r.hits, r.misses, r.on_demand_loads = c.hits + c.misses, c.hits, c.misses, c.loads
        assert r.needs == len(self.workload.future), "every need is a hit or a miss"
        r.hit_rate = round(r.hits / r.needs, 6) if r.needs else 0.0
        if self.timing is not None:
            tokens = max(self.workload.tokens, 1)
            r.modeled_ms_per_token = round(self.now / tokens, 6)
            r.stall_ms = round(self.stall, 6)
            r.late_prefetches = self.late
            r.link_busy_share = round(self.link.busy_until(self.now) / self.now, 6) if self.now > 0 else 0.0
        return r


def _build_policy(name: str, capacity: int, workload: Workload) -> Policy:
    cls = policy_class(name)
    missing = required_options(cls)
    if missing:
        raise ValueError(f"policy {name!r} needs the option(s) {', '.join(missing)}, which have no default and which "
                         "the simulator does not give: give them defaults to simulate it")
    kwargs: dict[str, Any] = {}
    if cls.needs_future:
        kwargs["future"] = workload.future
    return make_policy(name, capacity, workload.num_layers, workload.num_experts, **kwargs)


def simulate(workload: Workload | Trace, policy: str | Policy, capacity: int, timing: Timing | None = None,
             predictor: Any = None, predictions: Any = None) -> PolicyResult:
    """Replay `workload` against one policy at `capacity` slots (counting mode unless `timing` is given).

    `policy` is a registered name, or a fresh Policy object built for this workload and capacity. `predictions`
    (probabilities `[N, L, E]` aligned with the trace's tokens, or a pair: those and the next-token head's
    `[N, K, L, E]` for the K tokens after each; or a dict from `step_predictions`) feed policies that want them
    through `on_step` at the start of every step, as the live runtime feeds them. `predictor` is accepted and not
    read: a policy is built and fed here exactly as live, where it gets route predictions only through `on_step`.
    """
    step_probs = None
    if predictions is not None and not isinstance(predictions, dict):
        if not isinstance(workload, Trace):
            raise ValueError("per-token predictions need the Trace (to find each step's tokens), not a Workload")
        step_probs = step_predictions(workload, *prediction_pair(predictions))
    elif isinstance(predictions, dict):
        step_probs = predictions
    if isinstance(workload, Trace):
        workload = Workload.from_trace(workload)
    if isinstance(policy, str):
        policy = _build_policy(policy, capacity, workload)
    run = (capacity, workload.num_layers, workload.num_experts)
    built = tuple(getattr(policy, n, v) for n, v in zip(("capacity", "num_layers", "num_experts"), run))
    if built != run:
        raise ValueError(f"policy object {policy.name!r} was built for {built[0]} slots, {built[1]} layers x {built[2]}"
                         f" experts; this run has {capacity} slots, {workload.num_layers} x {workload.num_experts}: "
                         "build a fresh one with make_policy(name, capacity, num_layers, num_experts)")
    if policy.wants_predictions and step_probs is None:
        raise ValueError(f"policy {policy.name!r} is driven by route predictions: pass "
                         "predictions=predict_trace(predictor, trace, with_next=predictor.has_next_head) (per token; "
                         "predict_trace from expertflow.predictor.evaluate; predictor= alone does not feed it)")
    if policy.wants_predictions:
        missing = sorted({r.step for r in workload.requests} - set(step_probs))
        if missing:
            more = " ..." if len(missing) > 5 else ""
            raise ValueError(f"the predictions have no entry for step(s) {missing[:5]}{more} of the trace: give one "
                             "for every step (`sim.step_predictions` splits per-token ones)")
    return _Replay(workload, policy, capacity, timing, step_probs).run()


def step_predictions(trace: Trace, probs: Any, next_probs: Any = None) -> dict[int, Any]:
    """Split per-token predictions `[N, L, E]` into step → `[T, L, E]`, tokens in `Trace.requests()` order; with
    `next_probs` (the next-token head's `[N, K, L, E]` for the K tokens after each) into step → (probs,
    `[R, K, L, E]`) pairs, where the second holds the guess made at the last token of each of the step's R sequences
    (the one the next steps follow)."""
    import numpy as np

    probs = np.asarray(probs)
    if probs.shape != (trace.num_tokens, trace.num_layers, trace.num_experts):
        raise ValueError(f"predictions of shape {probs.shape} do not match the trace's {trace.num_tokens} tokens x "
                         f"{trace.num_layers} layers x {trace.num_experts} experts")
    if next_probs is not None:
        next_probs = np.asarray(next_probs)
        if (next_probs.ndim not in (3, 4) or next_probs.shape[0] != probs.shape[0]
                or next_probs.shape[-2:] != probs.shape[-2:]):
            raise ValueError(f"next-token predictions of shape {next_probs.shape} do not match the predictions' "
                             f"{probs.shape} (expected [N, K, L, E], or [N, L, E] for K = 1, with the same N, L and E)")
    order = np.lexsort((trace.positions, trace.seq_ids, trace.steps))
    steps = trace.steps[order]
    bounds = np.flatnonzero(np.diff(steps)) + 1
    out = {}
    for idx in np.split(order, bounds) if len(order) else []:
        step = int(trace.steps[idx[0]])
        if next_probs is None:
            out[step] = probs[idx]
        else:  # idx is sorted by sequence, then position: a sequence's last token is followed by another sequence
            seqs = trace.seq_ids[idx]
            last = idx[np.append(seqs[1:] != seqs[:-1], True)]
            out[step] = (probs[idx], next_probs[last])
    return out


def true_predictions(trace: Trace, next_tokens: int = 0) -> Any:
    """The trace's own routes in the route predictor's output format: what a perfect predictor would give.

    Returns probabilities `[N, L, E]` (1 where the token chose the expert, else 0; an entry of −1 chooses nothing),
    and with `next_tokens=K` > 0 the pair (that, `[N, K, L, E]`) whose row k holds the routes of the (k + 1)-th token
    after it in its sequence, as the next-token head guesses them (zeros past the sequence's end). A sequence's tokens
    follow one another in (position, step) order, as the predictor reads them (`expertflow.predictor.data.sequences`).
    Feed it to `step_predictions` or `simulate(..., predictions=...)`, alone or mixed with a predictor's output, to see
    what a better predictor would buy.
    """
    import operator

    import numpy as np

    if isinstance(next_tokens, bool) or not hasattr(next_tokens, "__index__"):
        raise TypeError(f"next_tokens={next_tokens!r}: give a whole number of following tokens (0 for none)")
    next_tokens = operator.index(next_tokens)
    if next_tokens < 0:
        raise ValueError(f"next_tokens={next_tokens}: give 0 (current routes only) or the number of following tokens")
    n, layers, e = trace.num_tokens, trace.num_layers, trace.num_experts
    experts = trace.experts.astype(np.int64)
    chose = (experts >= 0) & (experts < e)
    probs = np.zeros((n, layers, e + 1), dtype=np.float32)  # column e collects the entries that choose nothing
    np.put_along_axis(probs, np.where(chose, experts, e), 1.0, axis=2)
    probs = np.ascontiguousarray(probs[:, :, :e])
    if not next_tokens:
        return probs
    order = np.lexsort((trace.steps, trace.positions, trace.seq_ids))  # by sequence, then position, then step
    seqs = trace.seq_ids[order]
    following = np.zeros((n, next_tokens, layers, e), dtype=np.float32)
    for k in range(1, min(next_tokens, n - 1) + 1):
        same = seqs[k:] == seqs[:-k]  # the token k places later in this order belongs to the same sequence
        following[order[:-k][same], k - 1] = probs[order[k:][same]]
    return probs, following


def prediction_pair(predictions: Any) -> tuple[Any, Any]:
    """(probs, next_probs or None) from per-token predictions given alone or as a pair."""
    if isinstance(predictions, tuple):
        if len(predictions) != 2:
            raise ValueError("predictions: give probabilities [N, L, E], or a pair (probs, next_probs)")
        return predictions
    return predictions, None


def lower_bound_ms_per_token(workload: Workload, capacity: int, timing: Timing,
                             belady_loads: int | None = None, waves: bool = False) -> float:
    """max(total compute, loads × transfer time) / tokens: every transfer hidden behind compute.

    The loads are Belady's (the contract's `lower_bound_ms_per_token`): the fewest among policies that keep a request's
    experts pinned until it ends, while every request fits in the cache. When some request does not fit, Belady's rule
    is no longer optimal and this is no bound. With `waves` they are `loads_lower_bound`, which no policy goes below,
    whether it serves requests whole or in parts (`lower_bound_waves_ms_per_token`).
    """
    compute = sum(timing.compute_ms(r.tokens) for r in workload.requests)
    if waves:
        loads = loads_lower_bound(workload, capacity)
    else:
        loads = simulate(workload, "belady", capacity).loads if belady_loads is None else belady_loads
    return max(compute, loads * timing.transfer_ms) / max(workload.tokens, 1)


def loads_lower_bound(workload: Workload, capacity: int) -> int:
    """Loads no policy can go below with `capacity` slots, whether it serves requests whole or in waves.

    Every need of an expert is a load unless the expert has stayed in one slot since its previous need: a stay, the
    interval from the request of that need to this one. Two stays can use one slot in turn only when the first ends
    no later than the second starts (in the same request, one after the other: waves). So loads ≥ needs − the most
    stays `capacity` slots can hold, and taking stays by end, each into the slot that became free last at or before
    its start (none free: skip it), holds the most (the greedy rule for intervals on k machines, Carlisle & Lloyd,
    1995). The count leaves out that a loaded expert also needs a slot while it computes: it is a bound, which some
    traces' best policy does not reach. It is never below Σ_R max(experts first needed in R, |R| − C).
    """
    last: dict[ExpertKey, int] = {}
    stays: list[tuple[int, int]] = []  # (end, start) in request indices
    needs = 0
    for index, request in enumerate(workload.requests):
        for expert in request.experts:
            key = (request.layer, expert)
            if key in last:
                stays.append((index, last[key]))
            last[key] = index
            needs += 1
    stays.sort()
    free_at = [-1] * capacity  # ascending: when each slot's last stay ended
    held = 0
    for end, start in stays:
        i = bisect.bisect_right(free_at, start) - 1
        if i >= 0:
            del free_at[i]
            bisect.insort(free_at, end)
            held += 1
    return needs - held


def simulate_policies(trace: Trace, policies: Sequence[str], capacity: int, timing: Timing | None = None,
                      predictor: Any = None, predictions: Any = None) -> dict[str, Any]:
    """The `simulate --json` document for several policies at one capacity."""
    workload = Workload.from_trace(trace)
    step_probs = step_predictions(trace, *prediction_pair(predictions)) if predictions is not None else None
    results = {name: simulate(workload, name, capacity, timing, predictor, step_probs) for name in policies}
    report: dict[str, Any] = {"capacity_slots": capacity, "policies": {n: r.as_dict() for n, r in results.items()}}
    if timing is not None:
        belady = results["belady"].loads if "belady" in results else None
        report["lower_bound_ms_per_token"] = round(lower_bound_ms_per_token(workload, capacity, timing, belady), 6)
        report["lower_bound_waves_ms_per_token"] = round(lower_bound_ms_per_token(workload, capacity, timing,
                                                                                  waves=True), 6)
        # Belady's loads are the fewest only while every request fits: said in the document, not only in the table
        largest = max((len(r.experts) for r in workload.requests), default=0)
        report["lower_bound_holds"] = largest <= capacity
    return report
