"""`expertflow simulate`: replay a trace against cache policies and report hits, loads and modeled time.

Owns: argument parsing, the readable table, the JSON document and the cache-size sweep plot. Does not know: the
simulation semantics (`expertflow.sim`) or the trace format (`expertflow.trace`).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from typing import Any

from expertflow.commands import check_fraction, check_plot_file, check_positive, import_plugins, joined

__all__ = ["register", "SWEEP_FRACTIONS"]

log = logging.getLogger(__name__)

SWEEP_FRACTIONS = (1 / 16, 1 / 8, 1 / 4, 3 / 8, 1 / 2, 5 / 8, 3 / 4, 7 / 8, 1.0)
_TIMING_FLAGS = ("link_gbps", "expert_mb", "layer_ms")


class _OneTrace(argparse.Action):
    """--trace given twice is an error: argparse would replay the last one alone, where `predictor` commands read
    every --trace."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest, None) is not None:
            parser.error(f"{option_string} given twice ({getattr(namespace, self.dest)} and {values}): simulate "
                         "replays one trace; run it once per trace")
        setattr(namespace, self.dest, values)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `simulate` to the top-level `expertflow` parser."""
    p = subparsers.add_parser("simulate", help="trace-driven simulation of the expert cache",
                              description="Replay a routing trace against cache policies (counting mode, or timed "
                                          "mode when --link-gbps, --expert-mb and --layer-ms are given).")
    p.add_argument("--trace", required=True, action=_OneTrace, metavar="TRACE", help="a trace file (.safetensors)")
    p.add_argument("--policy", required=True, action="append", metavar="P[,P...]",
                   help="comma-separated policy names (several --policy join): lru, lru-layer, lfu, lookahead, "
                        "prev-step, expertflow, belady (Belady's eviction: fewest loads of any policy that keeps each "
                        "request's experts pinned, with no waves and no slot hand-off), or ones a --plugin registers")
    p.add_argument("--plugin", action="append", metavar="MODULE",
                   help="import a module (or a .py file) that registers policies with @register_policy first; "
                        "may be repeated")
    size = p.add_mutually_exclusive_group(required=True)
    size.add_argument("--slots", type=int, metavar="N", help="cache capacity in expert slots, all layers together "
                                                              "(more than layers x experts is taken as that)")
    size.add_argument("--cache-fraction", type=float, metavar="F", help="capacity as a fraction of all L x E experts")
    p.add_argument("--predictor", metavar="DIR",
                   help="trained route predictor, for policies that use one (default: the shipped one for traces "
                        "of the built-in tiny MoE)")
    p.add_argument("--rebatch", type=int, metavar="B", help="replay B sequences at a time as one batch")
    p.add_argument("--link-gbps", type=float, metavar="G", help="timed mode: link bandwidth in GB/s (1e9 bytes/s)")
    p.add_argument("--expert-mb", type=float, metavar="M", help="timed mode: bytes of one expert, in MB (1e6)")
    p.add_argument("--layer-ms", type=float, metavar="T",
                   help="timed mode: fixed compute of one (step, MoE layer) request, ms; a request computes for "
                        "T + U x the step's tokens")
    p.add_argument("--token-ms", type=float, metavar="U",
                   help="timed mode: compute per token of the step at each MoE layer, ms (default 0)")
    p.add_argument("--plot", metavar="FILE",
                   help="also draw hit rate and loads/token against cache size; format from the extension (.png, "
                        ".svg, .pdf; none: .png)")
    p.add_argument("--json", action="store_true", help="print exactly one JSON document")
    p.set_defaults(func=_simulate)


def _simulate(args: argparse.Namespace) -> int:
    from expertflow import sim
    from expertflow.trace import Trace

    try:
        import_plugins(args.plugin)
        policies = _policies(joined(args.policy))
        _check_predictor_used(args.predictor, policies)
        timing = _timing(args)
        check_positive(args.rebatch, "--rebatch", integer=True)
        if args.cache_fraction is not None:
            check_fraction(args.cache_fraction, "--cache-fraction")
        else:
            check_positive(args.slots, "--slots", integer=True)
        if args.plot:
            args.plot = check_plot_file(args.plot, inputs=(args.trace,))
        trace = Trace.load(args.trace)
        if args.rebatch is not None:
            trace = trace.rebatch(args.rebatch)
        capacity = _capacity(args, trace)
        predictor = _predictor(args.predictor, policies, trace)
        predictions = _predictions(predictor, trace, policies)
        report = sim.simulate_policies(trace, policies, capacity, timing, predictor, predictions)
        if timing is not None and not _finite(report):
            compute = f"--layer-ms {args.layer_ms}" + ("" if args.token_ms is None else f", --token-ms {args.token_ms}")
            raise ValueError(f"the modeled times overflow (no finite result) with one expert's transfer taking "
                             f"{timing.transfer_ms:g} ms (--expert-mb {args.expert_mb} over --link-gbps "
                             f"{args.link_gbps}) and {compute}; give transfer and compute times of sane size")
    except (ValueError, OSError) as exc:
        print(f"expertflow simulate: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report))
    else:
        print(_table(report, trace, args.rebatch))
    if args.plot:  # after the report: the sweep is the slow part, and a plot that fails must not lose the results
        sys.stdout.flush()
        try:
            _plot(args.plot, trace, policies, capacity, timing, predictor, predictions, args.rebatch)
        except (ValueError, OSError) as exc:
            print(f"expertflow simulate: error: {exc}", file=sys.stderr)
            return 2
    return 0


def _policies(text: str) -> list[str]:
    from expertflow.policy import policy_names

    names = [n.strip() for n in text.split(",") if n.strip()]
    known = policy_names()
    unknown = [n for n in names if n not in known]
    if not names or unknown:
        raise ValueError(f"--policy: unknown policy {', '.join(unknown) or repr(text)}; known policies: "
                         f"{', '.join(known)} (your own: --plugin MODULE, which registers them)")
    return list(dict.fromkeys(names))


def _timing(args: argparse.Namespace) -> Any:
    from expertflow.sim import Timing

    given = [f for f in _TIMING_FLAGS if getattr(args, f) is not None]
    if not given:
        if args.token_ms is not None:
            raise ValueError("--token-ms applies to timed mode: give --link-gbps, --expert-mb and --layer-ms too")
        return None
    if len(given) < len(_TIMING_FLAGS):
        missing = ", ".join("--" + f.replace("_", "-") for f in _TIMING_FLAGS if f not in given)
        raise ValueError(f"timed mode needs --link-gbps, --expert-mb and --layer-ms; missing {missing}")
    check_positive(args.link_gbps, "--link-gbps")
    check_positive(args.expert_mb, "--expert-mb")
    check_positive(args.layer_ms, "--layer-ms", zero=True)  # 0: compute is --token-ms × tokens alone
    check_positive(args.token_ms, "--token-ms", zero=True)
    transfer_ms = args.expert_mb * 1e6 / (args.link_gbps * 1e9) * 1e3
    if not (math.isfinite(transfer_ms) and transfer_ms > 0):
        raise ValueError(f"--expert-mb {args.expert_mb} over --link-gbps {args.link_gbps} gives one expert's transfer "
                         f"time {transfer_ms} ms, not a time above 0 that a float holds; give values of sane size")
    return Timing.from_link(args.link_gbps, args.expert_mb, args.layer_ms, args.token_ms or 0.0)


def _capacity(args: argparse.Namespace, trace: Any) -> int:
    from expertflow.sim import capacity_from_fraction

    if args.cache_fraction is not None:
        return capacity_from_fraction(args.cache_fraction, trace.num_layers, trace.num_experts)
    return min(args.slots, trace.num_layers * trace.num_experts)


def _wants_predictions(name: str) -> bool:
    from expertflow.policy.base import policy_class

    return bool(getattr(policy_class(name), "wants_predictions", False))


def _predictions(predictor: Any, trace: Any, policies: list[str]) -> Any:
    """Per-token predicted probabilities [N, L, E] for policies driven by the predictor (one pass over the trace),
    paired with the next-token head's when the predictor has one."""
    if predictor is None or not any(_wants_predictions(p) for p in policies):
        return None
    from expertflow.predictor.evaluate import predict_trace

    return predict_trace(predictor, trace, with_next=predictor.has_next_head)


