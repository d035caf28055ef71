"""`expertflow trace …`: import routing logs as traces and print trace statistics.

Owns: the `trace` command group and its argument parsing. Does not know: how logs are parsed (`trace_import`) or
how statistics are computed (`Trace.stats`). `trace record` belongs with the recorder; it plugs in through
`add_record_parser` below.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

from expertflow.commands import check_output_file, check_positive, check_tokenizer, note_shadowed_model
from expertflow.errors import first_line, is_bad_model, unreadable_weights
from expertflow.models import TINY_MOE_NAME

__all__ = ["register", "add_record_parser"]

_FIELD_FLAGS = {
    "seq": "sequence (request) id", "token": "token index within the sequence", "layer": "MoE layer index",
    "experts": "list of selected expert ids", "probs": "list of gate probabilities",
    "phase": "prefill/decode marker", "token_id": "vocabulary id of the token",
    "step": "forward-step id (tokens sharing it ran together; without it the log is read as batch size 1)",
    "routing": "per-token rows: list of per-layer entries",
}


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `trace` with its sub-commands to the top-level `expertflow` parser."""
    parser = subparsers.add_parser("trace", help="import, inspect (and record) routing traces",
                                   description="Routing traces: which experts every token chose at every MoE layer.")
    sub = parser.add_subparsers(dest="trace_command", required=True)
    add_import_parser(sub)
    add_stats_parser(sub)
    add_record_parser(sub)


