"""benchmarks/families_sweep.py run as a script: wrapped against unwrapped on tiny models of transformers' MoE families.

The fast tests cover families whose experts modules have unusual features, and how a run is judged (with the wrapped
model made to go wrong in this process); the slow one runs every family.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "families_sweep.py"

UNUSUAL = {
    "muse_spark": "a norm after each expert (has_post_expert_norm)",
    "nemotron_h": "no gate: an up projection and relu2",
    "zaya": "top-1 routing with a skip expert",
    "inkling2_loop": "one experts module called twice per step (looped layers)",
}
# Logits may differ in the last bit, tokens stay equal: its gate applies SiLU to a contiguous buffer whose rows
# expertflow lays out differently, and vectorised CPU kernels compute a buffer's tail on another path.
LAST_BIT = {"glm5_next"}
# No tiny autoregressive model: its only model class is block diffusion.
NOT_BUILT = {"diffusion_gemma"}


def _sweep(*args: str, timeout: float) -> tuple[int, list[dict], str]:
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout)
    return done.returncode, [json.loads(line) for line in done.stdout.splitlines()], done.stderr


def _installed(family: str) -> bool:
    return importlib.util.find_spec(f"transformers.models.{family}") is not None


def test_unusual_families_are_exact():
    families = [f for f in UNUSUAL if _installed(f)]
    if not families:
        pytest.skip("none of the families is in the installed transformers")
    code, rows, stderr = _sweep("--families", ",".join(families), "--jobs", "2", timeout=300)
    *results, summary = rows
    assert [r["family"] for r in results] == families, stderr[-2000:]
    for row in results:
        assert row["result"] == "exact", f"{row['family']} ({UNUSUAL[row['family']]}): {row.get('reason')}"
        assert all(run["state_dict_restored"] for run in row["runs"])
    assert summary["benchmark"] == "families_sweep_summary"
    assert summary["counts"] == {"exact": len(families)}
    assert code == 0


def test_bad_flags_name_the_flag():
    code, _, stderr = _sweep("--implementations", "grouped_mm,fused", timeout=120)
    assert code == 2 and "--implementations" in stderr and "fused" in stderr
    code, _, stderr = _sweep("--families", "mixtral,not_a_family", timeout=120)
    assert code == 2 and "--families" in stderr and "not_a_family" in stderr
    code, _, stderr = _sweep("--dtype", "float8", timeout=120)
    assert code == 2 and "--dtype" in stderr and "float8" in stderr
    code, _, stderr = _sweep("--timeout", "nan", "--families", "mixtral", timeout=120)
    assert code == 2 and "--timeout nan" in stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_every_family_is_exact():
    code, rows, stderr = _sweep("--jobs", "2", timeout=3600)
    *results, summary = rows
    by_result: dict[str, set[str]] = {}
    for row in results:
        by_result.setdefault(row["result"], set()).add(row["family"])
    reasons = {r["family"]: r.get("reason") for r in results if r["result"] != "exact"}
    assert code == 0, f"failed: {summary['failed']}: {reasons}"
    assert set(by_result) <= {"exact", "tokens_equal_logits_differ", "not_built"}, reasons
    assert by_result.get("tokens_equal_logits_differ", set()) <= LAST_BIT, reasons
    # A family that no longer builds loses coverage silently: fix its tiny config in the script instead.
    assert by_result.get("not_built", set()) <= NOT_BUILT, reasons
    assert len(by_result.get("exact", ())) >= len(results) - len(LAST_BIT | NOT_BUILT)


def _sweep_module():
    spec = importlib.util.spec_from_file_location("families_sweep", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _looped_model(sweep):
    """inkling2_loop as the sweep builds it (routing perturbed), and the sweep's inputs ([2, 7])."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, _ = sweep.build_model("inkling2_loop")
    sweep.perturb_routing(model)
    return model, sweep.make_inputs()


def _record_requests(model) -> list:
    """Each (step, layer, upcoming) the wrapped `model`'s cache is asked for from now on, in order."""
    from expertflow.runtime import runtime_of

    cache = runtime_of(model).cache
    requested = []
    request = cache.request
    cache.request = lambda step, layer, experts, upcoming: (
        requested.append((step, layer, upcoming)), request(step, layer, experts, upcoming))[1]
    return requested


