"""What would a better route predictor buy? The `expertflow` policy replayed with the predictor's output replaced by
the trace's true routes, in part or in whole.

Same trace, predictor, compute model and transfer/compute ratio as `benchmarks/ece_sim.py` (compute is measured again in
each run unless `--compute-from` reuses an earlier run's), and the same targets as `benchmarks/ece_frontier.py`. For
each configuration (batch, cache fraction), each profile of the policy (`default`: `{}`, called `pinned` in
ece_frontier.py; `waves`: `{"waves": true, "wave_gap": 2}`; `tuned`: that with `"margin": 8`) and each source of
predictions:

* `predicted`: the route predictor's output, as in the other benchmarks;
* `true current`: the true routes of the step's own tokens, with the predictor's next-token head;
* `true next token`: the predictor's current-step routes; the head's guess for the next token replaced by its true
  routes, the further tokens' guesses kept;
* `true next tokens`: the head's guesses for all its tokens replaced by their true routes;
* `true both`: everything true (`expertflow.sim.true_predictions`).

A source that is "true" knows only what a perfect predictor of that part would: the policy still plans, prefetches
and evicts by its own rules, so even `true both` is not Belady. Prints one JSON object per (configuration, profile,
source) with the raw counts and, per configuration, the bound for any policy (`lower_bound_waves_vs_best_baseline`,
as in ece_frontier.py), then a summary object; which targets a run meets is decided on unrounded figures.

Usage: python benchmarks/perfect_predictions.py [--trace T [--split S] | --temperature T --max-new-tokens 32]
                                               [--predictor DIR] [--ratio 8] [--fractions 0.5,0.25]
                                               [--batches 1,16] [--compute-from JSONL] [--plot PNG]
       (or: --from-results JSONL --plot PNG, to redraw)
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from expertflow import sim
from expertflow.policy import make_policy
from ece_frontier import met, targets
from ece_sim import BASELINES, add_plot_arguments, add_source_arguments, parse_or_redraw, prepare, \
    source_config, timing_fields

PROFILES = {
    "default": {},
    "waves": {"waves": True, "wave_gap": 2.0},
    "tuned": {"waves": True, "wave_gap": 2.0, "margin": 8.0},
}
SOURCES = ("predicted", "true current", "true next token", "true next tokens", "true both")
PLOTTED = ("batch", "cache_fraction", "profile", "source", "hit_rate_gain", "on_demand_share_of_needs",
           "targets_met", "all_targets_met")


def sources(trace, probs) -> dict[str, tuple]:
    """Each source's (current-step probabilities, next-token probabilities) for `trace`'s tokens."""
    predicted, head = sim.prediction_pair(probs)
    if head is None:
        raise ValueError("the predictor has no next-token head; give one that has (the shipped one does), since "
                         "the sources replace the head's guesses")
    true_now, true_next = sim.true_predictions(trace, next_tokens=np.asarray(head).shape[1])
    first_true = np.array(head, dtype=np.float32, copy=True)
    first_true[:, 0] = true_next[:, 0]
    return {"predicted": (predicted, head), "true current": (true_now, head),
            "true next token": (predicted, first_true), "true next tokens": (predicted, true_next),
            "true both": (true_now, true_next)}


def baseline_config(trace, batch: int, fraction: float, timing: sim.Timing,
                    benchmark: str = "perfect_predictions") -> dict:
    """One configuration's baselines, Belady and bound for any policy: the fields every row of it shares (`row`),
    with what `policy_rows` replays against (`replay`, `workload`, `capacity`, `best_ms`, `best_rate`, `belady`)."""
    replay = trace.rebatch(batch)
    workload = sim.Workload.from_trace(replay)
    capacity = sim.capacity_from_fraction(fraction, trace.num_layers, trace.num_experts)
    baselines = {name: sim.simulate(workload, name, capacity, timing) for name in BASELINES}
    fastest = min(BASELINES, key=lambda n: baselines[n].modeled_ms_per_token)
    best_hit = max(BASELINES, key=lambda n: baselines[n].hit_rate)
    best_ms, best_rate = baselines[fastest].modeled_ms_per_token, baselines[best_hit].hit_rate
    belady = sim.simulate(workload, "belady", capacity).loads
    bound = sim.lower_bound_ms_per_token(workload, capacity, timing, waves=True)
    row = {"benchmark": benchmark, "batch": batch, "cache_fraction": fraction,
           "capacity_slots": capacity, "best_baseline_time": fastest, "best_baseline_ms_per_token": best_ms,
           "best_baseline_hit_rate": best_hit, "best_baseline_hits": baselines[best_hit].hits,
           "lower_bound_waves_vs_best_baseline": round(bound / best_ms, 4), "belady_loads": belady,
           "loads_lower_bound": sim.loads_lower_bound(workload, capacity)}
    return {"row": row, "replay": replay, "workload": workload, "capacity": capacity, "best_ms": best_ms,
            "best_rate": best_rate, "belady": belady}


def policy_rows(trace, base: dict, given: dict[str, tuple], timing: sim.Timing,
                profiles: dict[str, dict] = PROFILES, extra: dict | None = None, build=None) -> list[dict]:
    """Every (source, profile) of `given` (from `sources`) and `profiles` replayed in the configuration `base`
    (from `baseline_config`), as rows (with the fields of `extra`), each printed as it is made. `build(capacity,
    options)` makes the policy when given (default: the registered `expertflow` with those options)."""
    batch, fraction = base["row"]["batch"], base["row"]["cache_fraction"]
    capacity, best_ms, belady = base["capacity"], base["best_ms"], base["belady"]
    rows = []
    for source, pair in given.items():
        step_probs = sim.step_predictions(base["replay"], *pair)
        for profile, options in profiles.items():
            policy = (build(capacity, options) if build is not None
                      else make_policy("expertflow", capacity, trace.num_layers, trace.num_experts, **options))
            r = sim.simulate(base["workload"], policy, capacity, timing, predictions=step_probs)
            figures = {"time_vs_best_baseline": r.modeled_ms_per_token / best_ms,
                       "hit_rate_gain": r.hit_rate - base["best_rate"],
                       "on_demand_share_of_needs": r.on_demand_loads / max(r.needs, 1),
                       "loads_vs_belady": r.loads / max(belady, 1)}
            reached = met(dict(figures, batch=batch, cache_fraction=fraction))  # before rounding
            row = dict(base["row"], **(extra or {}), source=source, profile=profile, policy_kwargs=options,
                       **{k: round(v, 4) for k, v in figures.items()},
                       modeled_ms_per_token=r.modeled_ms_per_token, needs=r.needs, hits=r.hits, loads=r.loads,
                       on_demand_loads=r.on_demand_loads, prefetches=r.prefetches, waves=r.waves,
                       targets_met=reached, all_targets_met=len(reached) == len(targets(batch, fraction)))
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def by_profile(rows: list[dict], batches, fractions, profiles):
    """(label "batch B, F cached, P", batch, fraction, that group's rows) for each configuration and profile, in that
    order; rows without those fields (other parts of a run) belong to none."""
    for batch in batches:
        for fraction in fractions:
            for profile in profiles:
                mine = [r for r in rows if (r.get("batch"), r.get("cache_fraction"), r.get("profile"))
                        == (batch, fraction, profile)]
                yield f"batch {batch}, {fraction:g} cached, {profile}", batch, fraction, mine


def run_config(trace, given: dict[str, tuple], batch: int, fraction: float, timing: sim.Timing) -> list[dict]:
    """One configuration: the baselines, Belady and the bound for any policy, then every (source, profile) of
    `given` (from `sources`)."""
    return policy_rows(trace, baseline_config(trace, batch, fraction, timing), given, timing)


def plot(rows: list[dict], path: str) -> None:
    """Hit-rate gain against on-demand share, one panel per configuration: a colour per source, a marker per
    profile; the region where the targets on those two hold is shaded, points that also meet the time target are
    filled."""
    from matplotlib.figure import Figure  # no pyplot: renders with Agg, no display needed

    configs = sorted({(r["batch"], -r["cache_fraction"]) for r in rows})
    columns = min(2, len(configs))
    lines = (len(configs) + columns - 1) // columns
    fig = Figure(figsize=(5.2 * columns, 4.2 * lines), layout="constrained")
    axes = fig.subplots(lines, columns, squeeze=False).ravel()
    markers = dict(zip(PROFILES, "os^"))
    for ax, (batch, negative) in zip(axes, configs):
        fraction = -negative
        mine = [r for r in rows if (r["batch"], r["cache_fraction"]) == (batch, fraction)]
        limit = targets(batch, fraction)
        right = max(100 * r["on_demand_share_of_needs"] for r in mine) * 1.05 + 1
        gains = [r["hit_rate_gain"] for r in mine] + [limit["hit_rate_gain"]]
        pad = 0.08 * (max(gains) - min(gains)) + 0.005
        ax.set_ylim(min(gains) - pad, max(gains) + pad)
        share = limit.get("on_demand_share_of_needs")
        ax.axhspan(limit["hit_rate_gain"], max(gains) + pad, xmin=0,
                   xmax=1.0 if share is None else min(1.0, 100 * share / right), color="tab:green", alpha=0.12)
        for i, source in enumerate(SOURCES):
            for profile, marker in markers.items():
                for r in (r for r in mine if (r["source"], r["profile"]) == (source, profile)):
                    fast = "time_vs_best_baseline" in r["targets_met"]
                    ax.plot(100 * r["on_demand_share_of_needs"], r["hit_rate_gain"], marker, color=f"C{i}",
                            markerfacecolor=f"C{i}" if fast else "white", markersize=6,
                            markeredgecolor="black" if r["all_targets_met"] else f"C{i}")
        ax.set_xlim(0, right)
        ax.set_title(f"batch {batch}, {fraction:.0%} cached", fontsize=10)
        ax.set_xlabel("on-demand loads, % of needs")
        ax.set_ylabel("hit rate - best baseline's")
    for ax in axes[len(configs):]:
        ax.set_visible(False)
    for i, source in enumerate(SOURCES):  # legend entries: colours for sources, then shapes for profiles
        axes[0].plot([], [], "o", color=f"C{i}", label=source)
    for profile, marker in markers.items():
        axes[0].plot([], [], marker, color="gray", markerfacecolor="white", label=f"profile: {profile}")
    axes[0].fill_between([], [], color="tab:green", alpha=0.12, label="hit-rate (and, 50% cached, on-demand) "
                         "targets met")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="outside lower center", ncol=5)
    fig.suptitle("expertflow with the predictor's output replaced by the true routes (filled: meets the time target; "
                 "black edge: every target met)", fontsize=10)
    fig.savefig(path, dpi=120)


def check_head(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse a predictor without the next-token head (parser.error) before anything is measured or recorded."""
    from expertflow.predictor import default_predictor_path, load_predictor

    name = f"--predictor {args.predictor}" if args.predictor else "the shipped predictor"
    try:
        has_head = load_predictor(args.predictor or default_predictor_path()).has_next_head
    except (ValueError, OSError) as exc:
        parser.error(f"{name}: {exc}")
    if not has_head:
        parser.error(f"{name} has no next-token head; add one with `expertflow predictor fit-next`, since the "
                     "sources replace the head's guesses")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_source_arguments(parser)
    add_plot_arguments(parser, "hit-rate gain against on-demand share")
    args = parse_or_redraw(parser, plot, "perfect_predictions", PLOTTED)
    if args is None:
        return
    check_head(parser, args)
    trace, probs, timing = prepare(args, parser)
    given = sources(trace, probs)
    rows = []
    for batch in args.batches:
        for fraction in args.fractions:
            rows += run_config(trace, given, batch, fraction, timing)
    if args.plot:
        plot(rows, args.plot)
    summary = {}
    for batch in args.batches:
        for fraction in args.fractions:
            mine = [r for r in rows if (r["batch"], r["cache_fraction"]) == (batch, fraction)]
            summary[f"batch {batch}, {fraction:g} cached"] = {
                "targets": targets(batch, fraction),
                "all_met_by": [[r["source"], r["profile"]] for r in mine if r["all_targets_met"]],
                "targets_met": {f"{r['source']}, {r['profile']}": r["targets_met"] for r in mine}}
    source = source_config(args, profiles=PROFILES)
    print(json.dumps({"benchmark": "perfect_predictions_summary", "config": source, "tokens": trace.num_tokens,
                      "timing": timing_fields(timing),
                      "summary": summary}))


if __name__ == "__main__":
    main()
