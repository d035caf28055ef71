"""Time the route predictor where the runtime calls it: one incremental decode step for a batch, and the prefill of a
long prompt. Prints one JSON object.

Usage: python benchmarks/predictor_overhead.py [--predictor DIR] [--batch 16] [--prompt-tokens 512] [--threads 1]
       [--device cpu|cuda]

Decode: a session is prefilled with `--batch` prompts of `--context` tokens, then `--steps` decode steps are timed
one by one (each one token per row, as the runtime calls it); the median and the 90th percentile are reported.
Prefill: `session.prefill` of one prompt of `--prompt-tokens` tokens, median of `--repeats` runs. Targets: decode
step <= 5 ms at batch 16, 512-token prefill <= 50 ms (CPU). With `--device cuda` the predictor runs on the GPU, as
the runtime runs it there, and each timed call ends when its probabilities are on the host (as the runtime needs them).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

from expertflow.commands import check_positive, check_threads
from expertflow.predictor import default_predictor_path, load_predictor

SIZE_FLAGS = ("batch", "context", "steps", "prompt_tokens", "repeats")  # each at least 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--predictor", default=str(default_predictor_path()), metavar="DIR",
                        help="route predictor directory (default: the shipped one)")
    parser.add_argument("--batch", type=int, default=16, help="rows of each timed decode step (default 16)")
    parser.add_argument("--context", type=int, default=128, help="prompt tokens per row before decoding (default 128)")
    parser.add_argument("--steps", type=int, default=64, help="decode steps timed (default 64)")
    parser.add_argument("--prompt-tokens", type=int, default=512,
                        help="tokens of the one prompt whose prefill is timed (default 512)")
    parser.add_argument("--repeats", type=int, default=10, help="timed prefills; the median is reported (default 10)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="where the predictor runs; each timed call ends with its output on the host (default "
                        "cpu)")
    args = parser.parse_args()
    try:
        for flag in SIZE_FLAGS:
            check_positive(getattr(args, flag), "--" + flag.replace("_", "-"), integer=True)
        check_threads(args.threads)
    except ValueError as exc:
        parser.error(str(exc))
    if not os.path.exists(args.predictor):
        parser.error(f"--predictor {args.predictor}: no such directory")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible to PyTorch here (use --device cpu)")
    torch.set_num_threads(args.threads)
    try:
        predictor = load_predictor(args.predictor, args.device)
    except (ValueError, OSError) as exc:
        parser.error(f"--predictor {args.predictor}: {exc}")
    vocab = predictor.config.vocab_size
    gen = torch.Generator().manual_seed(0)

    session = predictor.new_session()
    session.prefill(torch.randint(3, vocab, (args.batch, args.context), generator=gen).to(args.device))
    next_ids = torch.randint(3, vocab, (args.steps + 3, args.batch, 1), generator=gen).to(args.device)
    for i in range(3):  # warm-up
        session.decode(next_ids[i]).cpu()
    decode_ms = []
    for i in range(3, args.steps + 3):
        start = time.perf_counter()
        session.decode(next_ids[i]).cpu()
        decode_ms.append((time.perf_counter() - start) * 1e3)

    prompt = torch.randint(3, vocab, (1, args.prompt_tokens), generator=gen).to(args.device)
    predictor.new_session().prefill(prompt).cpu()  # warm-up
    prefill_ms = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        predictor.new_session().prefill(prompt).cpu()
        prefill_ms.append((time.perf_counter() - start) * 1e3)

    print(json.dumps({
        "benchmark": "predictor_overhead", "predictor": args.predictor, "parameters": predictor.parameters_count(),
        "threads": args.threads,
        "device": args.device if args.device == "cpu" else torch.cuda.get_device_name(),
        "cpu": platform.processor() or platform.machine(), "batch": args.batch, "context_tokens": args.context,
        "decode_step_ms": {"median": round(statistics.median(decode_ms), 3),
                           "p90": round(_p90(decode_ms), 3),
                           "target": 5.0},
        "prefill_tokens": args.prompt_tokens,
        "prefill_ms": {"median": round(statistics.median(prefill_ms), 3), "min": round(min(prefill_ms), 3),
                       "target": 50.0},
    }))


def _p90(values: list[float]) -> float:
    """The 90th percentile, interpolated as the median is (never below it, however few the values)."""
    return statistics.quantiles(values, n=10, method="inclusive")[-1] if len(values) > 1 else values[0]


if __name__ == "__main__":
    main()
