"""Config reads a gpu_budget by what it is: a non-integral real number is a fraction, anything else a size."""

from __future__ import annotations

import numpy as np
import pytest

from expertflow.config import Config


@pytest.mark.parametrize("budget", [0.5, np.float64(0.5), np.float32(0.5), np.float16(0.5)])
def test_any_float_is_a_fraction_of_free_memory(budget):
    config = Config(gpu_budget=budget)
    assert config.gpu_budget == 0.5 and type(config.gpu_budget) is float


@pytest.mark.parametrize("budget, message", [
    (np.float32(1.5), "as a float is a fraction .* must be in \\(0, 1\\]"),
    ("0.5", "'0.5' is text; give a fraction of free device memory as a float \\(0.5\\) or a size with a unit"),
    ("1.0", "'1.0' is text; give a fraction of free device memory as a float \\(1.0\\) or a size with a unit"),
    ("0.3B", "'0.3B' is less than one byte; give a size with a unit such as '6GiB'"),
])
def test_a_budget_that_is_neither_names_the_fix(budget, message):
    with pytest.raises(ValueError, match=message):
        Config(gpu_budget=budget)
