"""The models and prompt sets that ship inside the package, for the demo, the benchmarks and the tests.

Owns: where the shipped assets live and how to load them. ``tiny_moe()`` is a small trained Mixtral-style MoE
(6 layers, 32 experts, top-4) whose routing behaves like a large trained model's; its directory also holds the
tokenizer. ``load_prompts()`` reads the chat/translation/summarization/math/code prompt sets with their train/test
split. Does not know how a model is offloaded or served. Imports torch and transformers only when a model is loaded.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from transformers import MixtralForCausalLM

ASSETS = Path(__file__).resolve().parent / "assets"
TASKS = ("chat", "translation", "summarization", "math", "code")
SPLITS = ("train", "test")


TINY_MOE_NAME = "tiny-moe"  # names the shipped tiny MoE where a model directory is asked for (`--model tiny-moe`)


def tiny_moe_path() -> Path:
    """The directory of the shipped tiny MoE: config, bf16 safetensors weights, tokenizer, model card."""
    return ASSETS / TINY_MOE_NAME


def is_tiny_moe(path: str | Path) -> bool:
    """Whether `path` is the shipped tiny MoE's directory (by real path: a link to it counts)."""
    return os.path.realpath(path) == os.path.realpath(tiny_moe_path())


def tiny_moe(dtype: torch.dtype | None = None, device: str | torch.device = "cpu") -> MixtralForCausalLM:
    """Load the shipped tiny MoE (stored in bf16) in ``dtype`` (default float32) on ``device``.

    ``model.name_or_path`` is the model directory, so ``AutoTokenizer.from_pretrained(model.name_or_path)`` finds the
    tokenizer.
    """
    import torch
    from transformers import AutoModelForCausalLM

    path = tiny_moe_path()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no tiny MoE at {path}; reinstall expertflow, or rebuild it with train_tiny_moe.py")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32)
    return model.to(device).eval()


def load_prompts(task: str | None = None, split: str | None = None) -> list[dict]:
    """Prompts as dicts ``{"id", "task", "prompt", "split"}``, in file order.

    ``task`` is one of TASKS (None: all five, in TASKS order); ``split`` is "train", "test" (about a fifth of each
    task, chosen by a hash of the id) or None for both.
    """
    if task is not None and task not in TASKS:
        raise ValueError(f"task={task!r} is not a shipped prompt set; choose one of {TASKS} or None for all")
    if split is not None and split not in SPLITS:
        raise ValueError(f"split={split!r} is not a split; choose 'train', 'test' or None for both")
    rows: list[dict] = []
    for name in TASKS if task is None else (task,):
        with (ASSETS / "prompts" / f"{name}.jsonl").open(encoding="utf-8") as f:
            rows.extend(json.loads(line) for line in f if line.strip())
    return [r for r in rows if split is None or r["split"] == split]
