"""Timed simulation of the predictive cache engine against the baseline policies and the lower bound.

Records the built-in tiny MoE over the held-out prompts of all five task families (or reads --trace), predicts the
routes with the route predictor (default: the shipped one), measures the model's compute per layer on this machine,
sets the transfer time of one expert to `--ratio` x one layer's compute at batch 1, and replays the trace at batch 1
and at batch 16 (`rebatch`) with caches of 50% and 25% of the experts. Prints one JSON object per configuration,
then a summary object. Hit rates are timed (a prefetch counts only once its copy has landed); `untimed_hit_rates`
replays the prefetching policies once more in counting mode, where every prefetch lands at once. Beside the
baselines (not among them), `lru-layer-waves` (benchmarks/lru_layer_waves.py): the per-layer cache run the way
mixtral-offloading runs it, a layer's experts in waves inside its own share, which the request model the other
policies are held to does not allow; and beside `belady`, `belady-waves` (benchmarks/belady_waves.py), its rule
allowed to serve a request in waves: an offline reference outside that model (not a limit, see its module).

Compute model: a request (one layer of one step) computes for layer_ms + token_ms x tokens in the step; both are
fitted from decode steps of the unoffloaded model at batch 1 and batch 16, measured alternately five times (per layer
= median step time / layers; token_ms from the median of the paired differences). Measured anew in every run, they
vary from run to run on a shared machine by enough to move batch-16 figures in the third decimal; `--compute-from`
reuses those of an earlier run's output instead.

Usage: python benchmarks/ece_sim.py [--trace T [--split S] | --temperature T --max-new-tokens 32 --unseen-only]
                                   [--predictor DIR]
                                   [--ratio 8] [--fractions 0.5,0.25] [--batches 1,16] [--policy-kwargs JSON]
                                   [--compute-from JSONL] [--plot PNG]
       (or: --from-results JSONL --plot PNG, to redraw)
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os

import torch

from expertflow import sim
from expertflow.commands import batch_sizes, check_exists, check_plot_file, check_positive, comma_separated
from expertflow.policy import Policy, make_policy
from expertflow.policy.base import policy_class
from belady_waves import NAME as _ORACLE_WAVES_NAME  # registers the plug-in policy
from lru_layer_waves import NAME as _WAVES_NAME  # registers the plug-in policy

assert (_WAVES_NAME, _ORACLE_WAVES_NAME) == ("lru-layer-waves", "belady-waves")

BASELINES = ("lru", "lru-layer", "lfu", "lookahead", "prev-step")
# reported beside the baselines, not among them: it leaves the request model the others are held to (see its module)
WAVES = "lru-layer-waves"
ORACLE_WAVES = "belady-waves"  # the offline reference with waves (not a proven optimum, see its module)


def measure_compute(model, tokenizer, layers: int) -> tuple[float, float]:
    """(layer_ms, token_ms) per MoE layer, fitted from median decode steps at batch 1 and batch 16."""
    from expertflow.demo import fit_layer_compute

    inputs = dict(tokenizer(["The quick brown fox jumps over the lazy dog."] * 16, return_tensors="pt"))
    batch1_ms, token_ms = fit_layer_compute(model, inputs, layers)
    return batch1_ms - token_ms, token_ms


def record_heldout(model, tokenizer, max_new_tokens: int, temperature: float | None = None,
                   unseen_only: bool = False):
    """The held-out prompts recorded as the benchmarks replay them; `unseen_only`: without those whose text is also a
    train prompt (one, see expertflow/assets/prompts/README.md), named on stderr."""
    import sys

    from expertflow.models import load_prompts
    from expertflow.recorder import record

    rows = load_prompts(split="test")
    if unseen_only:
        seen = {r["prompt"].strip() for r in load_prompts(split="train")}
        repeats = [r["id"] for r in rows if r["prompt"].strip() in seen]
        rows = [r for r in rows if r["prompt"].strip() not in seen]
        print(f"--unseen-only: leaving out {len(repeats)} held-out prompt(s) whose text is also a train prompt "
              f"({', '.join(repeats) or 'none'}); {len(rows)} left", file=sys.stderr)
    return record(model, [r["prompt"] for r in rows], tokenizer, batch_size=16, max_new_tokens=max_new_tokens,
                  max_prompt_tokens=128, model_name="tiny-moe", temperature=temperature)  # progress on stderr


def _prefetches(name: str) -> bool:
    return policy_class(name).prefetches is not Policy.prefetches


def run_config(trace, probs, batch: int, fraction: float, timing: sim.Timing, policy_kwargs: dict) -> dict:
    replay = trace.rebatch(batch)
    workload = sim.Workload.from_trace(replay)
    step_probs = sim.step_predictions(replay, *sim.prediction_pair(probs))
    capacity = sim.capacity_from_fraction(fraction, trace.num_layers, trace.num_experts)
    def replay_ours(timing_or_none):
        policy = make_policy("expertflow", capacity, trace.num_layers, trace.num_experts, **policy_kwargs)
        return sim.simulate(workload, policy, capacity, timing_or_none, predictions=step_probs)

    results = {name: sim.simulate(workload, name, capacity, timing)
               for name in BASELINES + ("belady", WAVES, ORACLE_WAVES)}
    results["expertflow"] = replay_ours(timing)
    # untimed (counting mode): every prefetch lands at once, as on a link much faster than compute; demand-only
    # policies hit exactly as in timed mode, so only the prefetching ones are replayed again
    untimed = {name: (sim.simulate(workload, name, capacity, None).hit_rate if _prefetches(name)
                      else results[name].hit_rate) for name in BASELINES + ("belady",)}
    untimed["expertflow"] = replay_ours(None).hit_rate
    lower = sim.lower_bound_ms_per_token(workload, capacity, timing, results["belady"].loads)
    fewest = sim.loads_lower_bound(workload, capacity)
    lower_waves = sim.lower_bound_ms_per_token(workload, capacity, timing, waves=True)
    fastest = min(BASELINES, key=lambda n: results[n].modeled_ms_per_token)
    best_hit = max(BASELINES, key=lambda n: results[n].hit_rate)
    ours = results["expertflow"]
    best_untimed = max(BASELINES, key=lambda n: untimed[n])
    return {
        "benchmark": "ece_sim", "batch": batch, "cache_fraction": fraction, "capacity_slots": capacity,
        "policies": {n: r.as_dict() for n, r in results.items()},
        "lower_bound_ms_per_token": round(lower, 4),
        "best_baseline_time": fastest, "best_baseline_hit_rate": best_hit,
        "time_vs_best_baseline": round(ours.modeled_ms_per_token / results[fastest].modeled_ms_per_token, 4),
        "hit_rate_gain": round(ours.hit_rate - results[best_hit].hit_rate, 4),
        "untimed_hit_rates": {n: round(v, 4) for n, v in untimed.items()},
        "untimed_hit_rate_gain": round(untimed["expertflow"] - untimed[best_untimed], 4),
        "loads_vs_belady": round(ours.loads / max(results["belady"].loads, 1), 4),
        "on_demand_share_of_needs": round(ours.on_demand_loads / max(ours.needs, 1), 4),
        # used prefetches whose copy had landed when their layer started: the only ones a timed hit rate counts
        "prefetches_landed_before_use": ours.prefetch_hits - ours.late_prefetches,
        "time_vs_lower_bound": round(ours.modeled_ms_per_token / lower, 4),
        # the best time a policy with pinned requests could reach, relative to the fastest baseline (Belady, all hidden)
        "lower_bound_vs_best_baseline": round(lower / results[fastest].modeled_ms_per_token, 4),
        # against the per-layer cache run wave by wave inside each layer's share (outside the request model)
        "time_vs_lru_layer_waves": round(ours.modeled_ms_per_token / results[WAVES].modeled_ms_per_token, 4),
        "hit_rate_vs_lru_layer_waves": round(ours.hit_rate - results[WAVES].hit_rate, 4),
        # Belady's rule allowed to serve in waves (demand loads only), against the fastest baseline and against ours
        "belady_waves_vs_best_baseline": round(results[ORACLE_WAVES].modeled_ms_per_token /
                                               results[fastest].modeled_ms_per_token, 4),
        "time_vs_belady_waves": round(ours.modeled_ms_per_token / results[ORACLE_WAVES].modeled_ms_per_token, 4),
        # the best any policy could do, waves or not: the fewest loads (interval packing, sim.loads_lower_bound)
        # with every transfer hidden behind compute
        "loads_lower_bound": fewest,
        "lower_bound_waves_ms_per_token": round(lower_waves, 4),
        "lower_bound_waves_vs_best_baseline": round(lower_waves / results[fastest].modeled_ms_per_token, 4),
        "time_vs_lower_bound_waves": round(ours.modeled_ms_per_token / lower_waves, 4),
    }


def _fractions(text: str) -> tuple[float, ...]:
    """argparse type of --fractions: comma-separated cache fractions, each in (0, 1]."""
    return comma_separated(text, float, lambda v: 0 < v <= 1,
                           "give cache fractions in (0, 1], comma-separated, such as 0.5,0.25")


def _policy_kwargs(text: str) -> dict:
    """argparse type of --policy-kwargs: a JSON object of ExpertFlowPolicy's options, tried on a tiny policy."""
    from expertflow.policy.expertflow import ExpertFlowPolicy

    example = """'{"theta": 0.5}'"""

    def not_finite(name: str):
        raise ValueError(f"{name} is not a finite number")

    try:
        kwargs = json.loads(text, parse_constant=not_finite)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON ({exc}); give an object such as {example}") from None
    if not isinstance(kwargs, dict):
        raise argparse.ArgumentTypeError(f"{text!r}: give a JSON object of options, such as {example}")
    known = [n for n in inspect.signature(ExpertFlowPolicy.__init__).parameters
             if n not in ("self", "capacity", "num_layers", "num_experts")]
    unknown = [k for k in kwargs if k not in known]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown option {', '.join(unknown)} of the expertflow policy; known: "
                                         f"{', '.join(known)}")
    try:
        ExpertFlowPolicy(1, 1, 1, **kwargs)
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return kwargs


