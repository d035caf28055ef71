"""How accurate must the next-token head be? The `expertflow` policy replayed with the head's guesses moved part of
the way towards the true routes of the following tokens, against the recall that each step of the way reaches.

`benchmarks/perfect_predictions.py` shows that with the true routes of the next tokens in place of the head's guesses
the policy meets targets it misses with them. This benchmark measures the way in between. For each blend weight `a`
the head's probabilities for each of the K tokens it covers become `(1 - a) * head + a * truth` (truth: 1 for the
experts that token is routed to, 0 for the others; `expertflow.sim.true_predictions`), so `a = 0` is the shipped head
and `a = 1` the `true next tokens` source of perfect_predictions.py; the current step's routes stay the predictor's.
A blend is a model of a better head, not a head: it is surer where it is right than a fitted head of the same recall
need be, and it raises the recall of the farther tokens together with the next one's. Above `a = 0.5` the truth
always ranks first (top-k recall 1; at 0.5 only a tie could keep it out); larger weights only make the guess surer of
the experts it names and fainter about the rest, which the policy also reads. Each row gives the blend's top-k recall
of the routes of the token one ahead and its mean over the K tokens (`expertflow.predictor.metrics.next_token_recall`,
decode tokens, as in `benchmarks/eviction_horizon.py`), then the policy's figures and the targets they meet, as in
perfect_predictions.py (same trace, predictor, compute model, ratio, targets and profiles `default` and `waves`; the
baselines are replayed once per configuration). Then a summary object: per configuration and profile, the least blend
(and its recall) that meets each target and that meets them all, and every blend that meets them all (a larger
weight need not meet what a smaller one does); decided on unrounded figures.

Usage: python benchmarks/head_recall_needed.py [--trace T [--split S] | --temperature T --max-new-tokens 32]
                                              [--predictor DIR] [--ratio 8] [--fractions 0.5] [--batches 1,16]
                                              [--blends 0,0.05,...,1] [--compute-from JSONL] [--plot PNG]
       (or: --from-results JSONL --plot PNG, to redraw)
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator

import numpy as np

from expertflow import sim
from expertflow.predictor.metrics import next_token_recall
from ece_frontier import targets
from ece_sim import add_plot_arguments, add_source_arguments, parse_or_redraw, prepare, source_config, timing_fields
from perfect_predictions import PROFILES, baseline_config, by_profile, check_head, policy_rows

BENCHMARK = "head_recall_needed"
SHOWN = {name: PROFILES[name] for name in ("default", "waves")}
DEFAULT_BLENDS = "0,0.05,0.1,0.15,0.2,0.25,0.3,0.35,0.4,0.5,0.6,0.7,0.8,0.9,1"
PLOTTED = ("batch", "cache_fraction", "profile", "blend", "recall_one_ahead", "hit_rate_gain",
           "on_demand_share_of_needs", "all_targets_met")


def _blends(text: str) -> tuple[float, ...]:
    """argparse type of --blends: comma-separated weights in [0, 1], increasing."""
    try:
        values = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated weights such as 0,0.5,1") from None
    if not all(0.0 <= v <= 1.0 for v in values) or list(values) != sorted(set(values)):
        raise argparse.ArgumentTypeError(f"{text!r}: each weight must lie in [0, 1], in increasing order, "
                                         "without repeats (0 = the head as it is, 1 = the true routes)")
    return values


def blended(trace, probs, weights) -> Iterator[tuple[float, dict, np.ndarray]]:
    """(weight, recall figures, next-token probabilities [N, K, L, E]) per blend weight, one blend at a time."""
    _, head = sim.prediction_pair(probs)
    if head is None:
        raise ValueError("the predictions hold no next-token head's guesses, and the blends move those")
    head = np.asarray(head, dtype=np.float32)
    _, truth = sim.true_predictions(trace, next_tokens=head.shape[1])
    for a in weights:
        guess = (1.0 - a) * head + a * truth
        recalls = [next_token_recall(trace, guess[:, k], offset=k + 1)["next_token_head"]
                   for k in range(head.shape[1])]
        known = [r for r in recalls if r is not None]
        if not known:
            raise ValueError("the trace holds no decode token with a following token in its sequence, so there "
                             "is no recall to measure; record more new tokens per prompt")
        yield a, {"recall_one_ahead": recalls[0], "recall_mean": float(np.mean(known))}, guess


def least(rows: list[dict], target: str | None) -> dict | None:
    """The least-blend row meeting `target` (None: every target), as {blend, recall_one_ahead}, or None."""
    for r in sorted(rows, key=lambda r: r["blend"]):
        if (r["all_targets_met"] if target is None else target in r["targets_met"]):
            return {"blend": r["blend"], "recall_one_ahead": r["recall_one_ahead"]}
    return None


def plot(rows: list[dict], path: str) -> None:
    """Hit-rate gain (top row) and on-demand share (bottom row) against the blend weight, a column per
    configuration, a line per profile, the recall one token ahead on a second axis above; target lines dashed,
    points meeting every target filled."""
    from matplotlib.figure import Figure  # no pyplot: renders with Agg, no display needed

    configs = sorted({(r["batch"], -r["cache_fraction"]) for r in rows})
    fig = Figure(figsize=(4.6 * len(configs), 6.6), layout="constrained")
    axes = fig.subplots(2, len(configs), squeeze=False, sharex=True)
    for column, (batch, negative) in enumerate(configs):
        fraction = -negative
        mine = [r for r in rows if (r["batch"], r["cache_fraction"]) == (batch, fraction)]
        limit = targets(batch, fraction)
        top, bottom = axes[0][column], axes[1][column]
        for i, profile in enumerate(dict.fromkeys(r["profile"] for r in mine)):
            line = sorted((r for r in mine if r["profile"] == profile), key=lambda r: r["blend"])
            for ax, key, scale in ((top, "hit_rate_gain", 1.0), (bottom, "on_demand_share_of_needs", 100.0)):
                ax.plot([r["blend"] for r in line], [scale * r[key] for r in line], "-", color=f"C{i}",
                        label=f"profile: {profile}")
                for r in line:
                    ax.plot(r["blend"], scale * r[key], "o", color=f"C{i}", markersize=5,
                            markerfacecolor=f"C{i}" if r["all_targets_met"] else "white")
        top.axhline(limit["hit_rate_gain"], color="gray", linestyle="--", linewidth=1, label="target")
        if "on_demand_share_of_needs" in limit:
            bottom.axhline(100 * limit["on_demand_share_of_needs"], color="gray", linestyle="--", linewidth=1)
        recall = {r["blend"]: r["recall_one_ahead"] for r in mine}
        ticks = [a for a in sorted(recall) if a <= 0.5 and round(a * 10, 6) == round(a * 10)] or sorted(recall)
        above = top.secondary_xaxis("top")
        above.set_xticks(ticks, [f"{recall[a]:.2f}" for a in ticks], fontsize=7)
        above.set_xlabel("top-k recall one token ahead", fontsize=8)
        top.set_title(f"batch {batch}, {fraction:.0%} cached", fontsize=10)
        top.set_ylabel("hit rate - best baseline's")
        bottom.set_ylabel("on-demand loads, % of needs")
        bottom.set_xlabel("truth's weight in the head's guess (0: shipped head)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle("expertflow as the next-token head's guess moves towards the truth (filled: every target met)",
                 fontsize=10)
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_source_arguments(parser)
    parser.set_defaults(fractions="0.5")  # the on-demand target, the one that binds, is set with half cached
    parser.add_argument("--blends", type=_blends, default=DEFAULT_BLENDS,
                        help="weights of the truth in the head's guesses (0 = the head, 1 = the true routes)")
    add_plot_arguments(parser, "hit-rate gain and on-demand share against the recall")
    args = parse_or_redraw(parser, plot, BENCHMARK, PLOTTED)
    if args is None:
        return
    check_head(parser, args)
    trace, probs, timing = prepare(args, parser)
    predicted, _ = sim.prediction_pair(probs)
    rows = []
    for batch in args.batches:
        for fraction in args.fractions:
            base = baseline_config(trace, batch, fraction, timing, BENCHMARK)
            try:
                for a, recall, guess in blended(trace, probs, args.blends):
                    rows += policy_rows(trace, base, {f"blend {a:g}": (predicted, guess)}, timing, SHOWN,
                                        extra=dict(blend=a, **{k: round(v, 4) for k, v in recall.items()}))
            except ValueError as exc:
                parser.error(str(exc))
    if args.plot:
        plot(rows, args.plot)
    summary = {}
    for label, batch, fraction, mine in by_profile(rows, args.batches, args.fractions, SHOWN):
        summary[label] = {"targets": targets(batch, fraction),
                          "least_blend_meeting": {name: least(mine, name) for name in targets(batch, fraction)},
                          "least_blend_meeting_all": least(mine, None),
                          "blends_meeting_all": [r["blend"] for r in mine if r["all_targets_met"]]}
    source = source_config(args, profiles=SHOWN, blends=list(args.blends))
    print(json.dumps({"benchmark": f"{BENCHMARK}_summary", "config": source, "tokens": trace.num_tokens,
                      "timing": timing_fields(timing), "summary": summary}))


if __name__ == "__main__":
    main()
