"""`expertflow demo`: the main job on a built-in default model — policies and cache sizes side by side.

Owns: argument parsing and the table / JSON output. Does not know: how runs are measured (`expertflow.demo`).
"""

from __future__ import annotations

import argparse
import json
import os

from expertflow.commands import check_positive, joined, note_shadowed_model

__all__ = ["register"]

_FRACTIONS = "0.25,0.5"  # --cache-fraction's default


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("demo", help="generate with offloaded experts under several policies and cache sizes",
                              description="Generate with a built-in tiny MoE (or --model) with no offloading and "
                                          "with each policy at each cache size; print memory, hit rate, loads and "
                                          "speed side by side. It always runs on the CPU, also where there is a GPU, "
                                          "with host-to-slot copies over an emulated link.")
    p.add_argument("--model", metavar="PATH",
                   help="a saved Hugging Face MoE model directory (default: the built-in one, also named 'tiny-moe')")
    # lists given twice join (argparse would keep the last one alone)
    p.add_argument("--policy", action="append", metavar="P[,P...]",
                   help="policies to compare; 'full' = no offloading (default: full,lru-layer,lru, and expertflow "
                        "when the built-in route predictor is installed, unless --model names another model and no "
                        "--predictor is given)")
    p.add_argument("--cache-fraction", action="append", metavar="F[,F...]",
                   help=f"cache size as a fraction of all experts (default: {_FRACTIONS})")
    p.add_argument("--predictor", metavar="DIR", help="route predictor for the expertflow policy with --model")
    p.add_argument("--max-new-tokens", type=int, default=24, metavar="N",
                   help="tokens generated per prompt (default: %(default)s)")
    p.add_argument("--transfer-ratio", type=float, default=8.0, metavar="R",
                   help="emulated copy time of one expert over one layer's compute (default: %(default)s, "
                        "like Mixtral-8x7B fp16 over PCIe 4.0 at batch 1)")
    p.add_argument("--json", action="store_true", help="print exactly one JSON document")
    p.epilog = "Exit status 1 when a run's tokens differ from the unoffloaded run's, 2 on bad arguments."
    p.set_defaults(func=_demo)


def _demo(args: argparse.Namespace) -> int:
    from expertflow.config import POLICIES
    from expertflow.demo import MAX_TRANSFER_RATIO, check_policies, given_model, run_demo

    note_shadowed_model("demo", args.model)
    policy = joined(args.policy)
    cache_fraction = _FRACTIONS if args.cache_fraction is None else joined(args.cache_fraction)
    policies = None  # the default set, which leaves out `expertflow` for --model without --predictor
    if policy is not None:
        policies = tuple(dict.fromkeys(p.strip() for p in policy.split(",") if p.strip()))  # each run once
        unknown = [p for p in policies if p != "full" and p not in POLICIES]
        if not policies:
            raise ValueError(f"--policy {policy!r} names no policy; give some of full, {', '.join(POLICIES)}")
        if unknown:
            raise ValueError(f"unknown policy {', '.join(unknown)}; choose from full, {', '.join(POLICIES)}")
    try:
        fractions = tuple(dict.fromkeys(float(f) for f in cache_fraction.split(",")))  # each run once
    except ValueError:
        raise ValueError(f"--cache-fraction {cache_fraction!r} must be numbers such as 0.25,0.5") from None
    if any(not 0 < f <= 1 for f in fractions):
        raise ValueError(f"--cache-fraction values must be in (0, 1], got {cache_fraction}")
    check_positive(args.max_new_tokens, "--max-new-tokens", integer=True)
    check_positive(args.transfer_ratio, "--transfer-ratio")
    if args.transfer_ratio > MAX_TRANSFER_RATIO:
        raise ValueError(f"--transfer-ratio {args.transfer_ratio:g} must be at most {MAX_TRANSFER_RATIO:g} (one expert "
                         "copy as long as that many layers' compute; 8 stands for Mixtral-8x7B over PCIe 4.0)")
    if args.predictor is not None and not os.path.isdir(args.predictor):
        missing = "is a file, not a directory" if os.path.exists(args.predictor) else "no such directory"
        raise ValueError(f"--predictor {args.predictor}: {missing}; give a trained predictor directory")
    model = given_model(args.model)  # None: the built-in model, by no --model, by name or by its directory
    if policies is not None:
        check_policies(policies, model, args.predictor)
        _check_predictor_used(policies, args.predictor)
    report = run_demo(model, policies, fractions, args.max_new_tokens, args.transfer_ratio, quiet=args.json,
                      predictor=args.predictor)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(_table(report))
    return 0 if all(run["matches_full"] for run in report["runs"]) else 1


def _table(report: dict) -> str:
    head = (f"model: {report['model']} — {report['moe_layers']} MoE layers, {report['experts']} experts, "
            f"batch {report['batch_size']}, {report['max_new_tokens']} new tokens\n"
            f"timing: CPU, emulated link — one expert copy = {report['transfer_over_compute']:g} x one layer's "
            f"compute ({report['layer_compute_ms']:.2f} ms/layer, link {report['emulated_link_bytes_per_s'] / 1e6:.1f} "
            f"MB/s)\n")
    cols = f"{'policy':<11}{'cache':>7}{'slots':>7}{'device MB':>11}{'of full':>9}{'hit rate':>10}" \
           f"{'on-demand':>11}{'loads/tok':>11}{'tok/s':>9}{'same tokens':>13}"
    lines = [head, cols, "-" * len(cols)]
    for r in report["runs"]:
        cache = "-" if r["cache_fraction"] is None else f"{100 * r['cache_fraction']:.3g}%"  # 0.1%, 12.5%, 25%
        slots = "-" if r["slots"] is None else str(r["slots"])
        hit = "-" if r["hit_rate"] is None else f"{r['hit_rate']:.3f}"
        loads = "-" if r["loads_per_token"] is None else f"{r['loads_per_token']:.2f}"
        demand = "-" if r.get("on_demand_rate") is None else f"{r['on_demand_rate']:.1%}"
        lines.append(f"{r['policy']:<11}{cache:>7}{slots:>7}{r['device_bytes'] / 1e6:>11.2f}"
                     f"{r['device_fraction']:>9.1%}{hit:>10}{demand:>11}{loads:>11}{r['tokens_per_s']:>9.1f}"
                     f"{'yes' if r['matches_full'] else 'NO':>13}")
    return "\n".join(lines)


def _check_predictor_used(policies: tuple[str, ...], predictor: str | None) -> None:
    """A --predictor that no chosen policy reads is refused: a run that never used it would look like its test."""
    from expertflow.demo import predictive

    if predictor is not None and not predictive(policies):
        raise ValueError(f"--predictor {predictor} is read only by the expertflow policy, and --policy "
                         f"{','.join(policies)} leaves it out: add expertflow to --policy, or drop --predictor")
