"""The usage scripts in examples/ run as their docstrings say and print what the unwrapped model generates."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from expertflow.models import tiny_moe

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "offload_generate.py"


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(EXAMPLE), *argv], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def unwrapped_text() -> str:
    model = tiny_moe(dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model.name_or_path)
    out = model.generate(**tokenizer(["Once upon a time"], return_tensors="pt"), max_new_tokens=24, do_sample=False)
    return tokenizer.decode(out[0], skip_special_tokens=True)


@pytest.mark.parametrize("argv", [(), ("--slots", "1", "--policy", "expertflow")])
def test_offload_generate_prints_the_unwrapped_text_and_its_statistics(argv, unwrapped_text):
    done = _run(*argv)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.rstrip("\n").split("\n")
    assert "\n".join(lines[:-1]) == unwrapped_text
    assert lines[-1].startswith("hit rate 0.") and " expert loads, " in lines[-1] and lines[-1].endswith(" MB copied")


def test_offload_generate_refuses_no_slots():
    done = _run("--slots", "0")
    assert done.returncode == 2 and done.stdout == ""
    assert "--slots 0 must be at least 1" in done.stderr