def check_redraw(args: argparse.Namespace) -> bool:
    """--plot / --from-results (ValueError naming the flag); True when the run only redraws a previous output."""
    if args.plot:
        args.plot = check_plot_file(args.plot, inputs=(args.from_results,) if args.from_results else ())
    if not args.from_results:
        return False
    if not args.plot:
        raise ValueError("--from-results only draws a plot: add --plot FILE.png")
    if not os.path.isfile(args.from_results):
        raise ValueError(f"--from-results {args.from_results}: no such file")
    return True


PLOTTED = ("batch", "cache_fraction", "policies", "best_baseline_time", "lower_bound_vs_best_baseline")


def read_rows(path: str, benchmark: str = "ece_sim", required: tuple[str, ...] = PLOTTED) -> list[dict]:
    """The `benchmark` rows of a previous run's JSON-lines output (ValueError naming the file when it has none, or
    when a row lacks one of the `required` keys)."""
    rows = []
    with open(path, encoding="utf-8", errors="replace") as f:  # not text: no line parses, the error below says so
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                raise ValueError(f"--from-results {path}: line {number} is not JSON; give the JSON-lines output of "
                                 f"benchmarks/{benchmark}.py") from None
            if isinstance(row, dict) and row.get("benchmark") == benchmark:
                missing = [key for key in required if key not in row]
                if missing:
                    raise ValueError(f"--from-results {path}: line {number} lacks {', '.join(missing)}; give the "
                                     f"output of benchmarks/{benchmark}.py")
                rows.append(row)
    if not rows:
        raise ValueError(f"--from-results {path} has no {benchmark!r} rows; give the output of "
                         f"benchmarks/{benchmark}.py")
    return rows


