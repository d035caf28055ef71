import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # tests import the tiny-model factory `families`

from expertflow.policy import base as policy_base  # noqa: E402

# The test models are tiny: one thread is as fast as two, and stays fast when the machine is busy.
torch.set_num_threads(1)


@pytest.fixture
def registry(monkeypatch):
    """Policies registered during one test are forgotten after it."""
    monkeypatch.setattr(policy_base, "_REGISTRY", dict(policy_base._REGISTRY))