def _check_predictor_used(path: str | None, policies: list[str]) -> None:
    """A --predictor that no chosen policy reads is refused, as `demo` refuses it: a report that never used it would
    look like its test."""
    if path is not None and not any(_wants_predictions(p) for p in policies):
        from expertflow.policy import policy_names

        readers = [n for n in policy_names() if _wants_predictions(n)]
        raise ValueError(f"--predictor {path} is read only by predictive policies ({', '.join(readers)}), and "
                         f"--policy {','.join(policies)} leaves them out: add one to --policy, or drop --predictor")


def _predictor(path: str | None, policies: list[str], trace: Any) -> Any:
    wanting = [p for p in policies if _wants_predictions(p)]
    if not wanting:
        return None
    if not path:
        path = _shipped_predictor_for(trace)
    if not path:
        raise ValueError(f"policy {', '.join(wanting)} needs a route predictor: pass --predictor DIR (train one "
                         "with `expertflow predictor train`)")
    try:
        from expertflow.predictor import load_predictor
    except ImportError as exc:
        raise ValueError(f"--predictor {path}: this installation cannot load route predictors ({exc})") from exc
    return load_predictor(path)


def _shipped_predictor_for(trace: Any) -> str | None:
    """The shipped predictor's directory when `trace` was recorded from the built-in tiny MoE (by its path's last
    parts: traces keep the path of the machine that recorded them; or by its short name, as the benchmarks store it),
    else None."""
    from pathlib import Path

    from expertflow.models import TINY_MOE_NAME, tiny_moe_path
    from expertflow.predictor import default_predictor_path

    recorded = Path(str(trace.model or "")).parts[-3:]
    built_in = recorded == tiny_moe_path().parts[-3:] or str(trace.model) == TINY_MOE_NAME
    if not built_in or not default_predictor_path().exists():
        return None
    log.info("using the shipped route predictor %s for this trace of the built-in model", default_predictor_path())
    return str(default_predictor_path())