def read_compute(path: str) -> tuple[float, float]:
    """(layer_ms, token_ms) measured by a previous run: the first `timing` object of its JSON-lines output (ece_sim.py
    rows, ece_frontier.py and perfect_predictions.py summaries), as recorded there (to 4 and 5 decimals). Only the
    compute is reused: the link still follows --ratio. ValueError naming the file when it has none, or an unusable
    one."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                timing = row.get("timing") if isinstance(row, dict) else None
                if not isinstance(timing, dict):
                    continue
                values = [timing.get(k) for k in ("layer_ms", "token_ms")]
                if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                           for v in values) or values[0] <= 0 or values[1] < 0:
                    raise ValueError(f"--compute-from {path}: its first 'timing' object {json.dumps(timing)} does "
                                     "not give layer_ms > 0 and token_ms >= 0; give the output of "
                                     "benchmarks/ece_sim.py, ece_frontier.py or perfect_predictions.py")
                return float(values[0]), float(values[1])
    except OSError as exc:
        raise ValueError(f"--compute-from {path}: {exc.strerror or exc}") from None
    raise ValueError(f"--compute-from {path} holds no measured compute (a 'timing' object with layer_ms and "
                     "token_ms); give the output of benchmarks/ece_sim.py, ece_frontier.py or perfect_predictions.py")


def compute_model(args: argparse.Namespace, model, tokenizer, layers: int) -> tuple[float, float]:
    """(layer_ms, token_ms): the earlier run's with --compute-from (so that the two runs share one compute model),
    else measured now."""
    if args.compute_from:
        return read_compute(args.compute_from)
    return measure_compute(model, tokenizer, layers)


def check_trace_source(args: argparse.Namespace) -> None:
    """--trace [--split] or recording (--max-new-tokens, --temperature), not both (ValueError naming the flag)."""
    check_positive(args.max_new_tokens, "--max-new-tokens", integer=True)
    if args.temperature is not None:
        from expertflow.recorder import check_sampling

        check_sampling(args.temperature, 1.0, 0, flags=True)
    check_exists("--trace", args.trace)
    if args.split and not args.trace:
        raise ValueError("--split chooses among the traces of --trace DIR: add --trace")
    if args.trace:
        given = [f for f, v in (("--max-new-tokens", args.max_new_tokens), ("--temperature", args.temperature),
                                ("--unseen-only", getattr(args, "unseen_only", False) or None)) if v is not None]
        if given:
            raise ValueError(f"{' and '.join(given)}: only used when recording, not with --trace; drop one or the "
                             "other")


def given_flags(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str] | None = None) -> list[str]:
    """The flags of `args` given on the command line (`argv`, default sys.argv[1:]), whatever their values (one given
    its default value too), in the parser's order: `argv` parsed again over a namespace where every flag is unset."""
    unset = object()
    probe = parser.parse_args(argv, namespace=argparse.Namespace(**{dest: unset for dest in vars(args)}))
    return ["--" + dest.replace("_", "-") for dest, value in vars(probe).items() if value is not unset]


