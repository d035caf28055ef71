"""benchmarks/memory.py's byte accounting and its error when a model's rows cannot be measured, benchmarks/overhead.py's
rows, token check and exit status (two new tokens of the built-in model, timings scripted), and
benchmarks/predictor_overhead.py's figures (a scripted predictor and clock) and flag checks."""

from __future__ import annotations

import json
import sys
import types
import warnings

import pytest
import torch

import expertflow
from test_benchmark_targets import _imported
from test_trace import _script_error


@pytest.fixture
def memory(monkeypatch):
    yield from _imported(monkeypatch, "memory")


@pytest.fixture
def overhead(monkeypatch):
    yield from _imported(monkeypatch, "overhead")


@pytest.fixture
def predictor_overhead(monkeypatch):
    yield from _imported(monkeypatch, "predictor_overhead")


@pytest.fixture(scope="module")
def tiny():
    """The built-in tiny MoE in fp32 (each test leaves it unwrapped) and two held-out prompts, left-padded."""
    from transformers import AutoTokenizer

    from expertflow.models import load_prompts, tiny_moe

    model = tiny_moe(dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model.name_or_path)
    tokenizer.padding_side = "left"
    rows = load_prompts(split="test")
    inputs = dict(tokenizer([rows[0]["prompt"], rows[-1]["prompt"]], return_tensors="pt", padding=True))
    return model, inputs


def _rows(capsys) -> list[dict]:
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


# memory.py


def test_memory_rows_add_up(memory, tiny, capsys):
    """Every expert is in the host store and the device holds the non-expert weights plus one expert's bytes per slot;
    all fp32, so bytes are 4 per element. A tiny fraction still gets one slot, and 30% of 192 experts rounds to 58."""
    model, _ = tiny
    memory.measure("tiny", model, fractions=(0.001, 0.3, 1.0))
    rows = _rows(capsys)
    experts = model.config.num_hidden_layers * model.config.num_local_experts
    expert_elements = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    elements = sum(t.numel() for t in [*model.parameters(), *model.buffers()])
    assert [(r["cache_fraction"], r["cache_slots"], r["experts"]) for r in rows] == [
        (0.001, 1, experts), (0.3, 58, experts), (1.0, experts, experts)]
    for row in rows:
        assert row["full_model_bytes"] == 4 * elements and row["host_store_bytes"] == 4 * expert_elements
        assert row["full_model_bytes"] == row["non_expert_bytes"] + row["host_store_bytes"]
        assert row["slot_bank_bytes"] * experts == row["cache_slots"] * row["host_store_bytes"]
        assert row["device_bytes"] == row["non_expert_bytes"] + row["slot_bank_bytes"]
        assert row["device_fraction_of_full"] == round(row["device_bytes"] / row["full_model_bytes"], 4)
        assert row["expert_share_of_params"] == pytest.approx(expert_elements / elements, abs=1e-4)
    assert rows[-1]["device_bytes"] == rows[-1]["full_model_bytes"] and rows[-1]["device_fraction_of_full"] == 1.0
    with pytest.raises(expertflow.WrapError):
        expertflow.stats(model)  # unwrapped again


def test_memory_main_gives_the_readme_figures(memory, monkeypatch, capsys):
    """README: with 25% of the Mixtral-like config's experts cached the device holds 28.8% of the full model's bytes,
    52.5% at 50%; its experts are ~95% of the parameters. The built-in model's three rows follow."""
    monkeypatch.setattr(sys, "argv", ["memory.py"])
    memory.main()
    rows = _rows(capsys)
    assert [(r["model"].split(" ")[0], r["cache_fraction"]) for r in rows] == [
        (name, f) for name in ("mixtral-like", "tiny-moe") for f in (0.25, 0.5, 1.0)]
    assert [round(100 * r["device_fraction_of_full"], 1) for r in rows[:3]] == [28.8, 52.5, 100.0]
    assert round(rows[0]["expert_share_of_params"], 2) == 0.95


@pytest.mark.parametrize("error", [OSError, ImportError])
def test_memory_says_when_the_built_in_model_cannot_be_measured(memory, monkeypatch, capsys, error):
    """A model whose rows are missing is an error line and exit status 1, after the rows that were measured."""
    from expertflow import models

    def missing(**_):
        raise error("no tiny MoE at /nowhere; reinstall expertflow")

    measured = []
    monkeypatch.setattr(sys, "argv", ["memory.py"])
    monkeypatch.setattr(memory, "mixtral_like", lambda: None)
    monkeypatch.setattr(memory, "measure", lambda name, model: measured.append(name))
    monkeypatch.setattr(models, "tiny_moe", missing)
    with pytest.raises(SystemExit) as stopped:
        memory.main()
    err = capsys.readouterr().err.strip()
    assert stopped.value.code == 1 and measured == ["mixtral-like (H512, 8 experts, fp32)"]
    assert len(err.splitlines()) == 1 and err.startswith("error: tiny-moe (built-in, fp32) not measured")
    assert "no tiny MoE at /nowhere" in err


