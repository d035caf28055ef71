"""How far ahead must an eviction know the routes? Loads against Belady's when the future is known for a few steps.

Counting mode (no timing) on the same held-out trace as `ece_sim.py` (recorded by it, or --trace), replayed at
`--batch` sequences per step with `--fraction` of the experts cached. Rows:

* `known_steps_H`: demand-only, evicts the resident whose next need is furthest when that need lies in the current
  step or one of the next H steps (the true routes); residents not needed within that horizon go first, least
  frequently used first (`lfu`'s order). H = 0 knows only the current step; a large H is Belady.
* `expertflow`: the shipped policy, demand-only (no prefetching at all) and with its prefetching, driven by the
  route predictor with and without its next-token head (without: step-to-step transition counts guess the next
  step).

Also reports how well the next-token head guesses the routes of the next tokens (1, 2, … ahead) on the trace's decode
tokens (`next_token_recall`, top-k recall, beside the current token's own routes as the guess).

Prints one JSON document. Usage: python benchmarks/eviction_horizon.py [--trace T [--split S] | --temperature T
                                                                        --max-new-tokens 32] [--batch 16]
                                                                        [--fraction 0.5]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence

import numpy as np

from expertflow import sim
from expertflow.commands import check_exists, check_fraction, check_positive
from expertflow.policy import Policy, make_policy
from expertflow.policy.base import ExpertKey

HORIZONS = (0, 1, 2, 4, 8)


class KnownSteps(Policy):
    """Belady within the current step and the next `horizon` steps; `lfu` order for everything further away."""

    name = "known-steps"

    def __init__(self, capacity: int, workload: sim.Workload, horizon: int) -> None:
        super().__init__(capacity, workload.num_layers, workload.num_experts)
        self.horizon = horizon
        future = workload.future
        self.step_of = [r.step for r in workload.requests for _ in r.experts]
        step_index = {s: i for i, s in enumerate(sorted(set(self.step_of)))}
        self.step_rank = [step_index[s] for s in self.step_of]
        self.next_at = [len(future)] * len(future)
        seen: dict[ExpertKey, int] = {}
        for i in range(len(future) - 1, -1, -1):
            self.next_at[i] = seen.get(future[i], len(future))
            seen[future[i]] = i
        self.pos, self.rank = 0, 0
        self.next: dict[ExpertKey, int] = {}
        self.count = np.zeros((workload.num_layers, workload.num_experts))
        self.resident: set[ExpertKey] = set()

    def on_request(self, step: int, layer: int, experts: Sequence[int]) -> None:
        self.rank = self.step_rank[self.pos] if self.pos < len(self.step_rank) else self.rank

    def on_access(self, key: ExpertKey) -> None:
        self.next[key] = self.next_at[self.pos]
        self.pos += 1
        self.count[key] += 1

    def on_insert(self, key: ExpertKey) -> None:
        self.resident.add(key)

    def on_evict(self, key: ExpertKey) -> None:
        self.resident.discard(key)

    def victim(self, key: ExpertKey, evictable: Callable[[ExpertKey], bool], free_slots: int) -> ExpertKey | None:
        if free_slots > 0:
            return None

        def order(k: ExpertKey) -> tuple:
            at = self.next.get(k, len(self.step_rank))
            known = at < len(self.step_rank) and self.step_rank[at] - self.rank <= self.horizon
            return (0, at, k) if known else (1, -self.count[k], k)  # larger goes first

        candidates = [k for k in self.resident if evictable(k)]
        return max(candidates, key=order) if candidates else None


def _check(args: argparse.Namespace) -> None:
    """Refuse, before any work, what would fail or be ignored later (ValueError naming the flag)."""
    from ece_sim import check_trace_source

    check_positive(args.batch, "--batch", integer=True)
    check_fraction(args.fraction, "--fraction")
    check_exists("--predictor", args.predictor)
    check_trace_source(args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", help="a recorded trace or a directory of them (default: record the held-out "
                                        "prompts as ece_sim.py does)")
    parser.add_argument("--split", help="with a directory: only traces whose metadata 'split' is this")
    parser.add_argument("--predictor", help="route predictor directory (default: the shipped one)")
    parser.add_argument("--batch", type=int, default=16, help="sequences replayed together per step (default 16)")
    parser.add_argument("--fraction", type=float, default=0.5, help="share of the experts cached, in (0, 1] (default "
                        "0.5)")
    parser.add_argument("--max-new-tokens", type=int, help="tokens generated per prompt when recording (default 32)")
    parser.add_argument("--temperature", type=float,
                        help="record sampling at this temperature (seed 0) instead of greedily")
    args = parser.parse_args()
    try:
        _check(args)
    except ValueError as exc:
        parser.error(str(exc))

    from expertflow.predictor import default_predictor_path, load_predictor
    from expertflow.predictor.data import load_traces
    from expertflow.predictor.evaluate import check_fits, predict_trace
    from expertflow.predictor.metrics import next_token_recall

    try:  # before recording: the predictor must load, fit the trace and have a next-token head
        predictor = load_predictor(args.predictor or default_predictor_path())
        trace = load_traces([args.trace], split=args.split) if args.trace else None
        if trace is not None:
            check_fits(predictor, trace)
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    if not predictor.has_next_head:
        parser.error("the predictor has no next-token head (fit one with `expertflow predictor fit-next`)")
    if trace is None:
        import torch
        from transformers import AutoTokenizer

        from ece_sim import record_heldout
        from expertflow.models import tiny_moe

        model = tiny_moe(dtype=torch.float32).eval()
        trace = record_heldout(model, AutoTokenizer.from_pretrained(model.name_or_path), args.max_new_tokens or 32,
                               args.temperature)
    probs, after = predict_trace(predictor, trace, with_next=True)
    replay = trace.rebatch(args.batch)
    workload = sim.Workload.from_trace(replay)
    capacity = sim.capacity_from_fraction(args.fraction, trace.num_layers, trace.num_experts)
    belady = sim.simulate(workload, "belady", capacity).loads
    rows: dict[str, float] = {}
    for h in HORIZONS:
        rows[f"known_steps_{h}"] = sim.simulate(workload, KnownSteps(capacity, workload, h), capacity).loads
    rows["lfu"] = sim.simulate(workload, "lfu", capacity).loads
    predictions = {"next_token_head": sim.step_predictions(replay, probs, after),
                   "step_transitions": sim.step_predictions(replay, probs)}
    for name, step_probs in predictions.items():
        for label, kwargs in (("demand_only", {"theta": 1.01, "speculate": 0.0}), ("prefetching", {})):
            policy = make_policy("expertflow", capacity, trace.num_layers, trace.num_experts, **kwargs)
            rows[f"expertflow_{name}_{label}"] = sim.simulate(workload, policy, capacity,
                                                              predictions=step_probs).loads
    report = {"benchmark": "eviction_horizon", "batch": args.batch, "cache_fraction": args.fraction,
              "capacity_slots": capacity, "trace": trace.source, "tokens": trace.num_tokens,
              "next_token_recall": [{"offset": k + 1, **{name: round(v, 4) if isinstance(v, float) else v
                                                          for name, v in next_token_recall(trace, after[:, k],
                                                                                           offset=k + 1).items()}}
                                    for k in range(after.shape[1])],
              "belady_loads": belady,
              "loads": rows, "loads_vs_belady": {k: round(v / belady, 4) for k, v in rows.items()}}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
