"""Live, side by side: tokens/s of every cache policy on the built-in tiny MoE, CPU device with an emulated link.

One run of the unoffloaded model measures one layer's compute at batch 1; the emulated link is then set so that one
expert's copy takes `--ratio` x that (8 by default: Mixtral-8x7B fp16 over PCIe 4.0 at batch 1). Each policy
generates the same batch of held-out prompts with the same cache size; tokens must equal the unoffloaded run. The
`expertflow` run is also recorded, and the recorded trace is replayed by the simulator in timed mode with the same
capacity and timing, to compare the live hit rate with the modeled one. `lru-layer-waves` (the per-layer cache run
in waves inside each layer's share, benchmarks/lru_layer_waves.py) runs too and is reported beside the baselines,
not among them. Prints one JSON document.

Timings are "CPU, emulated link": the CPU computes, a copy thread moves bytes at the emulated bandwidth. With
`--device cuda` the link is the real one (pinned host memory to the GPU, no emulation, `--ratio` unused): the report
gives the measured copy time of one expert and its ratio to one layer's compute instead.
Usage: python benchmarks/ece_live.py [--batch 16] [--fraction 0.5] [--ratio 8] [--max-new-tokens 32] [--device cpu]
                                     [--plot PNG]      (or: --from-results JSON --plot PNG, to redraw only)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import sys
import time

import torch

import expertflow
from expertflow import sim
from expertflow.commands import check_exists, check_fraction, check_positive, check_tokenizer
from expertflow.config import POLICIES
from expertflow.demo import MAX_TRANSFER_RATIO, check_predictor_fits, fit_layer_compute, load_demo_model
from expertflow.policy import make_policy
from expertflow.recorder import RouteRecorder, _assemble, stop_ids
from ece_sim import _policy_kwargs, given_flags
from lru_layer_waves import NAME as WAVES  # registers the plug-in: reported beside the baselines, not among them

KNOWN = POLICIES + (WAVES,)


def _generate(model, inputs, new_tokens):
    start = time.perf_counter()
    out = model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    return out, time.perf_counter() - start


def live_run(model, inputs, reference, policy, slots, link, new_tokens, record: bool, predictor=None, device="cpu",
             options: dict | None = None):
    """One wrapped generation; `link` is the emulated bandwidth in bytes/s (None: the device's real link);
    `options` go to the `expertflow` policy."""
    expertflow.wrap(model, cache_slots=slots, policy=policy, device=device,
                    link_bandwidth=None if link is None else f"{link:.3f}B/s",
                    predictor=predictor if policy == "expertflow" else None,
                    policy_options=(options or None) if policy == "expertflow" else None)
    try:
        recorder = RouteRecorder(model)
        busy_before = expertflow.stats(model).link_busy_s or 0.0  # nothing is copied before the first forward
        if record:
            with recorder:
                out, seconds = _generate(model, inputs, new_tokens)
        else:
            out, seconds = _generate(model, inputs, new_tokens)
        stats = expertflow.stats(model).copy()
    finally:
        expertflow.unwrap(model)
    generated = (out.shape[1] - inputs["input_ids"].shape[1]) * out.shape[0]
    row = {"policy": policy, "tokens_per_s": round(generated / seconds, 3), "seconds": round(seconds, 3),
           "hit_rate": round(stats.hit_rate, 4), "loads": stats.loads, "on_demand_loads": stats.on_demand_loads,
           "prefetches": stats.prefetches,
           "prefetch_precision": round(stats.prefetch_precision, 4) if stats.prefetches else None,
           "on_demand_rate": round(stats.on_demand_rate, 4), "stall_s": round(stats.stall_s, 3),
           # seconds the link copied during the generation, and their share of its wall time (None on CUDA)
           "link_busy_s": None if stats.link_busy_s is None else round(stats.link_busy_s - busy_before, 3),
           "link_busy_share": None if stats.link_busy_s is None else round((stats.link_busy_s - busy_before)
                                                                          / seconds, 4),
           "waves": stats.waves,  # times a layer call was split (experts beyond the free slots, or WAVE)
           "predictor_ms_per_step": round(1000 * stats.predictor_s / max(stats.steps, 1), 3),
           "same_tokens_as_full": bool(torch.equal(out.cpu(), reference.cpu()))}
    return row, (recorder if record else None), out, stats.slots_per_layer


def _cuda_copy_ms(nbytes: int, repeats: int = 20) -> float:
    """Median milliseconds of one expert-sized copy from pinned host memory to the GPU."""
    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(repeats + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times[2:])[repeats // 2]


def _policies(text: str) -> list[str]:
    """argparse type of --policies: comma-separated names from expertflow.config.POLICIES and lru-layer-waves."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in KNOWN]
    if not names or unknown:
        what = f"unknown policy {', '.join(unknown)}" if unknown else f"{text!r} names no policy"
        raise argparse.ArgumentTypeError(f"{what}; choose from {', '.join(KNOWN)}, comma-separated")
    return list(dict.fromkeys(names))


def _check(args: argparse.Namespace, given: list[str] | tuple[str, ...] = ()) -> None:
    """Refuse, before any work, what would fail or be ignored later (ValueError naming the flag). `given`: the flags
    given on the command line (`ece_sim.given_flags`); a redraw (--from-results) reads none but --plot."""
    from ece_sim import check_redraw, refuse_ignored

    if check_redraw(args):
        refuse_ignored([flag for flag in given if flag not in ("--plot", "--from-results")])
        return
    if args.plot and set(args.policies) == {WAVES}:  # `plot` draws expertflow and the best baseline only
        raise ValueError(f"--plot draws the slots of expertflow and of the best baseline, and --policies {WAVES} runs "
                         "neither: add one of them to --policies, or drop --plot")
    check_positive(args.batch, "--batch", integer=True)
    check_positive(args.max_new_tokens, "--max-new-tokens", integer=True)
    check_positive(args.ratio, "--ratio")
    if args.ratio > MAX_TRANSFER_RATIO:
        raise ValueError(f"--ratio {args.ratio:g} must be at most {MAX_TRANSFER_RATIO:g} (one expert copy as long as "
                         "that many layers' compute; 8 stands for Mixtral-8x7B over PCIe 4.0)")
    check_fraction(args.fraction, "--fraction")
    check_exists("--model", args.model)
    check_exists("--predictor", args.predictor)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible to PyTorch here (use --device cpu)")
    if args.model:
        check_tokenizer("--model", args.model)
    if args.predictor is not None and "expertflow" not in args.policies:  # a run that never read it
        raise ValueError(f"--predictor {args.predictor} is read only by the expertflow policy, and --policies leaves "
                         "it out: add expertflow to --policies, or drop --predictor")


def _check_predictor(model, args: argparse.Namespace) -> None:
    """A predictor that cannot drive `expertflow` on this model is refused before the long runs (ValueError)."""
    if "expertflow" not in args.policies:
        return
    if args.model and args.predictor is None:  # the shipped predictor belongs to the built-in model
        raise ValueError("policy expertflow with --model needs --predictor DIR, a route predictor trained on that "
                         "model's traces; or leave expertflow out of --policies")
    check_predictor_fits(model, args.policies, args.predictor, args.device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=16, help="prompts generated together (default: %(default)s)")
    parser.add_argument("--fraction", type=float, default=0.5,
                        help="share of the experts cached, in (0, 1] (default: %(default)s)")
    parser.add_argument("--ratio", type=float, default=8.0,
                        help="expert transfer time / layer compute at batch 1 (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=32,
                        help="tokens generated per prompt (default: %(default)s)")
    parser.add_argument("--policies", type=_policies, default=",".join(KNOWN),
                        help=f"comma-separated, from {', '.join(KNOWN)} (default: all)")
    parser.add_argument("--policy-kwargs", type=_policy_kwargs, default="{}",
                        help='JSON options for the expertflow policy, e.g. \'{"waves": true}\'')
    parser.add_argument("--model", help="model directory (default: the built-in tiny MoE)")
    parser.add_argument("--predictor", help="route predictor directory (default: the shipped one)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="cpu: emulated link (default); cuda: the GPU and its real host link")
    parser.add_argument("--plot", metavar="PNG", help="also draw the slots each layer holds over time")
    parser.add_argument("--from-results", metavar="JSON", help="only draw --plot from a previous run's output")
    args = parser.parse_args()
    try:
        _check(args, given_flags(parser, args))
    except ValueError as exc:
        parser.error(str(exc))
    if args.from_results:
        with open(args.from_results) as f:
            try:
                report = json.load(f)
            except ValueError:
                report = None
        if not isinstance(report, dict) or report.get("benchmark") != "ece_live":
            parser.error(f"--from-results {args.from_results} is not the output of benchmarks/ece_live.py")
        try:
            plot(report, args.plot)
        except (KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError) as exc:  # a damaged report
            parser.error(f"--from-results {args.from_results}: cannot draw it ({exc!r}); give the whole output of "
                         "benchmarks/ece_live.py, from a run with expertflow or a baseline in its --policies")
        return

    from transformers import AutoTokenizer

    from expertflow.models import load_prompts, tiny_moe
    from expertflow.trace import Trace

    if args.model:
        try:  # as the demo loads it: one line naming --model for a folder that is not a causal LM
            model = load_demo_model(args.model)[0]
        except (OSError, ValueError) as exc:
            parser.error(str(exc))
    else:
        model = tiny_moe(dtype=torch.float32).eval()
    from expertflow.adapters import UnsupportedModelError, find_adapter

    try:
        find_adapter(model)
    except UnsupportedModelError as exc:
        parser.error(f"--model {args.model}: {exc}")
    try:
        _check_predictor(model, args)
    except ValueError as exc:
        parser.error(str(exc))
    tokenizer = AutoTokenizer.from_pretrained(model.name_or_path)
    tokenizer.padding_side = "left"
    rows = load_prompts(split="test")
    prompts = [rows[i * len(rows) // args.batch]["prompt"] for i in range(args.batch)]  # spread over the tasks
    inputs = dict(tokenizer(prompts, return_tensors="pt", padding=True, truncation=True, max_length=128,
                            return_attention_mask=True))
    moe_layers = find_adapter(model)[1]  # not config fields: families name them differently, some have dense layers
    layers, num_experts = len(moe_layers), max(layer.num_experts for layer in moe_layers)
    slot_bytes = max(layer.layout.nbytes for layer in moe_layers)
    full = copy.deepcopy(model).to(args.device)  # the unoffloaded model on the device
    if args.device == "cuda":
        inputs = {k: v.cuda() for k, v in inputs.items()}
    layer_ms, token_ms = fit_layer_compute(full, inputs, layers)
    reference, full_s = _generate(full, inputs, args.max_new_tokens)
    del full
    slots = sim.capacity_from_fraction(args.fraction, layers, num_experts)  # as the simulator sizes it
    if args.device == "cuda":
        transfer_ms, link = _cuda_copy_ms(slot_bytes), None
    else:
        transfer_ms = args.ratio * layer_ms
        link = slot_bytes / (transfer_ms / 1000)
    results, slots_per_layer, trace = {}, {}, None
    for policy in args.policies:
        row, recorder, out, occupancy = live_run(model, inputs, reference, policy, slots, link, args.max_new_tokens,
                                                 record=policy == "expertflow", predictor=args.predictor,
                                                 device=args.device, options=args.policy_kwargs)
        results[policy] = row
        slots_per_layer[policy] = occupancy
        if recorder is not None:
            part = _assemble(recorder.per_step(), inputs["input_ids"].cpu(), inputs["attention_mask"].cpu(), out.cpu(),
                             stop_ids(model), 0, 0)
            trace = Trace(experts=part["experts"], num_experts=num_experts,
                          token_ids=part["token_ids"], seq_ids=part["seq_ids"], positions=part["positions"],
                          steps=part["steps"], phase=part["phase"],
                          model=os.path.abspath(args.model) if args.model else "tiny-moe")
    baselines = [p for p in results if p not in ("expertflow", WAVES)]
    note = "CPU, emulated link" if args.device == "cpu" else f"CUDA ({torch.cuda.get_device_name()}), real link"
    report = {"benchmark": "ece_live", "timing_note": note, "policy_kwargs": args.policy_kwargs, "batch": args.batch,
              "cache_fraction": args.fraction, "cache_slots": slots, "new_tokens_per_sequence": args.max_new_tokens,
              "layer_compute_ms_batch1": round(layer_ms, 4), "token_ms_per_layer": round(token_ms, 5),
              "transfer_ms": round(transfer_ms, 4), "transfer_over_layer_compute": round(transfer_ms / layer_ms, 3),
              "emulated_link_MB_per_s": None if link is None else round(link / 1e6, 3),
              "full_model_tokens_per_s": round(reference[:, inputs["input_ids"].shape[1]:].numel() / full_s, 3),
              "policies": results}
    if "expertflow" in results and baselines:
        best = max(baselines, key=lambda p: results[p]["tokens_per_s"])
        report["baselines_compared"] = baselines
        report["best_baseline"] = best
        report["speedup_vs_best_baseline"] = round(results["expertflow"]["tokens_per_s"] /
                                                   results[best]["tokens_per_s"], 4)
    if "expertflow" in results and WAVES in results:  # the per-layer cache run in waves (outside the request model)
        report["speedup_vs_lru_layer_waves"] = round(results["expertflow"]["tokens_per_s"] /
                                                     results[WAVES]["tokens_per_s"], 4)
    if trace is not None:
        from expertflow.predictor import default_predictor_path, load_predictor
        from expertflow.predictor.evaluate import predict_trace

        timing = sim.Timing(transfer_ms=transfer_ms, layer_ms=max(layer_ms - token_ms, 0.0), token_ms=token_ms)
        predictor = load_predictor(args.predictor or default_predictor_path())
        probs = predict_trace(predictor, trace, with_next=predictor.has_next_head)
        ours = make_policy("expertflow", slots, trace.num_layers, trace.num_experts, **args.policy_kwargs)
        modeled = sim.simulate(trace, ours, slots, timing, predictions=probs)
        report["simulated_expertflow_hit_rate"] = round(modeled.hit_rate, 4)
        report["live_minus_simulated_hit_rate"] = round(results["expertflow"]["hit_rate"] - modeled.hit_rate, 4)
        # the link's busy share in the replay, beside the live one (the replay has no host work between steps)
        report["simulated_expertflow_link_busy_share"] = round(modeled.link_busy_share, 4)
    report["slots_per_layer"] = slots_per_layer  # resident experts of each layer at the start of every step
    print(_dumps(report))
    if args.plot:
        plot(report, args.plot)
    differ = [p for p, row in results.items() if not row["same_tokens_as_full"]]
    if differ:
        sys.exit(f"ece_live: the tokens of {', '.join(differ)} differ from the unoffloaded model's")


def _dumps(report: dict) -> str:
    """Indented JSON with each innermost list of numbers on one line."""
    text = json.dumps(report, indent=2)
    return re.sub(r"\[\s+([-\d.,\s]+?)\s+\]", lambda m: "[" + " ".join(m.group(1).split()) + "]", text)


def plot(report: dict, path: str) -> None:
    """Slots held by each layer at the start of every step (stacked), for `expertflow` and the best baseline, or
    whichever of the two ran (without `expertflow`: the baseline with the most tokens/s)."""
    from matplotlib.figure import Figure  # no pyplot: renders with Agg, no display needed

    ran = report["slots_per_layer"]
    best = report.get("best_baseline") or max((p for p in ran if p not in ("expertflow", WAVES)), default=None,
                                              key=lambda p: report["policies"][p]["tokens_per_s"])
    names = [p for p in (best, "expertflow") if p in ran]
    if not names:
        raise ValueError(f"the report has no run of expertflow or of a baseline (ran: {', '.join(ran) or 'none'})")
    fig = Figure(figsize=(10, 3.6), layout="constrained")
    axes = fig.subplots(1, len(names), sharey=True, squeeze=False)[0]
    for ax, name in zip(axes, names):
        history = report["slots_per_layer"][name]  # [steps][layers]
        layers = list(zip(*history)) if history else []
        ax.stackplot(range(len(history)), *layers, labels=[f"layer {i}" for i in range(len(layers))])
        ax.set_ylim(0, report["cache_slots"])
        row = report["policies"][name]
        ax.set_title(f"{name}: {row['tokens_per_s']:g} tok/s, hit rate {row['hit_rate']:.3f}", fontsize=10)
        ax.set_xlabel("step (0 = prefill)")
    axes[0].set_ylabel(f"slots held (of {report['cache_slots']})")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles[::-1], labels[::-1], fontsize=8, loc="outside right upper")
    fig.suptitle(f"Slots per layer over time, live ({report['timing_note']}), batch {report['batch']}", fontsize=11)
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
