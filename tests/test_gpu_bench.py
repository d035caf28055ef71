"""benchmarks/gpu_bench.py on the CPU: its flags, the check of each wrapped run's row, and one whole run with CUDA's
calls stood in for by the CPU (a model of one layer, two new tokens), for the rows it prints and its exit status."""

from __future__ import annotations

import json
import sys

import pytest
import torch

import expertflow
from test_benchmark_targets import _imported
from test_trace import _script_error

SMALL = ["--layers", "1", "--hidden", "32", "--experts", "2", "--batch", "1", "--new-tokens", "2", "--fractions", "0.5",
         "--policies", "lru"]


@pytest.fixture
def gpu_bench(monkeypatch):
    yield from _imported(monkeypatch, "gpu_bench")


@pytest.mark.parametrize("argv, says", [
    (["--experts", "1"], "--experts 1: the model routes each token to 2 experts; give at least 2"),
    (["--hidden", "8"], "--hidden 8: the model has 16 attention heads of an even size; give a multiple of 32"),
    (["--hidden", "48"], "--hidden 48: the model has 16 attention heads of an even size"),
    (["--fractions", "0"], "--fractions 0: cache fractions must be in (0, 1]"),
    (["--policies", "expertflow"], "--policies 'expertflow': choose from"),
])
def test_bad_flags_are_one_line_errors(monkeypatch, capsys, argv, says):
    assert says in _script_error(monkeypatch, capsys, "gpu_bench", *argv)


def test_without_cuda_it_says_so(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "needs a CUDA device" in _script_error(monkeypatch, capsys, "gpu_bench", *SMALL)


def _row(**changes):
    row = {"needs": 10, "hits": 6, "misses": 4, "loads": 5, "on_demand_loads": 3, "prefetches": 2,
           "same_tokens_as_eager_gpu_model": True}
    return {**row, **changes}


def test_a_row_is_wrong_when_its_tokens_differ_or_its_counts_do_not_add_up(gpu_bench):
    assert gpu_bench.problems(_row()) == []
    assert gpu_bench.problems(_row(same_tokens_as_eager_gpu_model=False)) == [
        "other tokens than the unoffloaded model"]
    assert gpu_bench.problems(_row(hits=7)) == ["hits 7 + misses 4 != needs 10"]
    assert gpu_bench.problems(_row(loads=6)) == ["loads 6 != on-demand 3 + prefetches 2"]
    assert gpu_bench.problems(_row(on_demand_loads=5, prefetches=0)) == ["on-demand loads 5 > misses 4"]


def _on_the_cpu(monkeypatch):
    """CUDA's calls as no-ops or the CPU, and `wrap` on the CPU device: the benchmark runs as it would on a GPU."""
    wrap = expertflow.wrap
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.nn.Module, "cuda", lambda self, *args, **kwargs: self)
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *args, **kwargs: self)
    monkeypatch.setattr(expertflow, "wrap", lambda model, **kwargs: wrap(model, **{**kwargs, "device": "cpu"}))
    monkeypatch.setattr(sys, "argv", ["gpu_bench", *SMALL])


def test_a_whole_run_prints_the_rows_and_checks_them(gpu_bench, monkeypatch, capsys):
    _on_the_cpu(monkeypatch)
    gpu_bench.main()
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["policy"], r.get("experts_implementation")) for r in rows] == [
        ("full", "grouped_mm"), ("full", "eager"), ("lru", None)]
    wrapped = rows[-1]
    assert wrapped["same_tokens_as_eager_gpu_model"] and wrapped["cache_slots"] == 1  # half of two experts
    assert wrapped["hits"] + wrapped["misses"] == wrapped["needs"] > 0
    assert wrapped["loads"] == wrapped["on_demand_loads"] == wrapped["misses"]  # `lru` only loads on demand
    assert wrapped["loads_per_generated_token"] == round(wrapped["loads"] / 2, 3)  # batch 1 x 2 new tokens


def test_a_run_with_other_tokens_exits_with_status_1_naming_it(gpu_bench, monkeypatch, capsys):
    _on_the_cpu(monkeypatch)
    timed = gpu_bench.timed

    def other_tokens(model, inputs, new_tokens, after_warmup=None):
        out, seconds = timed(model, inputs, new_tokens, after_warmup)
        return (out + 1 if after_warmup is not None else out), seconds  # only wrapped runs reset after the warm-up

    monkeypatch.setattr(gpu_bench, "timed", other_tokens)
    with pytest.raises(SystemExit) as exit_info:
        gpu_bench.main()
    assert exit_info.value.code == 1
    captured = capsys.readouterr()
    assert json.loads(captured.out.splitlines()[-1])["same_tokens_as_eager_gpu_model"] is False
    assert captured.err.strip() == "gpu_bench: lru at 0.5 cached, batch 1: other tokens than the unoffloaded model"