def refuse_ignored(ignored: list[str]) -> None:
    """ValueError naming `ignored`, the run flags given with --from-results (which only redraws), if there are any."""
    if ignored:
        one = len(ignored) == 1
        raise ValueError(f"{', '.join(ignored)} {'is' if one else 'are'} not used with --from-results, which only "
                         f"redraws the plot from that file: drop {'it' if one else 'them'}, or drop "
                         "--from-results to run")


def check_args(args: argparse.Namespace, given: list[str] | tuple[str, ...] = ()) -> None:
    """Refuse, before any work, what would fail or be ignored later (ValueError naming the flag). `given`: the flags
    given on the command line (`given_flags`); with --from-results, which only redraws, every one but --plot and
    --from-results would be ignored (so is --compute-from however it was set)."""
    if check_redraw(args):
        ignored = [flag for flag in given if flag not in ("--plot", "--from-results")]
        if getattr(args, "compute_from", None) and "--compute-from" not in ignored:
            ignored.insert(0, "--compute-from")
        refuse_ignored(ignored)
        return
    check_positive(args.ratio, "--ratio")
    check_exists("--predictor", args.predictor)
    check_trace_source(args)
    if args.compute_from:
        read_compute(args.compute_from)


def plot(rows: list[dict], path: str) -> None:
    """Modeled time per token of every policy relative to the fastest baseline, one group per configuration, with
    the lower bounds (the best a policy with pinned requests could do, dashed; the best any could, dotted) as lines
    across each group."""
    from matplotlib.figure import Figure  # no pyplot: renders with Agg, no display needed

    names = BASELINES + ("expertflow", "belady", WAVES, ORACLE_WAVES)  # the oracles: demand loads only
    fig = Figure(figsize=(10, 4.8), layout="constrained")
    ax = fig.subplots()
    width = 0.8 / len(names)
    for g, row in enumerate(rows):
        best = row["policies"][row["best_baseline_time"]]["modeled_ms_per_token"]
        for i, name in enumerate(names):
            if name not in row["policies"]:  # results written before the waves variant was reported
                continue
            value = row["policies"][name]["modeled_ms_per_token"] / best
            label = None if g else {"belady": "belady (oracle)", WAVES: f"{WAVES} (waves in a layer's share)",
                                    ORACLE_WAVES: f"{ORACLE_WAVES} (oracle with waves)"}.get(name, name)
            bar = ax.bar(g - 0.4 + (i + 0.5) * width, value, width, color=f"C{i}", label=label,
                         edgecolor="black" if name == "expertflow" else None,
                         hatch="//" if name in (WAVES, ORACLE_WAVES) else None)
            if name == "expertflow":
                ax.bar_label(bar, fmt="%.3f", fontsize=8)
        ax.hlines(row["lower_bound_vs_best_baseline"], g - 0.45, g + 0.45, colors="black", linestyles="--",
                  label="lower bound, pinned requests" if g == 0 else None)
        if "lower_bound_waves_vs_best_baseline" in row:  # results written before it was reported lack it
            ax.hlines(row["lower_bound_waves_vs_best_baseline"], g - 0.45, g + 0.45, colors="black",
                      linestyles=":", label="lower bound, any policy (waves too)" if g == 0 else None)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(range(len(rows)), [f"batch {r['batch']}, {r['cache_fraction']:.0%} cached" for r in rows])
    ax.set_ylabel("modeled time per token / fastest baseline")
    ratio = rows[0].get("timing", {}).get("transfer_over_layer_compute") if rows else None
    ratio = "?" if ratio is None else f"{ratio:g}"
    ax.set_title(f"Timed simulation, one expert transfer = {ratio} x one layer's compute (lower is faster)")
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, ncol=5, fontsize=8, loc="outside lower center")  # beside the bars, never over them
    ax.set_ylim(0, max(1.6, ax.get_ylim()[1]))
    fig.savefig(path, dpi=120)