def _two_looped_steps(monkeypatch, change) -> tuple[int, list]:
    """inkling2_loop with `change` applied to its config after the sweep's own loop settings, wrapped with 4 slots:
    its first step gives the unwrapped model's logits, then a second step runs; returns the steps the runtime
    counted and each (step, layer, upcoming) its cache was asked for."""
    import torch

    import expertflow

    if not _installed("inkling2"):
        pytest.skip("inkling2 is not in the installed transformers")
    sweep = _sweep_module()
    reason, loop = sweep.TEXT_FIXES["inkling2_loop"]

    def changed(d):
        loop(d)
        change(d)

    monkeypatch.setitem(sweep.TEXT_FIXES, "inkling2_loop", (reason, changed))
    model, inputs = _looped_model(sweep)
    with torch.no_grad():
        reference = model(**inputs).logits
    expertflow.wrap(model, cache_slots=4, device="cpu")
    try:
        requested = _record_requests(model)
        with torch.no_grad():
            assert torch.equal(model(**inputs).logits, reference)
            model(**inputs)
        steps = expertflow.stats(model).steps
    finally:
        expertflow.unwrap(model)
    return steps, requested

def test_a_looped_model_counts_one_step_per_forward_call():
    """inkling2_loop runs layers 1-2 twice in each forward call: a step is still one forward call (its tokens counted
    once), and after a pass's last layer the policy is told the next request is the loop's first layer, in the same
    step."""
    import torch

    import expertflow

    if not _installed("inkling2"):
        pytest.skip("inkling2 is not in the installed transformers")
    model, inputs = _looped_model(_sweep_module())
    calls = []
    model.register_forward_pre_hook(lambda module, args: calls.append(1))
    with torch.no_grad():
        reference = model(**inputs).logits
    expertflow.wrap(model, cache_slots=4, device="cpu")
    try:
        requested = _record_requests(model)
        with torch.no_grad():
            assert torch.equal(model(**inputs).logits, reference)
            model(**inputs)
        stats = expertflow.stats(model)
        assert (stats.steps, stats.tokens) == (2, 2 * 14)
        assert requested[5:] == [(1, 0, (1, 1)), (1, 1, (1, 2)), (1, 2, (1, 1)), (1, 1, (1, 2)), (1, 2, (2, 0))]
        stats.reset()
        calls.clear()
        model.generate(**inputs, max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0)
        assert (stats.steps, stats.tokens) == (len(calls), 14 + 2 * (len(calls) - 1)) == (3, 18)
    finally:
        expertflow.unwrap(model)


# ------------------------------------------------------------------------------------------ flags, judging, exit status
def test_bad_values_are_refused_in_one_line(capsys):
    """A timeout that is not a finite number of seconds up to a day, no jobs, or an empty list is refused before any
    worker starts, naming the flag: nan and inf get past a sign check, and subprocess.run overflows on inf, nan or a
    timeout of weeks, in a traceback."""
    sweep = _sweep_module()
    for flags, named in ((["--timeout", "nan"], "--timeout nan"), (["--timeout", "inf"], "--timeout inf"),
                         (["--timeout", "1e7"], "--timeout 1e+07"), (["--timeout", "0"], "--timeout 0"),
                         (["--jobs", "0"], "--jobs 0"), (["--families", ","], "--families"),
                         (["--implementations", ","], "--implementations")):
        with pytest.raises(SystemExit) as stop:
            sweep.parse_args(flags)
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert stop.value.code == 2 and named in last, (flags, last)
    assert sweep.parse_args(["--timeout", "86400", "--jobs", "1"]).timeout == 86400


def test_a_run_is_judged_by_tokens_then_logits_then_state():
    """Other tokens fail whatever the logits; equal tokens fail on logits beyond the dtype's last bits (or NaN);
    a last-bit difference is reported apart from an exact run, never as exact."""
    outcome = _sweep_module()._outcome
    assert outcome(False, 0.0, True) == "wrong_tokens"
    assert outcome(False, 1.0, False) == "wrong_tokens"
    assert outcome(True, 1e-3, True) == "wrong_logits"
    assert outcome(True, float("nan"), True) == "wrong_logits"
    assert outcome(True, 0.0, False) == "state_dict_changed"
    assert outcome(True, 4e-8, True) == "tokens_equal_logits_differ"
    assert outcome(True, 0.0, True) == "exact"
    # the tolerance is a few last bits of logits of order 1 in the model's dtype, bounds included
    assert outcome(True, 1e-5, True) == "tokens_equal_logits_differ"
    assert outcome(True, 5e-3, True, "float16") == "tokens_equal_logits_differ"
    assert outcome(True, 5e-3, True, "float32") == "wrong_logits"
    assert outcome(True, 3e-2, True, "bfloat16") == "tokens_equal_logits_differ"
    assert outcome(True, 3e-2, True, "float16") == "wrong_logits"
    assert outcome(True, 0.5, True, "bfloat16") == "wrong_logits"


