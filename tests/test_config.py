"""Config reads a gpu_budget by what it is: a non-integral real number is a fraction, anything else a size; sizes and
rates are in bytes, and a unit in bits is refused rather than read as bytes."""

from __future__ import annotations

import numpy as np
import pytest

from expertflow.config import Config, parse_bandwidth, parse_bytes


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


@pytest.mark.parametrize("rate, in_bytes", [
    ("16Gb/s", "'2GB/s' in bytes \\(or '16GB/s' if you meant bytes\\)"),
    ("100Mb/s", "'12.5MB/s' in bytes"),
    ("25Gbit/s", "'3.125GB/s' in bytes"),
    ("16Gbps", "'2GB/s' in bytes"),
    ("16gb/s", "'2GB/s' in bytes"),
    ("8 kb/s", "'1kB/s' in bytes"),
    ("2Gib/s", "'0.25GiB/s' in bytes"),
    ("16Gb/S", "'2GB/s' in bytes"),
])
def test_a_rate_in_bits_is_refused_not_read_as_bytes(rate, in_bytes):
    with pytest.raises(ValueError, match=f"link_bandwidth='{rate}' is in bits; expertflow takes bytes.*{in_bytes}"):
        Config(link_bandwidth=rate)


@pytest.mark.parametrize("size", ["6Gb", "6gb", "6Gbit", "48Mbits", "100b"])
def test_a_size_in_bits_is_refused(size):
    with pytest.raises(ValueError, match=f"gpu_budget='{size}' is in bits"):
        Config(gpu_budget=size)


@pytest.mark.parametrize("rate, value", [("16GB/s", 16e9), ("400MB/s", 400e6), ("2GiB/s", 2 * 2**30),
                                         ("1234.500B/s", 1234), ("1kB/s", 1e3), ("3KiB/s", 3 * 2**10)])
def test_rates_in_bytes_as_documented(rate, value):
    assert parse_bandwidth(rate) == value


@pytest.mark.parametrize("size, value", [("6GiB", 6 * 2**30), ("512MB", 512 * 10**6), ("1.5 GB", 15 * 10**8),
                                         ("2.5GB", 25 * 10**8), ("1KB", 1000), ("64MiB", 64 * 2**20)])
def test_sizes_in_bytes_as_documented(size, value):
    assert parse_bytes(size) == value


def test_config_has_no_unused_fields():
    with pytest.raises(TypeError):
        Config(extra={"cache": 4})  # was accepted and ignored