def add_record_parser(sub: argparse._SubParsersAction) -> None:
    """`trace record --model PATH --prompts FILE [--batch-size B] [--max-new-tokens N] --out TRACE`."""
    p = sub.add_parser("record", help="generate over a prompts file and record every token's experts",
                       description="Generate over a prompts JSONL file in batches and save the routing trace.")
    p.add_argument("--model", required=True, metavar="PATH",
                   help="a saved Hugging Face MoE model directory with its tokenizer, or 'tiny-moe' (built-in); "
                        "run in float32, whatever dtype it was saved in")
    p.add_argument("--prompts", required=True, metavar="FILE", help='JSONL: {"id", "task", "prompt"} per line')
    p.add_argument("--task", help="only prompts of this task; stored as the trace's 'task' metadata (so is a task "
                                  "every prompt has), which `predictor train/eval --tasks` select by")
    p.add_argument("--split", help="only prompts whose 'split' field is this (the shipped prompts: train or test); "
                                   "stored as the trace's 'split' metadata (so is a split every prompt has), which "
                                   "`predictor train/eval --split` select by")
    p.add_argument("--limit", type=int, metavar="N", help="only the first N prompts (default: all)")
    p.add_argument("--batch-size", type=int, default=8, metavar="B",
                   help="prompts generated together (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=32, metavar="N",
                   help="tokens generated per prompt (default: %(default)s)")
    p.add_argument("--max-prompt-tokens", type=int, default=256, metavar="N",
                   help="keep only the first N tokens of longer prompts (default: %(default)s)")
    p.add_argument("--temperature", type=float, metavar="T",
                   help="sample with this temperature (at least 1e-6) instead of decoding greedily (the default)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="nucleus sampling with --temperature (default: %(default)s, off)")
    p.add_argument("--seed", type=int, default=0,
                   help="random seed of the sampling with --temperature, 0 to 2**64-1 (default 0)")
    p.add_argument("--out", required=True, metavar="TRACE",
                   help="trace file to write (.safetensors); an existing trace is replaced once the new one is whole, "
                        "another kind of file is refused")
    p.set_defaults(func=_record)


def _record(args: argparse.Namespace) -> int:
    import torch

    from expertflow.recorder import DECODER_ONLY, check_sampling, read_prompts, record

    for flag in ("limit", "batch_size", "max_new_tokens", "max_prompt_tokens"):
        check_positive(getattr(args, flag), "--" + flag.replace("_", "-"), integer=True)
    check_sampling(args.temperature, args.top_p, args.seed, flags=True)
    check_output_file(args.out, inputs=(args.prompts,))
    _check_replaces_a_trace(args.out)
    note_shadowed_model("trace record", args.model)
    if args.model != TINY_MOE_NAME and not os.path.isdir(args.model):
        raise ValueError(f"--model {args.model}: no such directory; give a saved Hugging Face MoE model directory "
                         "(with its tokenizer) or 'tiny-moe'")
    if args.model != TINY_MOE_NAME:
        check_tokenizer("--model", args.model)
    rows = read_prompts(args.prompts, args.task, args.limit, args.split)
    if not rows:
        which = " and".join(f" of {name} {value!r}" for name, value in (("task", args.task), ("split", args.split))
                            if value)
        raise ValueError(f"{args.prompts} has no prompts{which}")
    if args.model == TINY_MOE_NAME:
        from expertflow.models import tiny_moe

        model = tiny_moe(dtype=torch.float32)
    else:
        from safetensors import SafetensorError
        from transformers import AutoModelForCausalLM

        try:
            model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        except SafetensorError as exc:  # a download or copy cut short
            raise unreadable_weights(args.model, exc) from None
        except Exception as exc:
            if not is_bad_model(exc):
                raise
            if _is_encoder_decoder(args.model):  # Switch: no causal LM class, and the recorder refuses it anyway
                raise ValueError(f"--model {args.model}: {DECODER_ONLY} (its config describes an encoder-decoder "
                                 "model); give a decoder-only MoE model directory or 'tiny-moe'") from None
            raise ValueError(f"--model {args.model}: cannot load it as a Hugging Face causal LM ({first_line(exc)}); "
                             "give a saved MoE model directory or 'tiny-moe'") from None
    # An absolute path: a predictor trained from another directory still finds the model's config (vocabulary).
    name = None if args.model == TINY_MOE_NAME else os.path.abspath(args.model)
    trace = record(model.eval(), [r["prompt"] for r in rows], batch_size=args.batch_size, model_name=name,
                   max_new_tokens=args.max_new_tokens, max_prompt_tokens=args.max_prompt_tokens,
                   temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    trace.extra_metadata.update(_shared_fields(rows))
    trace.save(args.out)
    prompts = f"{len(rows)} prompt" + ("s" if len(rows) != 1 else "")
    print(f"recorded {trace.num_tokens} tokens of {prompts} ({trace.num_layers} MoE layers x "
          f"{trace.num_experts} experts, top-{trace.top_k}) to {args.out}", file=sys.stderr)
    return 0


def _check_replaces_a_trace(path: str) -> None:
    """An existing `--out` is replaced only when it is a trace: a slip of the name (a model's model.safetensors, the
    log being imported) must not cost another file."""
    if not os.path.isfile(path) or os.path.getsize(path) == 0:  # an empty one: a placeholder, `mktemp` made
        return
    from safetensors import SafetensorError, safe_open

    from expertflow.trace import FORMAT

    try:
        with safe_open(path, framework="np") as f:
            found = str((f.metadata() or {}).get("format", ""))
    except (SafetensorError, OSError, ValueError):
        found = ""
    if not found.startswith(FORMAT.split("/")[0] + "/"):
        raise ValueError(f"--out {path} exists and is not an expertflow trace; give another file name, or remove "
                         "the file first if it may go")


def _shared_fields(rows: list[dict]) -> dict[str, str]:
    """The prompts' `task` and `split` where all of them have one and the same (as `--task` / `--split` make them),
    stored in the trace's metadata under those names: `predictor train/eval --tasks/--split` select traces by them."""
    shared = {}
    for key in ("task", "split"):
        value = rows[0].get(key) if rows else None
        if isinstance(value, str) and value and all(row.get(key) == value for row in rows):
            shared[key] = value
    return shared


def _is_encoder_decoder(model_dir: str) -> bool:
    """Whether the saved model's config describes an encoder-decoder model: `is_encoder_decoder` as its model type
    implies it (Switch Transformers) or, for a model type this transformers does not know, as config.json gives it;
    False when the config cannot be read."""
    from transformers import AutoConfig

    try:
        return bool(getattr(AutoConfig.from_pretrained(model_dir), "is_encoder_decoder", False))
    except Exception as exc:
        if not is_bad_model(exc):
            raise
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            return json.load(f).get("is_encoder_decoder") is True
    except (OSError, ValueError, AttributeError):
        return False


def add_import_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("import", help="convert per-(token, layer) or per-token JSONL routing logs (vLLM/SGLang "
                                      "shapes) to a trace",
                       description="Read routing logs as they are; field names are inferred unless given.")
    p.add_argument("--format", choices=["jsonl"], default="jsonl", help="log format (default: jsonl)")
    p.add_argument("--input", required=True, nargs="+", action="extend", metavar="FILE",
                   help="log file(s); sequences of different files are kept apart")
    p.add_argument("--out", required=True, metavar="TRACE",
                   help="trace file to write (.safetensors); an existing trace is replaced once the new one is whole, "
                        "another kind of file is refused")
    for role, what in _FIELD_FLAGS.items():
        flag = "--" + role.replace("_", "-") + "-field"
        p.add_argument(flag, dest=f"{role}_field", metavar="NAME", help=f"field holding the {what}")
    p.add_argument("--num-experts", type=int, metavar="E",
                   help="experts per layer (default: from a header, else max id + 1)")
    p.add_argument("--top-k", type=int, metavar="K",
                   help="experts per token (default: from a header, else the most common list length; a longer "
                        "list is refused unless this allows it)")
    p.add_argument("--model", help="model name to store in the trace metadata")
    p.add_argument("--json", action="store_true", help="print a JSON summary of what was written")
    p.set_defaults(func=_import)


def add_stats_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("stats", help="load balance, temporal overlap and batch sparsity of a trace",
                       description="Summary statistics of a trace: tokens and phases, per-layer expert load, how "
                                   "much consecutive tokens' experts overlap, distinct experts per step.")
    p.add_argument("trace", metavar="TRACE", help="a trace file (.safetensors)")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(func=_stats)


def _import(args: argparse.Namespace) -> int:
    from expertflow.trace_import import JsonlFields, import_jsonl

    fields = JsonlFields(**{role: getattr(args, f"{role}_field") for role in _FIELD_FLAGS})
    try:
        check_positive(args.num_experts, "--num-experts", integer=True)
        check_positive(args.top_k, "--top-k", integer=True)
        check_output_file(args.out, inputs=tuple(args.input))
        _check_replaces_a_trace(args.out)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trace = import_jsonl(args.input, fields, num_experts=args.num_experts, top_k=args.top_k,
                                 model=args.model, progress=not args.json)
        for warning in caught:  # in the command's own format, not Python's (file, line, source)
            print(f"expertflow trace import: warning: {warning.message}", file=sys.stderr)
        trace.save(args.out)
    except (ValueError, OSError) as exc:
        return _fail("trace import", exc)
    summary = {"out": args.out, "model": trace.model, "tokens": trace.num_tokens,
               "sequences": int(len(set(trace.seq_ids.tolist()))), "steps": int(len(set(trace.steps.tolist()))),
               "num_layers": trace.num_layers, "num_experts": trace.num_experts, "top_k": trace.top_k}
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"wrote {args.out}: {summary['tokens']} tokens in {summary['sequences']} sequences, "
              f"{summary['steps']} steps, {trace.num_layers} MoE layers x {trace.num_experts} experts, "
              f"top-{trace.top_k}")
    return 0


def _stats(args: argparse.Namespace) -> int:
    from expertflow.trace import Trace

    try:
        stats = Trace.load(args.trace).stats()
    except (ValueError, OSError) as exc:
        return _fail("trace stats", exc)
    if args.json:
        print(json.dumps(stats))
        return 0
    load, overlap, distinct = stats["load_max_over_mean"], stats["temporal_overlap"], stats[
        "distinct_experts_per_step"]
    print(f"model {stats['model']}: {stats['tokens']} tokens ({stats['phases']['prefill']} prefill, "
          f"{stats['phases']['decode']} decode), {stats['sequences']} sequences, {stats['steps']} steps")
    print(f"{stats['num_layers']} MoE layers x {stats['num_experts']} experts, top-{stats['top_k']}, "
          f"{stats['missing_cells']} missing (token, layer) cells")
    print(f"expert load max/mean per layer: median {_figure(load['median'])} (whole trace), "
          f"{_figure(load['per_sequence'])} (within a sequence)")
    if overlap["pairs"] and overlap["mean"] is not None:
        skipped = "; at each layer, pairs with a missing cell left out" if stats["missing_cells"] else ""
        print(f"temporal overlap of consecutive tokens: {overlap['mean']} over {overlap['pairs']} pairs{skipped} "
              f"(chance {stats['top_k'] / stats['num_experts']:.3f})")
    elif overlap["pairs"]:
        print("temporal overlap of consecutive tokens: n/a (every pair of consecutive tokens has a missing cell)")
    else:
        print("temporal overlap of consecutive tokens: none (no sequence has two tokens in a row)")
    print(f"distinct experts per step and layer: {_figure(distinct['mean'])}")
    return 0


def _figure(value: float | None) -> str:
    """A statistic for the text output: "n/a" where the trace leaves it undefined (null in --json)."""
    return "n/a" if value is None else str(value)


def _fail(command: str, exc: BaseException) -> int:
    print(f"expertflow {command}: error: {exc}", file=sys.stderr)
    return 2
