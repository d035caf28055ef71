"""Which of the cache engine's targets can be met together: the `expertflow` policy's hit-rate gain, on-demand share
and modeled time as its prefetch margin varies, in three profiles, and with the margin steered to on-demand budgets.

The prefetch margin decides how many prefetches are made: a prefetch takes a victim only if that victim is expected
more than `margin` requests later than the prefetched expert. On a link this slow almost no prefetch lands before
its layer starts, so a prefetch does not add a hit; it starts a copy early, and it chooses its victim before the
router has chosen. Fewer prefetches mean more loads decided after routing (on-demand loads) and, with better
victims, more hits. This sweep shows where that trade lands for each configuration of `benchmarks/ece_sim.py` (same
trace, same predictor, same compute model and transfer/compute ratio; compute is measured again in each run unless
--compute-from reuses an earlier run's), for
the default policy (`pinned`), serving in waves (`waves`: `{"waves": true, "wave_gap": 2}`) and serving in waves
deferring prefetches to them (`waves, deferring`: also `"defer_to_waves": true`); beside them serving in waves with
the margin steered to a budget of on-demand loads (`waves, budget`: `{"waves": true, "wave_gap": 2,
"on_demand_target": x}` for each x of --budgets, starting from the default margin); and which settings meet every
target that applies: modeled time ≤ 0.9x the best baseline's at batch 1 and ≤ 0.75x at larger batches (the targets
are set for batch 16), hit rate ≥ 0.15 above the best baseline's, on-demand loads ≤ 10% of needs with half the
experts cached (only at a fraction of 0.5). Beside them, per configuration, the lower bound for any policy
(`expertflow.sim.loads_lower_bound`, every transfer hidden) relative to the best baseline's time. Prints one JSON
object per run (configuration, profile, margin or budget), with the raw counts, then a summary object; which targets
a run meets is decided on unrounded figures.

Usage: python benchmarks/ece_frontier.py [--trace T [--split S] | --temperature T --max-new-tokens 32]
                                        [--predictor DIR] [--ratio 8] [--fractions 0.5,0.25] [--batches 1,16]
                                        [--margins 0,2,4,...] [--budgets 0.05,0.08,0.1] [--compute-from JSONL]
                                        [--plot PNG]
       (or: --from-results JSONL --plot PNG, to redraw)
"""

from __future__ import annotations

import argparse
import json
import math

from expertflow import sim
from expertflow.commands import comma_separated
from expertflow.policy import make_policy
from ece_sim import BASELINES, add_plot_arguments, add_source_arguments, parse_or_redraw, prepare, \
    source_config, timing_fields

PROFILES = {
    "pinned": {},
    "waves": {"waves": True, "wave_gap": 2.0},
    "waves, deferring": {"waves": True, "wave_gap": 2.0, "defer_to_waves": True},
}
DEFAULT_MARGINS = "0,2,4,5,6,8,12,16,24,32"
BUDGET = "waves, budget"  # the margin steered towards a share of needs on demand (on_demand_target)
BUDGET_OPTIONS = {"waves": True, "wave_gap": 2.0}
DEFAULT_BUDGETS = "0.05,0.08,0.1"
PLOTTED = ("batch", "cache_fraction", "profile", "policy_kwargs", "hit_rate_gain", "on_demand_share_of_needs",
           "targets_met")


def _margins(text: str) -> tuple[float, ...]:
    """argparse type of --margins: comma-separated margins in requests, each at least 0."""
    return comma_separated(text, float, lambda v: math.isfinite(v) and v >= 0, "give prefetch margins of at least 0 "
                           f"(requests), comma-separated, such as {DEFAULT_MARGINS}")


def _budgets(text: str) -> tuple[float, ...]:
    """argparse type of --budgets: comma-separated shares of needs on demand, each strictly between 0 and 1."""
    return comma_separated(text, float, lambda v: 0 < v < 1, "give on-demand budgets as shares of needs between 0 "
                           f"and 1, comma-separated, such as {DEFAULT_BUDGETS}")


def settings(margins, budgets) -> list[tuple[str, dict]]:
    """(profile, policy options) of every run of one configuration: each profile at each margin, then the budgets."""
    return ([(profile, dict(options, margin=margin)) for profile, options in PROFILES.items() for margin in margins]
            + [(BUDGET, dict(BUDGET_OPTIONS, on_demand_target=budget)) for budget in budgets])


