import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))  # tests import the tiny-model factory `families`

# The test models are tiny: one thread is as fast as two, and stays fast when the machine is busy.
torch.set_num_threads(1)
