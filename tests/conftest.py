import json
import signal
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # tests import the tiny-model factory `families`

from expertflow.policy import base as policy_base  # noqa: E402
from expertflow.trace import Trace  # noqa: E402

# The test models are tiny: one thread is as fast as two, and stays fast when the machine is busy.
torch.set_num_threads(1)


@pytest.fixture
def pythons_ctrl_c():
    """Python's own SIGINT handler for a test that sends itself a Ctrl-C (a test run in a background job inherits an
    ignored SIGINT, under which no Ctrl-C arrives), the previous one put back after it."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.fixture
def registry(monkeypatch):
    """Policies registered during one test are forgotten after it."""
    monkeypatch.setattr(policy_base, "_REGISTRY", dict(policy_base._REGISTRY))


@pytest.fixture
def files(tmp_path):
    """A folder for command-line tests: t.safetensors (three tokens, one layer, 4 experts, top-2), prompts.jsonl (one
    prompt) and empty.jsonl."""
    trace = Trace(experts=np.array([[[0, 1]], [[1, 2]], [[2, 3]]]), num_experts=4, model="toy")
    trace.save(tmp_path / "t.safetensors")
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"id": 1, "task": "chat", "prompt": "hi"}) + "\n")
    (tmp_path / "empty.jsonl").write_text("")
    return tmp_path