def test_a_family_is_its_worst_run():
    """One bad run is enough to fail a family, whatever the others gave; the largest logits difference and every run
    that is not exact are reported; skipped runs do not count, and a family with nothing but skipped runs was not
    built."""
    family_result = _sweep_module().family_result

    def run(result, diff=None, implementation="eager", slots=1, **extra):
        return {"implementation": implementation, "cache_slots": slots, "result": result, **extra,
                **({} if diff is None else {"max_logits_diff": diff})}

    exact, last_bit = run("exact", 0.0), run("tokens_equal_logits_differ", 4e-8, slots=4)
    assert family_result([exact, run("exact", 0.0, slots=4)]) == {"result": "exact", "max_logits_diff": 0.0}
    assert family_result([exact, last_bit]) == {"result": "tokens_equal_logits_differ", "max_logits_diff": 4e-8,
                                                "reason": "eager, 4 slots: tokens_equal_logits_differ"}
    wrong = run("wrong_tokens", 0.5, implementation="batched_mm")
    for runs in ([exact, last_bit, wrong], [wrong, last_bit, exact]):
        out = family_result(runs)
        assert (out["result"], out["max_logits_diff"]) == ("wrong_tokens", 0.5)
        assert "batched_mm, 1 slots: wrong_tokens" in out["reason"] and "eager, 1 slots" not in out["reason"]
    errors = [run("wrap_error", reason="RuntimeError: a"), run("run_error", slots=4, reason="RuntimeError: b")]
    out = family_result(errors)
    assert out["result"] == "run_error" and out["max_logits_diff"] is None  # SEVERITY: a failed run before a refusal
    assert "RuntimeError: a" in out["reason"] and "RuntimeError: b" in out["reason"]
    skipped = {"implementation": "grouped_mm", "result": "skipped", "reason": "unwrapped: KeyError: x"}
    out = family_result([skipped, exact])
    assert out["result"] == "exact" and out["reason"] == "grouped_mm: skipped (unwrapped: KeyError: x)"
    assert family_result([skipped]) == {"result": "not_built", "reason": "unwrapped: KeyError: x"}


def test_state_restored_means_same_keys_in_order_dtypes_and_values():
    """`unwrap` must give back the state_dict as it was: reordered, recast or changed entries are not restored."""
    import torch

    sweep = _sweep_module()
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert sweep._state_restored(model, before)
    assert not sweep._state_restored(model, dict(reversed(before.items())))
    assert not sweep._state_restored(model, {**before, "0.bias": before["0.bias"].double()})
    with torch.no_grad():
        model[1].weight[0, 1] += 1.0
    assert not sweep._state_restored(model, before)


@pytest.mark.parametrize("failure", ["wrong_tokens", "wrong_logits", "state_dict_changed", "wrap_error", "run_error"])
def test_only_failures_fail_the_sweep(monkeypatch, capsys, failure):
    """A last-bit logits difference and a family without a tiny model are reported but pass; any failure is counted,
    named in `failed` and gives exit status 1."""
    sweep = _sweep_module()
    results = {"a": "exact", "b": "tokens_equal_logits_differ", "c": "not_built"}
    monkeypatch.setattr(sweep, "discover_families", lambda: list(results))
    monkeypatch.setattr(sweep, "run_worker", lambda family, *_: {"family": family, "result": results[family]})
    for expected_code, expected_failed in ((0, []), (1, ["d"])):
        code = sweep.main(["--implementations", "eager"])
        *rows, summary = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert [r["family"] for r in rows] == list(results)
        assert summary["counts"] == dict(sorted(Counter(results.values()).items()))
        assert (code, summary["failed"]) == (expected_code, expected_failed)
        results["d"] = failure


def test_a_family_that_times_out_fails():
    """A family out of time is a run_error, counted and named in `failed`, and the script exits with status 1."""
    code, rows, stderr = _sweep("--families", "mixtral", "--implementations", "eager", "--timeout", "1e-9",
                                timeout=120)
    row, summary = rows
    assert row["result"] == "run_error" and "timed out" in row["reason"], stderr[-2000:]
    assert summary["failed"] == ["mixtral"] and summary["counts"] == {"run_error": 1}
    assert code == 1


def test_a_worker_that_dies_fails(monkeypatch, tmp_path):
    """A worker that exits without its result line (a crash in native code, say) is a run_error that shows how it
    ended."""
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\necho 'Fatal Python error: Segmentation fault' >&2\nexit 139\n")
    python.chmod(0o755)
    sweep = _sweep_module()
    monkeypatch.setattr(sys, "executable", str(python))
    row = sweep.run_worker("mixtral", ["eager"], 60.0)
    assert row["result"] == "run_error"
    assert "status 139" in row["reason"] and "Segmentation fault" in row["reason"]