def prepare(args: argparse.Namespace, parser: argparse.ArgumentParser):
    """(trace, predictions, timing) from --trace/--split or a recording of the held-out prompts, --predictor and
    --ratio; a predictor or trace that does not fit is refused (parser.error) before the measuring and recording."""
    from transformers import AutoTokenizer

    from expertflow.models import tiny_moe
    from expertflow.predictor import default_predictor_path, load_predictor
    from expertflow.predictor.data import load_traces
    from expertflow.predictor.evaluate import check_fits, predict_trace

    model = tiny_moe(dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model.name_or_path)
    layers = model.config.num_hidden_layers
    try:
        predictor = load_predictor(args.predictor or default_predictor_path())
    except (ValueError, OSError) as exc:
        parser.error(f"--predictor {args.predictor}: {exc}" if args.predictor else str(exc))
    try:
        trace = load_traces([args.trace], split=args.split) if args.trace else None
    except (ValueError, OSError) as exc:
        parser.error(f"--trace {args.trace}: {exc}")
    try:
        if trace is not None:
            check_fits(predictor, trace)
        elif (predictor.config.num_layers, predictor.config.num_experts) != (layers, model.config.num_local_experts):
            raise ValueError(f"--predictor {args.predictor}: it predicts {predictor.config.num_layers} layers x "
                             f"{predictor.config.num_experts} experts, not the built-in model's {layers} x "
                             f"{model.config.num_local_experts}")
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    layer_ms, token_ms = compute_model(args, model, tokenizer, layers)
    timing = sim.Timing(transfer_ms=args.ratio * (layer_ms + token_ms), layer_ms=layer_ms, token_ms=token_ms)
    if trace is None:
        trace = record_heldout(model, tokenizer, args.max_new_tokens or 32, args.temperature, args.unseen_only)
    probs = predict_trace(predictor, trace, with_next=predictor.has_next_head)  # (tokens', next tokens')
    return trace, probs, timing


def redraw(parser: argparse.ArgumentParser, args: argparse.Namespace, draw, benchmark: str = "ece_sim",
           required: tuple[str, ...] = PLOTTED) -> None:
    """--from-results: draw --plot from a previous run's `benchmark` rows; a file that is not such output ends in
    one line naming it (parser.error), never a traceback."""
    try:
        rows = read_rows(args.from_results, benchmark, required)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        draw(rows, args.plot)
    except (KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError) as exc:  # rows with the keys but
        # not the shapes or values of this script's output (a field null or zero)
        parser.error(f"--from-results {args.from_results}: cannot draw it ({exc!r}); give the output of "
                     f"benchmarks/{benchmark}.py")