# overhead.py


def _scripted(monkeypatch, overhead, wrapped_model, plain_s=(), wrapped_s=(), change=()):
    """overhead._generate generating for real, but returning the seconds `plain_s` / `wrapped_s` scripted per side,
    and with the last token changed in the wrapped generations numbered (from 0) in `change`."""
    real, plain_s, wrapped_s, calls = overhead._generate, iter(plain_s), iter(wrapped_s), []

    def generate(model, inputs, new_tokens):
        out, seconds = real(model, inputs, new_tokens)
        if model is not wrapped_model:
            return out, next(plain_s, seconds)
        calls.append(out)
        if len(calls) - 1 in change:
            out = out.clone()
            out[:, -1] = (out[:, -1] + 1) % model.config.vocab_size
        return out, next(wrapped_s, seconds)

    monkeypatch.setattr(overhead, "_generate", generate)
    return calls


def test_overhead_row_from_scripted_timings(overhead, tiny, monkeypatch):
    """Per side the median of the timed runs (the warm-ups left out), per new token; the ratio is wrapped over
    unwrapped. With a slot for every expert, nothing is loaded after the warm-up, and `lru` is given no route
    predictor (wrap would warn that it ignores one)."""
    from expertflow.predictor import default_predictor_path

    model, inputs = tiny
    slots = model.config.num_hidden_layers * model.config.num_local_experts
    calls = _scripted(monkeypatch, overhead, model, plain_s=(9.0, 0.2, 0.9, 0.3), wrapped_s=(9.0, 0.6, 0.5, 3.0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        row = overhead.measure(model, inputs, "lru", slots, str(default_predictor_path()), new_tokens=2, repeats=3)
    assert len(calls) == 4 and not [w for w in caught if "predictor" in str(w.message)]
    assert row == {"policy": "lru", "unwrapped_ms_per_step": 150.0, "wrapped_ms_per_step": 300.0,
                   "wrapped_vs_unwrapped": 2.0, "predictor_ms_per_step": 0.0, "loads_after_warm_up": 0,
                   "same_tokens": True}


def test_overhead_counts_the_warm_up_tokens(overhead, tiny, monkeypatch):
    """The warm-up is the one wrapped run that copies experts: its tokens differing is a failure too."""
    model, inputs = tiny
    slots = model.config.num_hidden_layers * model.config.num_local_experts
    _scripted(monkeypatch, overhead, model, change={0})
    row = overhead.measure(model, inputs, "lru", slots, None, new_tokens=2, repeats=1)
    assert row["same_tokens"] is False and row["loads_after_warm_up"] == 0


def test_overhead_main(overhead, monkeypatch, capsys):
    """One row per (batch, policy), exit status 0 while tokens match; a timed wrapped run with other tokens gives
    same_tokens false, an error line and exit status 1."""
    loaded = []

    def load(path):
        loaded.append(real_load(path))
        return loaded[-1]

    real_load = overhead.load_demo_model
    monkeypatch.setattr(overhead, "load_demo_model", load)
    monkeypatch.setattr(sys, "argv", ["overhead.py", "--max-new-tokens", "2", "--repeats", "2", "--policy", "lru",
                                      "--batch", "1", "--threads", "1"])
    overhead.main()
    (row,) = _rows(capsys)
    assert {k: row[k] for k in ("batch", "policy", "cache_slots", "max_new_tokens", "loads_after_warm_up",
                                "same_tokens")} == {"batch": 1, "policy": "lru", "cache_slots": 192,
                                                    "max_new_tokens": 2, "loads_after_warm_up": 0,
                                                    "same_tokens": True}

    def load_and_change(path):  # the first timed run's tokens changed: not the last run's, not the warm-up's
        _scripted(monkeypatch, overhead, load(path)[0], change={1})
        return loaded[-1]

    monkeypatch.setattr(overhead, "load_demo_model", load_and_change)
    with pytest.raises(SystemExit) as stopped:
        overhead.main()
    captured = capsys.readouterr()
    assert stopped.value.code == 1 and json.loads(captured.out)["same_tokens"] is False
    assert captured.err.strip().splitlines()[-1] == "error: a wrapped run's tokens differ from the unwrapped model's"


def test_overhead_bad_flags_in_one_line(overhead, monkeypatch, capsys):
    for flag, value in (("--batch", "0"), ("--policy", ","), ("--policy", "lru,belady"), ("--max-new-tokens", "0"),
                        ("--repeats", "0"), ("--threads", "0")):
        assert flag in _script_error(monkeypatch, capsys, "overhead", flag, value), (flag, value)


# predictor_overhead.py


class _Predictor:
    """Stands in for a route predictor on an asynchronous device: a call returns at once and the wait for its
    probabilities on the host (`.cpu()`) takes the next of its scripted seconds on the fake clock `now`."""

    config = types.SimpleNamespace(vocab_size=50)

    def __init__(self, prefill_s, decode_s):
        self.now, self.prefill_s, self.decode_s, self.shapes = 0.0, iter(prefill_s), iter(decode_s), []

    def parameters_count(self) -> int:
        return 7

    def new_session(self):
        return self

    def _result(self, seconds: float):
        def cpu():
            self.now += seconds
            return torch.zeros(1)

        return types.SimpleNamespace(cpu=cpu)

    def prefill(self, ids):
        self.shapes.append(("prefill", tuple(ids.shape)))
        return self._result(next(self.prefill_s))

    def decode(self, ids):
        self.shapes.append(("decode", tuple(ids.shape)))
        return self._result(next(self.decode_s))


def test_predictor_overhead_figures(predictor_overhead, monkeypatch, capsys, tmp_path):
    """Decode: median and 90th percentile (interpolated, as the median is) of the timed steps, the three warm-up
    steps left out; prefill: median and min of the timed runs. Each timed call lasts until its probabilities are on
    the host."""
    fake = _Predictor(prefill_s=(5.0, 5.0, 0.030, 0.010, 0.020), decode_s=(1.0, 1.0, 1.0, 0.001, 0.002, 0.004, 0.003,
                                                                            0.100))
    loaded = []

    def load(path, device):
        loaded.append((path, device))
        return fake

    monkeypatch.setattr(predictor_overhead, "load_predictor", load)
    monkeypatch.setattr(predictor_overhead, "time", types.SimpleNamespace(perf_counter=lambda: fake.now))
    monkeypatch.setattr(sys, "argv", ["predictor_overhead.py", "--predictor", str(tmp_path), "--batch", "2",
                                      "--context", "4", "--steps", "5", "--prompt-tokens", "6", "--repeats", "3"])
    predictor_overhead.main()
    (row,) = _rows(capsys)
    assert loaded == [(str(tmp_path), "cpu")]
    assert fake.shapes == [("prefill", (2, 4))] + [("decode", (2, 1))] * 8 + [("prefill", (1, 6))] * 4
    # steps of 1, 2, 4, 3 and 100 ms: the 90th percentile lies 0.6 of the way from 4 to 100
    assert row["decode_step_ms"] == {"median": 3.0, "p90": 61.6, "target": 5.0}
    assert row["prefill_ms"] == {"median": 20.0, "min": 10.0, "target": 50.0}
    assert {k: row[k] for k in ("parameters", "batch", "context_tokens", "prefill_tokens", "device")} == {
        "parameters": 7, "batch": 2, "context_tokens": 4, "prefill_tokens": 6, "device": "cpu"}


def test_predictor_overhead_unreadable_predictor_in_one_line(predictor_overhead, monkeypatch, capsys, tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    (tmp_path / "model.safetensors").write_bytes(b"")
    line = _script_error(monkeypatch, capsys, "predictor_overhead", "--predictor", str(tmp_path))
    assert f"error: --predictor {tmp_path}: {tmp_path / 'config.json'} is not JSON" in line


def test_predictor_overhead_names_a_missing_directory(predictor_overhead, monkeypatch, capsys, tmp_path):
    """A mistyped path is reported as missing, not as a directory to train a predictor into."""
    line = _script_error(monkeypatch, capsys, "predictor_overhead", "--predictor", str(tmp_path / "nope"))
    assert line.endswith(f"error: --predictor {tmp_path / 'nope'}: no such directory")


def test_predictor_overhead_size_flags_in_one_line(predictor_overhead, monkeypatch, capsys):
    for flag in ("--steps", "--repeats", "--threads", "--batch", "--context", "--prompt-tokens"):
        assert f"{flag} 0 must be at least 1" in _script_error(monkeypatch, capsys, "predictor_overhead", flag, "0")
    # more threads than torch can start ends in a crash inside the OpenMP runtime, with no message
    assert "--threads 100000 is more than" in _script_error(monkeypatch, capsys, "predictor_overhead", "--threads",
                                                             "100000")


def test_predictor_overhead_p90_is_never_below_the_median(predictor_overhead, monkeypatch, capsys, tmp_path):
    fake = _Predictor(prefill_s=(5.0, 5.0, 0.010), decode_s=(1.0, 1.0, 1.0, 0.006, 0.005))
    monkeypatch.setattr(predictor_overhead, "load_predictor", lambda path, device: fake)
    monkeypatch.setattr(predictor_overhead, "time", types.SimpleNamespace(perf_counter=lambda: fake.now))
    monkeypatch.setattr(sys, "argv", ["predictor_overhead.py", "--predictor", str(tmp_path), "--batch", "2",
                                      "--context", "4", "--steps", "2", "--prompt-tokens", "6", "--repeats", "1"])
    predictor_overhead.main()
    (row,) = _rows(capsys)
    assert row["decode_step_ms"]["median"] == 5.5 and row["decode_step_ms"]["p90"] == 5.9