# ---------------------------------------------------------------------------------------------- what a run runs
def _patch_wrap(monkeypatch, before_wrap=None, after_unwrap=None) -> None:
    """expertflow.wrap calls `before_wrap(model, cache_slots)` first, expertflow.unwrap `after_unwrap(model)` last."""
    import expertflow

    wrap, unwrap = expertflow.wrap, expertflow.unwrap

    def wrapped(model, **kwargs):
        if before_wrap:
            before_wrap(model, kwargs["cache_slots"])
        return wrap(model, **kwargs)

    def unwrapped(model):
        unwrap(model)
        if after_unwrap:
            after_unwrap(model)
        return model

    monkeypatch.setattr(expertflow, "wrap", wrapped)
    monkeypatch.setattr(expertflow, "unwrap", unwrapped)


def _run_family(sweep, family: str = "mixtral", implementations: tuple[str, ...] = ("eager",)) -> dict:
    """The worker's row for one family, run in this process (which keeps its thread count)."""
    import warnings

    import torch

    if not _installed(family):
        pytest.skip(f"{family} is not in the installed transformers")
    threads = torch.get_num_threads()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return sweep.run_family(family, list(implementations))
    finally:
        torch.set_num_threads(threads)


def _first_experts(model):
    from expertflow.adapters.experts3d import is_experts3d

    return next(m for m in model.modules() if is_experts3d(m))


@pytest.mark.parametrize("scale, result", [(0.0, "wrong_logits"), (64.0, "wrong_tokens")])
def test_a_wrong_expert_in_the_wrapped_model_fails(monkeypatch, scale, result):
    """Expert 0 of the first layer scaled while wrapped (and put back exactly after unwrap): at 0, as from a slot
    left empty, only the logits change; at 64 the tokens change too. Either fails every run and the family."""
    import torch

    sweep = _sweep_module()
    saved = []

    def spoil(model, slots):
        down = _first_experts(model).down_proj
        saved.append(down.detach().clone())
        with torch.no_grad():
            down[0] *= scale

    def mend(model):
        with torch.no_grad():
            _first_experts(model).down_proj.copy_(saved.pop())

    _patch_wrap(monkeypatch, spoil, mend)
    row = _run_family(sweep)
    assert [r["result"] for r in row["runs"]] == [result, result] and row["result"] == result, row.get("reason")
    assert all(r["state_dict_restored"] for r in row["runs"])
    assert all(r["tokens_equal"] == (result == "wrong_logits") for r in row["runs"])
    assert row["max_logits_diff"] > 1e-3
    assert sweep.summary([row], ["eager"], 0.0)["failed"] == ["mixtral"]


@pytest.mark.parametrize("token", [3, 2])  # 2: the tiny models' eos, which ends the generation early
def test_tokens_are_compared_over_the_whole_greedy_generation(monkeypatch, token):
    """A wrapped model that goes wrong only after the prompt (from the second generated token on, as a fault in the
    decode steps would) has the unwrapped model's logits but wrong tokens; also when it stops the generation
    early."""
    sweep = _sweep_module()
    hooks = []

    def force(module, args, kwargs, output):
        if kwargs["input_ids"].shape[1] == 1:  # a decode step
            output.logits[..., token] += 100.0

    _patch_wrap(monkeypatch, lambda model, slots: hooks.append(model.register_forward_hook(force, with_kwargs=True)),
                lambda model: hooks.pop().remove())
    row = _run_family(sweep)
    assert [r["result"] for r in row["runs"]] == ["wrong_tokens", "wrong_tokens"], row.get("reason")
    assert row["max_logits_diff"] == 0.0 and all(r["state_dict_restored"] for r in row["runs"])


@pytest.mark.parametrize("where, result", [("wrap", "wrap_error"), ("forward", "run_error"), ("unwrap", "run_error")])
def test_errors_of_the_wrapped_model_are_failures(monkeypatch, where, result):
    """wrap, the wrapped model or unwrap raising fails the run and the family; it is never taken for a family that
    could not be built or a run that could not start."""
    sweep = _sweep_module()
    hooks = []

    def fail(*_):
        raise RuntimeError("injected")

    if where == "wrap":
        _patch_wrap(monkeypatch, fail)
    elif where == "forward":
        _patch_wrap(monkeypatch, lambda model, slots: hooks.append(model.register_forward_pre_hook(fail)),
                    lambda model: hooks.pop().remove())
    else:
        _patch_wrap(monkeypatch, after_unwrap=fail)
    row = _run_family(sweep)
    assert [r["result"] for r in row["runs"]] == [result, result] and row["result"] == result
    assert all("RuntimeError: injected" in r["reason"] for r in row["runs"])
    assert all(("unwrap" in r["reason"]) == (where == "unwrap") for r in row["runs"])
    assert sweep.summary([row], ["eager"], 0.0)["failed"] == ["mixtral"]