def label(row: dict) -> str:
    """A run's setting as the plot writes it: its margin in requests, or its on-demand budget in percent."""
    options = row["policy_kwargs"]
    return f"{100 * options['on_demand_target']:g}%" if "on_demand_target" in options else f"{options['margin']:g}"


def targets(batch: int, fraction: float) -> dict[str, float]:
    """The targets that apply to a configuration: upper bounds on time and on-demand share, a lower one on the gain."""
    out = {"time_vs_best_baseline": 0.9 if batch == 1 else 0.75, "hit_rate_gain": 0.15}
    if math.isclose(fraction, 0.5):
        out["on_demand_share_of_needs"] = 0.10
    return out


def met(row: dict) -> list[str]:
    """The targets a row meets."""
    return [name for name, bound in targets(row["batch"], row["cache_fraction"]).items()
            if (row[name] >= bound if name == "hit_rate_gain" else row[name] <= bound)]


def sweep_config(trace, probs, batch: int, fraction: float, timing: sim.Timing, margins, budgets=()) -> list[dict]:
    replay = trace.rebatch(batch)
    workload = sim.Workload.from_trace(replay)
    step_probs = sim.step_predictions(replay, *sim.prediction_pair(probs))
    capacity = sim.capacity_from_fraction(fraction, trace.num_layers, trace.num_experts)
    baselines = {name: sim.simulate(workload, name, capacity, timing) for name in BASELINES}
    fastest = min(BASELINES, key=lambda n: baselines[n].modeled_ms_per_token)
    best_hit = max(BASELINES, key=lambda n: baselines[n].hit_rate)
    best_ms, best_rate = baselines[fastest].modeled_ms_per_token, baselines[best_hit].hit_rate
    belady = sim.simulate(workload, "belady", capacity).loads
    bound = sim.lower_bound_ms_per_token(workload, capacity, timing, waves=True)
    config = {"benchmark": "ece_frontier", "batch": batch, "cache_fraction": fraction, "capacity_slots": capacity,
              "best_baseline_time": fastest, "best_baseline_ms_per_token": best_ms,
              "best_baseline_hit_rate": best_hit, "best_baseline_hits": baselines[best_hit].hits,
              "lower_bound_waves_vs_best_baseline": round(bound / best_ms, 4), "belady_loads": belady}
    rows = []
    for profile, options in settings(margins, budgets):
        policy = make_policy("expertflow", capacity, trace.num_layers, trace.num_experts, **options)
        r = sim.simulate(workload, policy, capacity, timing, predictions=step_probs)
        figures = {"time_vs_best_baseline": r.modeled_ms_per_token / best_ms,
                   "hit_rate_gain": r.hit_rate - best_rate,
                   "on_demand_share_of_needs": r.on_demand_loads / max(r.needs, 1),
                   "loads_vs_belady": r.loads / max(belady, 1)}
        reached = met(dict(figures, batch=batch, cache_fraction=fraction))  # before rounding
        row = dict(config, profile=profile, policy_kwargs=options, **{k: round(v, 4) for k, v in figures.items()},
                   modeled_ms_per_token=r.modeled_ms_per_token, needs=r.needs, hits=r.hits, loads=r.loads,
                   on_demand_loads=r.on_demand_loads, prefetches=r.prefetches, waves=r.waves,
                   targets_met=reached, all_targets_met=len(reached) == len(targets(batch, fraction)))
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def plot(rows: list[dict], path: str) -> None:
    """Hit-rate gain against on-demand share, one panel per configuration, one line per profile through its margins;
    the region where the targets on those two hold is shaded, points that miss the time target are hollow."""
    from matplotlib.figure import Figure  # no pyplot: renders with Agg, no display needed

    configs = sorted({(r["batch"], -r["cache_fraction"]) for r in rows})
    columns = min(2, len(configs))
    fig = Figure(figsize=(5.2 * columns, 4.2 * ((len(configs) + columns - 1) // columns)), layout="constrained")
    axes = fig.subplots((len(configs) + columns - 1) // columns, columns, squeeze=False).ravel()
    for ax, (batch, negative) in zip(axes, configs):
        fraction = -negative
        mine = [r for r in rows if (r["batch"], r["cache_fraction"]) == (batch, fraction)]
        limit = targets(batch, fraction)
        right = max(100 * r["on_demand_share_of_needs"] for r in mine) * 1.05 + 1
        gains = [r["hit_rate_gain"] for r in mine] + [limit["hit_rate_gain"]]
        low, high = min(gains), max(gains)
        pad = 0.08 * (high - low) + 0.005
        ax.set_ylim(low - pad, high + pad)
        on_demand = "on_demand_share_of_needs" in limit
        ax.axhspan(limit["hit_rate_gain"], high + pad, xmin=0,
                   xmax=min(1.0, 100 * limit["on_demand_share_of_needs"] / right) if on_demand else 1.0,
                   color="tab:green", alpha=0.12,
                   label="targets met: hit-rate gain, and on-demand share at 50% cached")
        shown: list[tuple[float, float]] = []  # labelled points of this panel
        few = sum(bool(r.get("all_targets_met")) for r in mine) <= 3  # then each of them gets its label
        for i, profile in enumerate([*PROFILES, BUDGET]):
            points = [r for r in mine if r["profile"] == profile]
            if not points:
                continue
            xs = [100 * r["on_demand_share_of_needs"] for r in points]
            ys = [r["hit_rate_gain"] for r in points]
            budget = profile == BUDGET
            ax.plot(xs, ys, color=f"C{i}", linewidth=1, linestyle="--" if budget else "-", label=profile)
            for r, x, y in sorted(zip(points, xs, ys), key=lambda p: not p[0].get("all_targets_met")):
                fast = "time_vs_best_baseline" in r["targets_met"]  # decided on the unrounded time
                ax.plot(x, y, "*" if budget else "o", color=f"C{i}", markerfacecolor=f"C{i}" if fast else "white",
                        markersize=9 if budget else 5,
                        markeredgecolor="black" if r.get("all_targets_met") else f"C{i}")
                near = any(abs(x - a) < 0.025 * right and abs(y - b) < 0.04 * (high - low + 2 * pad)
                           for a, b in shown)
                if (few and r.get("all_targets_met")) or not near:  # a margin's label only where it can be read
                    ax.annotate(label(r), (x, y), fontsize=6, xytext=(3, 2),
                                textcoords="offset points", fontweight="bold" if r.get("all_targets_met") else None)
                    shown.append((x, y))
        ax.set_xlim(0, right)
        ax.set_title(f"batch {batch}, {fraction:.0%} cached", fontsize=10)
        ax.set_xlabel("on-demand loads, % of needs")
        ax.set_ylabel("hit rate - best baseline's")
    for ax in axes[len(configs):]:
        ax.set_visible(False)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="outside lower center", ncol=4)
    fig.suptitle("Prefetch margin sweep (numbers: margin in requests, or on-demand budget in %, where legible)\n"
                 "hollow: slower than the time target; black edge, bold: every target met", fontsize=10)
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_source_arguments(parser)
    parser.add_argument("--margins", type=_margins, default=DEFAULT_MARGINS, help="prefetch margins to sweep")
    parser.add_argument("--budgets", type=_budgets, default=DEFAULT_BUDGETS,
                        help="on-demand budgets (shares of needs) of the waves profile that steers its margin")
    add_plot_arguments(parser, "hit-rate gain against on-demand share")
    args = parse_or_redraw(parser, plot, "ece_frontier", PLOTTED)
    if args is None:
        return
    trace, probs, timing = prepare(args, parser)
    rows = []
    for batch in args.batches:
        for fraction in args.fractions:
            rows += sweep_config(trace, probs, batch, fraction, timing, args.margins, args.budgets)
    if args.plot:
        plot(rows, args.plot)
    summary = {}
    for batch in args.batches:
        for fraction in args.fractions:
            mine = [r for r in rows if (r["batch"], r["cache_fraction"]) == (batch, fraction)]
            summary[f"batch {batch}, {fraction:g} cached"] = {
                "targets": targets(batch, fraction),
                "lower_bound_waves_vs_best_baseline": mine[0]["lower_bound_waves_vs_best_baseline"],
                "all_met_by": [r["policy_kwargs"] for r in mine if r["all_targets_met"]],
                "fastest": min(mine, key=lambda r: r["modeled_ms_per_token"])["policy_kwargs"],
                "largest_gain": max(mine, key=lambda r: r["hits"])["policy_kwargs"]}
    source = source_config(args, margins=list(args.margins), budgets=list(args.budgets))
    print(json.dumps({"benchmark": "ece_frontier_summary", "config": source, "tokens": trace.num_tokens,
                      "timing": timing_fields(timing),
                      "summary": summary}))


if __name__ == "__main__":
    main()