def _finite(value: Any) -> bool:
    """Every number in a report is finite (JSON has no Infinity or NaN)."""
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return all(_finite(v) for v in value)
    return not isinstance(value, float) or math.isfinite(value)


def _batching(trace: Any, rebatch: int | None) -> str:
    """How the trace was replayed, for the report's first line and the plot's title: empty as recorded."""
    import numpy as np

    if rebatch is None:
        return ""
    sequences = len(np.unique(trace.seq_ids))
    if rebatch < sequences:
        together = "one sequence at a time" if rebatch == 1 else f"{rebatch} sequences at a time"
    else:
        together = "its one sequence" if sequences == 1 else f"all {sequences} sequences at once"
    return f" in {len(np.unique(trace.steps))} steps ({together}, --rebatch {rebatch})"


def _table(report: dict[str, Any], trace: Any, rebatch: int | None = None) -> str:
    timed = "lower_bound_ms_per_token" in report
    width = max(12, *(len(name) + 2 for name in report["policies"]))  # a plug-in's name may be long
    head = f"{'policy':<{width}}{'hit rate':>9}{'hits':>9}{'needs':>9}{'loads':>9}{'on-demand':>10}{'prefetch':>9}" \
           f"{'wasted':>8}" + (f"{'ms/token':>11}{'stall ms':>12}" if timed else "")
    lines = [f"{trace.model}: {trace.num_tokens} tokens{_batching(trace, rebatch)}, capacity "
             f"{report['capacity_slots']} of {trace.num_layers * trace.num_experts} expert slots", head]
    for name, r in report["policies"].items():
        row = f"{name:<{width}}{r['hit_rate']:>9.3f}{r['hits']:>9}{r['needs']:>9}{r['loads']:>9}" \
              f"{r['on_demand_loads']:>10}{r['prefetches']:>9}{r['wasted_prefetches']:>8}"
        if timed:
            row += f"{r['modeled_ms_per_token']:>11.2f}{r['stall_ms']:>12.1f}"
        lines.append(row)
    if timed:
        caveat = "" if report["lower_bound_holds"] else "; not a bound here: a request needs more experts than " \
            "the cache holds"
        lines.append(f"lower bound for pinned requests (Belady's loads, transfers hidden behind compute{caveat}): "
                     f"{report['lower_bound_ms_per_token']:.2f} ms/token")
        lines.append(f"lower bound with waves (no policy goes below): "
                     f"{report['lower_bound_waves_ms_per_token']:.2f} ms/token")
    return "\n".join(lines)


_TITLE_CHARS = 72  # of a model name (a path, for a saved model's trace) in the plot's title: the end of a longer one


def _plot(path: str, trace: Any, policies: list[str], capacity: int, timing: Any, predictor: Any,
          predictions: Any = None, rebatch: int | None = None) -> None:
    from matplotlib.figure import Figure  # no pyplot: renders with Agg, no display needed

    from expertflow import sim

    workload = sim.Workload.from_trace(trace)
    step_probs = sim.step_predictions(trace, *sim.prediction_pair(predictions)) if predictions is not None else None
    total = trace.num_layers * trace.num_experts
    sizes = sorted({sim.capacity_from_fraction(f, trace.num_layers, trace.num_experts) for f in SWEEP_FRACTIONS})
    fig = Figure(figsize=(10, 4), layout="constrained")
    hit_ax, load_ax = fig.subplots(1, 2)
    fractions = [c / total for c in sizes]
    for i, name in enumerate(policies):
        results = [sim.simulate(workload, name, c, timing, predictor, step_probs) for c in sizes]
        style = {"marker": "os^vD<>p"[i % 8], "linestyle": ("-", "--", ":", "-.")[i % 4], "label": name}
        hit_ax.plot(fractions, [r.hit_rate for r in results], **style)
        load_ax.plot(fractions, [r.loads / max(trace.num_tokens, 1) for r in results], **style)
    for ax, label in ((hit_ax, "hit rate"), (load_ax, "expert loads per token")):
        ax.axvline(capacity / total, color="grey", linestyle="--", linewidth=1)
        ax.set_xlabel(f"cache size (fraction of {total} experts)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    hit_ax.legend()
    mode = "timed" if timing is not None else "counting"
    model = trace.model if len(trace.model) <= _TITLE_CHARS else "…" + trace.model[1 - _TITLE_CHARS:]
    fig.suptitle(f"{model}\n{trace.num_tokens} tokens{_batching(trace, rebatch)}, {mode} mode")
    try:
        fig.savefig(path, dpi=120)
    except OSError as exc:  # a full disk, or a place that became read-only since the check
        raise OSError(f"--plot {path}: cannot write it ({exc.strerror or exc}); give a writable place with enough "
                      "space") from None
    print(f"wrote {path}", file=sys.stderr)