def test_each_implementation_runs_unwrapped_and_wrapped_at_one_slot_and_half_the_experts(monkeypatch):
    """The experts modules compute under each implementation asked for, in turn: unwrapped, then wrapped with 1 slot
    (every layer in waves) and with E/2 slots."""
    from expertflow.adapters.experts3d import is_experts3d

    sweep = _sweep_module()
    build, state, calls = sweep.build_model, {"slots": None}, []

    def build_with_spies(*args):
        model, notes = build(*args)
        for module in model.modules():
            if is_experts3d(module):
                module.register_forward_pre_hook(
                    lambda m, _: calls.append((state["slots"], m.config._experts_implementation)))
        return model, notes

    monkeypatch.setattr(sweep, "build_model", build_with_spies)
    _patch_wrap(monkeypatch, lambda model, slots: state.update(slots=slots), lambda model: state.update(slots=None))
    row = _run_family(sweep, implementations=("batched_mm", "eager"))
    assert row["result"] == "exact", row.get("reason")
    wrapped = list(dict.fromkeys(call for call in calls if call[0] is not None))
    assert wrapped == [(1, "batched_mm"), (4, "batched_mm"), (1, "eager"), (4, "eager")]
    assert {"batched_mm", "eager"} <= {implementation for slots, implementation in calls if slots is None}
    assert [(r["cache_slots"], r["implementation"]) for r in row["runs"]] == wrapped


def test_routers_are_redrawn_so_routing_depends_on_the_tokens():
    """afmoe's init leaves its routers at zero, so every token would tie and go to the same top-k experts of a
    layer; redrawn, the prompts reach more experts than that."""
    sweep = _sweep_module()
    row = _run_family(sweep, "afmoe")
    hit, total = map(int, row["experts_hit"].split("/"))
    assert hit > sweep.K * total // sweep.E and row["result"] == "exact", row


def test_the_first_prompt_is_left_padded_and_masked():
    """The padded prompt's last logits are those of the prompt alone: the batch has padding, and the pads change
    nothing the prompt computes."""
    import torch

    if not _installed("mixtral"):
        pytest.skip("mixtral is not in the installed transformers")
    sweep = _sweep_module()
    model, _ = sweep.build_model("mixtral")
    sweep.perturb_routing(model)
    inputs = sweep.make_inputs()
    ids = inputs["input_ids"][0]
    assert ids[0] == 0 and ids[-1] != 0  # the pad token is 0
    with torch.no_grad():
        padded = model(**inputs).logits[0, -1]
        alone = model(input_ids=ids[ids != 0][None]).logits[0, -1]
    assert torch.allclose(padded, alone, atol=1e-5)


def test_dtype_bfloat16_reaches_the_wrapped_model(monkeypatch, capsys):
    """--dtype bfloat16 is passed to the worker, and the model it wraps is in bf16."""
    import torch

    if not _installed("mixtral"):
        pytest.skip("mixtral is not in the installed transformers")
    sweep = _sweep_module()
    dtypes = set()
    _patch_wrap(monkeypatch, lambda model, slots: dtypes.update(p.dtype for p in model.parameters()))
    threads = torch.get_num_threads()
    try:
        code = sweep.main(["--worker", "mixtral", "--implementations", "eager", "--dtype", "bfloat16"])
    finally:
        torch.set_num_threads(threads)
    row = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert code == 0 and dtypes == {torch.bfloat16}
    assert (row["dtype"], row["result"]) == ("bfloat16", "exact"), row.get("reason")


def test_a_config_left_large_is_refused(monkeypatch):
    """A config that shrinking leaves large (here a fix-up's hidden size 4096) is refused before the model is built:
    an unshrunk model can take tens of GB."""
    sweep = _sweep_module()
    if not _installed("mixtral"):
        pytest.skip("mixtral is not in the installed transformers")
    monkeypatch.setitem(sweep.TEXT_FIXES, "mixtral", ("a large hidden size", sweep._set(hidden_size=4096)))
    with pytest.raises(RuntimeError, match="hidden_size=4096"):
        sweep.build_model("mixtral")