def add_source_arguments(parser: argparse.ArgumentParser, trace: bool = True) -> None:
    """The flags that `prepare` and `check_args` read: trace or recording, predictor, link ratio, configurations.
    `trace=False`: no --trace or --split (the benchmark always records the held-out prompts; both stay None)."""
    if trace:
        parser.add_argument("--trace", help="reuse a recorded trace (a file, or a directory of them) instead of "
                            "recording the held-out prompts")
        parser.add_argument("--split", help="with --trace: only traces whose metadata 'split' is this")
    else:
        parser.set_defaults(trace=None, split=None)
    parser.add_argument("--predictor", help="route predictor directory (default: the shipped one)")
    parser.add_argument("--ratio", type=float, default=8.0, help="expert transfer time / layer compute at batch 1")
    parser.add_argument("--fractions", type=_fractions, default="0.5,0.25", help="cache fractions, each in (0, 1]")
    parser.add_argument("--batches", type=batch_sizes, default="1,16", help="replay batch sizes")
    parser.add_argument("--max-new-tokens", type=int, help="tokens generated per prompt when recording (default 32)")
    parser.add_argument("--temperature", type=float,
                        help="record sampling at this temperature (seed 0) instead of greedily")
    parser.add_argument("--unseen-only", action="store_true",
                        help="record only the held-out prompts whose text is not also a train prompt (leaves out "
                        "one repeated question; the figures shipped are measured with it)")
    parser.add_argument("--compute-from", metavar="JSONL",
                        help="reuse the compute per layer and per token measured by a previous run (the output of "
                        "this or a sibling benchmark) instead of measuring it again, so that the two runs share one "
                        "compute model (the link still follows --ratio)")


def add_plot_arguments(parser: argparse.ArgumentParser, what: str) -> None:
    """--plot PNG (also draw `what`) and --from-results JSONL (only redraw a previous run's output)."""
    parser.add_argument("--plot", metavar="PNG", help=f"also draw {what}")
    parser.add_argument("--from-results", metavar="JSONL", help="only draw --plot from a previous run's output")


def parse_or_redraw(parser: argparse.ArgumentParser, draw, benchmark: str = "ece_sim",
                    required: tuple[str, ...] = PLOTTED) -> argparse.Namespace | None:
    """Parse and check the arguments (one-line errors); with --from-results, redraw and return None."""
    args = parser.parse_args()
    try:
        check_args(args, given_flags(parser, args) if args.from_results else ())
    except ValueError as exc:
        parser.error(str(exc))
    if args.from_results:
        redraw(parser, args, draw, benchmark, required)
        return None
    return args


def source_config(args: argparse.Namespace, **extra) -> dict:
    """Where a run's trace, predictions and compute came from, for its summary line."""
    return {"trace": args.trace, "split": args.split, "predictor": args.predictor or "shipped",
            "recorded": None if args.trace else {"max_new_tokens": args.max_new_tokens or 32,
                                                 "temperature": args.temperature,
                                                 **({"unseen_only": True} if args.unseen_only else {})},
            "ratio": args.ratio, "compute_from": args.compute_from, **extra}


def timing_fields(timing: sim.Timing) -> dict:
    """The compute model as reported (and read back by --compute-from)."""
    return {"transfer_ms": round(timing.transfer_ms, 4), "layer_ms": round(timing.layer_ms, 4),
            "token_ms": round(timing.token_ms, 5)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_source_arguments(parser)
    parser.add_argument("--policy-kwargs", type=_policy_kwargs, default="{}",
                        help="JSON options for the expertflow policy")
    add_plot_arguments(parser, "modeled time per configuration and policy")
    args = parse_or_redraw(parser, plot)
    if args is None:
        return

    trace, probs, timing = prepare(args, parser)
    rows = []
    for batch in args.batches:
        for fraction in args.fractions:
            row = run_config(trace, probs, batch, fraction, timing, args.policy_kwargs)
            row["timing"] = dict(timing_fields(timing), transfer_over_layer_compute=args.ratio,
                                 note="modeled time; compute " + (f"from {args.compute_from}" if args.compute_from
                                                                  else "measured on this CPU"))
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.plot:
        plot(rows, args.plot)
    summary_keys = ("batch", "cache_fraction", "time_vs_best_baseline", "hit_rate_gain", "untimed_hit_rate_gain",
                    "loads_vs_belady", "on_demand_share_of_needs", "prefetches_landed_before_use",
                    "time_vs_lower_bound", "lower_bound_vs_best_baseline", "time_vs_lru_layer_waves",
                    "hit_rate_vs_lru_layer_waves", "belady_waves_vs_best_baseline", "time_vs_belady_waves",
                    "lower_bound_waves_vs_best_baseline", "time_vs_lower_bound_waves")
    source = source_config(args, policy_kwargs=args.policy_kwargs)
    print(json.dumps({"benchmark": "ece_sim_summary", "config": source, "tokens": trace.num_tokens,
                      "sequences": len(set(trace.seq_ids.tolist())),
                      "rows": [{k: r[k] for k in summary_keys} for r in rows]}))

if __name__ == "__main__":
    main()
