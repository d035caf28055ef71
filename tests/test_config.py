"""Config reads a gpu_budget by what it is: a non-integral real number is a fraction, anything else a size; sizes and
rates are in bytes, and a unit in bits is refused rather than read as bytes."""

from __future__ import annotations

import numpy as np
import pytest

import expertflow
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
                                         ("2.5GB", 25 * 10**8), ("1KB", 1000), ("64MiB", 64 * 2**20),
                                         # exact, where floats give a byte less (4.135552 × 10**6 = 4135551.99…)
                                         ("4.135552MB", 4135552), ("2.01kB", 2010), ("2.01GB", 2010 * 10**6),
                                         ("1.0000001kB", 1000)])
def test_sizes_in_bytes_as_documented(size, value):
    assert parse_bytes(size) == value


def test_a_size_of_thousands_of_digits_is_refused_as_not_a_size():
    with pytest.raises(ValueError, match=r"size='0\.9999.*'… \(5,004 characters\) is not a size"):
        parse_bytes("0." + "9" * 5000 + "GB")


def test_config_has_no_unused_fields():
    with pytest.raises(TypeError):
        Config(extra={"cache": 4})  # was accepted and ignored


def test_binary_terabytes_and_an_upper_case_per_second():
    assert parse_bytes("1TiB") == 2**40 and parse_bytes("1TB") == 10**12
    assert parse_bandwidth("16GB/S") == 16e9


@pytest.mark.parametrize("rate", ["16GB / s", "16 GB/ s", "16GB /s", " 16 GB / S "])
def test_a_rate_takes_spaces_around_the_slash(rate):
    assert parse_bandwidth(rate) == 16e9
    assert Config(link_bandwidth=rate, device="cpu").link_bandwidth == rate


def test_a_rate_in_bits_is_refused_with_spaces_around_the_slash_too():
    with pytest.raises(ValueError, match="link_bandwidth='16Gb / s' is in bits"):
        Config(link_bandwidth="16Gb / s")


@pytest.mark.parametrize("budget, message", [(0, "gpu_budget=0 must be positive"),
                                             (True, "gpu_budget=True is not a size")])
def test_a_budget_of_no_bytes_or_a_bool_is_refused(budget, message):
    with pytest.raises(ValueError, match=message):
        Config(gpu_budget=budget)


def test_a_budget_of_all_free_memory_is_a_fraction():
    assert Config(gpu_budget=1.0).gpu_budget == 1.0


def test_an_emulated_link_is_refused_on_cuda():
    with pytest.raises(ValueError, match="emulates a link on the CPU device only"):
        Config(link_bandwidth="16GB/s", device="cuda")


def test_a_predictor_path_is_kept_as_a_string(tmp_path):
    config = Config(predictor=tmp_path)
    assert config.predictor == str(tmp_path) and isinstance(config.predictor, str)


def test_policy_options_are_copied_from_the_callers_dict():
    options = {"waves": True}
    config = Config(policy="expertflow", policy_options=options)
    options["waves"] = False
    assert config.policy_options == {"waves": True}


def test_an_oracle_policy_is_refused_live_with_the_reason():
    with pytest.raises(ValueError, match="'belady' needs the future routes and runs only in the simulator"):
        Config(policy="belady")


@pytest.mark.parametrize("device", ["cpux", "cuda:0x", "cuda:1 "])
def test_a_device_with_trailing_text_is_refused(device):
    with pytest.raises(ValueError, match="is not supported"):
        Config(device=device)


@pytest.mark.parametrize("device, accepted", [("cuda:01", False), ("cuda:128", False), ("cuda:256", False),
                                              ("cuda:1000000", False), ("cuda:127", True), ("cuda:0", True)])
def test_config_takes_only_cuda_indices_torch_keeps_as_written(device, accepted):
    """torch holds a device index in 8 signed bits ("cuda:256" is cuda:0) and does not parse "cuda:01"."""
    if accepted:
        assert expertflow.Config(device=device).device == device
    else:
        with pytest.raises(ValueError, match=f"device='{device}' is not supported"):
            expertflow.Config(device=device)


def test_an_explicit_none_override_keeps_the_configs_other_sizing():
    from expertflow.runtime import _make_config

    assert _make_config(expertflow.Config(gpu_budget="64MiB"), {"cache_slots": None}).gpu_budget == "64MiB"
    assert _make_config(expertflow.Config(cache_slots=4), {"gpu_budget": None}).cache_slots == 4


def test_threads_are_refused_only_past_what_torch_can_be_sure_to_start(monkeypatch):
    import os

    from expertflow.commands import check_threads

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    check_threads(16)  # more than the cores: slower, but a run made elsewhere can be repeated
    check_threads(1024)
    with pytest.raises(ValueError, match=r"^--threads 1025 is more than torch can be sure to start \(1024\); this "
                                         "machine has 2 cores$"):
        check_threads(1025)
    monkeypatch.setattr(os, "cpu_count", lambda: 256)
    check_threads(2048)
    with pytest.raises(ValueError, match=r"\(2048\)"):
        check_threads(2049)
