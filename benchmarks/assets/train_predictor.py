"""Build the route predictor shipped for the tiny MoE, and measure it in-domain and cross-domain.

Owns: the recipe behind ``expertflow/assets/tiny-moe-predictor``: (1) record one trace per (task, split) of the
shipped prompt sets with the shipped tiny MoE (greedy, ``--max-new-tokens``), tagged with ``task``/``split``
metadata; (2) train the in-domain predictor on every task's train split; (3) train the cross-domain predictor on the
train splits of chat + code only; (4) evaluate both on test splits at batch sizes 1, 4, 16, 32 — in-domain: all five
tasks' test prompts; cross-domain: math, translation, summarization test prompts — next to the prev_step,
prev_layer and frequency baselines; (5) write the JSON report and, with ``--ship``, copy the in-domain predictor and
the report into the package. Does not know the network or the metrics (``expertflow.predictor``).

Usage (from the repository root; one CPU thread, as measured: about 20 minutes on the 2-core development CPU):
    python benchmarks/assets/train_predictor.py [--work runs/predictor] [--ship expertflow/assets/tiny-moe-predictor]

Training and evaluation with the command line on the recorded traces (the first gives the cross-domain predictor
bit for bit, on one thread as here):
    expertflow predictor train --trace runs/predictor/traces --split train --tasks chat,code \
        --init-embeddings expertflow/assets/tiny-moe --threads 1 --out runs/xd
    expertflow predictor eval --predictor runs/xd --trace runs/predictor/traces --split test \
        --tasks math,translation,summarization --batch-size 16 --json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import shutil
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from expertflow.models import TASKS, load_prompts, tiny_moe_path
from expertflow.predictor import load_predictor
from expertflow.predictor.data import load_traces
from expertflow.predictor.evaluate import evaluate_batch_sizes
from expertflow.predictor.train import TrainConfig, train, with_overrides
from expertflow.recorder import record
from expertflow.trace import Trace

REPO = Path(__file__).resolve().parents[2]
BATCH_SIZES = (1, 4, 16, 32)
CROSS_TRAIN = ("chat", "code")
CROSS_TEST = ("math", "translation", "summarization")
log = logging.getLogger("train_predictor")


def record_traces(model_dir: Path, out: Path, max_new_tokens: int, batch_size: int) -> dict[str, Path]:
    """One trace per (task, split); an existing file recorded with the same settings and model is reused."""
    model = None
    paths = {}
    weights = model_dir / "model.safetensors"
    settings = {"max_new_tokens": str(max_new_tokens), "model_sha256": hashlib.sha256(weights.read_bytes()).hexdigest()}
    for task in TASKS:
        for split in ("train", "test"):
            path = out / f"{task}-{split}.safetensors"
            paths[f"{task}-{split}"] = path
            if path.is_file() and all(Trace.load(path).extra_metadata.get(k) == v for k, v in settings.items()):
                continue
            if model is None:
                model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
            prompts = [row["prompt"] for row in load_prompts(task, split)]
            trace = record(model, prompts, batch_size=batch_size, max_new_tokens=max_new_tokens,
                           model_name=str(model_dir), progress=False)
            trace.extra_metadata.update(task=task, split=split, **settings)
            trace.save(path)
            log.info("recorded %s: %d tokens", path.name, trace.num_tokens)
    return paths


def _display(path: Path) -> str:
    path = path.resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def _traces(paths: dict[str, Path], tasks: tuple[str, ...], split: str) -> list[Path]:
    return [paths[f"{task}-{split}"] for task in tasks]


def _summary(reports: list[dict]) -> dict:
    """Per batch size: predictor b_acc and recall, the best baseline's b_acc and the margin."""
    out = {}
    for r in reports:
        best = max(r["baselines"], key=lambda name: r["baselines"][name]["b_acc"])
        out[str(r["batch_size"])] = {"b_acc": r["b_acc"], "token_recall_at_k": r["token_recall_at_k"],
                                     "best_baseline": best, "best_baseline_b_acc": r["baselines"][best]["b_acc"],
                                     "margin": round(r["b_acc"] - r["baselines"][best]["b_acc"], 4)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(tiny_moe_path()), help="MoE model directory (default: the tiny MoE)")
    parser.add_argument("--work", default=str(REPO / "runs" / "predictor"), help="traces, predictors, report")
    parser.add_argument("--ship", help="copy the in-domain predictor and the report here "
                                       "(expertflow/assets/tiny-moe-predictor)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--record-batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--epochs", type=int, help="override the default training epochs")
    parser.add_argument("--record-only", action="store_true", help="stop after recording the traces")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    work = Path(args.work)
    start = time.monotonic()
    paths = record_traces(Path(args.model), work / "traces", args.max_new_tokens, args.record_batch)
    if args.record_only:
        return
    config = with_overrides(TrainConfig(), epochs=args.epochs, init_embeddings=str(Path(args.model).resolve()))
    report = {"model": _display(Path(args.model)), "max_new_tokens": args.max_new_tokens,
              "threads": args.threads, "train_config": config.__dict__, "batch_sizes": list(BATCH_SIZES)}
    runs = {"in_domain": (TASKS, TASKS), "cross_domain": (CROSS_TRAIN, CROSS_TEST)}
    for name, (train_tasks, test_tasks) in runs.items():
        train_trace = load_traces(_traces(paths, train_tasks, "train"))
        predictor = train(train_trace, config, out=work / name, progress=False)
        test_trace = load_traces(_traces(paths, test_tasks, "test"))
        reports = evaluate_batch_sizes(load_predictor(work / name), test_trace, BATCH_SIZES)
        report[name] = {"train_tasks": list(train_tasks), "test_tasks": list(test_tasks),
                        "train_tokens": train_trace.num_tokens, "test_tokens": test_trace.num_tokens,
                        "test_decode_tokens": int((test_trace.phase == 1).sum()),
                        "parameters": predictor.parameters_count(),
                        "file_bytes": (work / name / "model.safetensors").stat().st_size,
                        "training": {k: predictor.info[k] for k in ("epochs_run", "best_epoch", "seconds",
                                                                    "best_val_recall_at_k", "stopped_by")},
                        "summary": _summary(reports), "reports": reports}
        log.info("%s: %s", name, json.dumps(report[name]["summary"]))
    report["seconds"] = round(time.monotonic() - start, 1)
    (work / "report.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    if args.ship:
        ship = Path(args.ship)
        if ship.exists():
            shutil.rmtree(ship)
        shutil.copytree(work / "in_domain", ship)
        for name, text in (("config.json", (ship / "config.json").read_text(encoding="utf-8")),
                           ("report.json", json.dumps(report, indent=2) + "\n")):
            (ship / name).write_text(text.replace(f"{REPO}/", ""), encoding="utf-8")  # paths relative to the repo
    print(json.dumps({k: report[k]["summary"] for k in runs} | {"seconds": report["seconds"]}))


if __name__ == "__main__":
    main()
