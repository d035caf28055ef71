"""benchmarks/ece_sim.py's figures, flags, results reader, compute model and --compute-from round trip, and
benchmarks/ece_live.py's report, link, flags and redraw (no measuring: traces and timings are made by hand; ece_live
runs the built-in model on two short prompts with its compute fixed)."""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import pytest

from test_benchmark_targets import _imported


@pytest.fixture
def ece_sim(monkeypatch):
    yield from _imported(monkeypatch, "ece_sim")


@pytest.fixture
def ece_live(monkeypatch):
    yield from _imported(monkeypatch, "ece_live")


def _trace(seed: int, layers: int, experts: int, seqs: int = 3, tokens: int = 8, k: int = 2):
    """`seqs` sequences of `tokens` decode steps, routes skewed towards the low expert ids, and random predictions
    (current tokens and a 2-token next-token head)."""
    from expertflow.trace import Trace

    rng = np.random.default_rng(seed)
    weights = np.linspace(3, 1, experts)
    routes = np.stack([rng.choice(experts, k, replace=False, p=weights / weights.sum())
                       for _ in range(seqs * tokens * layers)])
    trace = Trace(experts=routes.reshape(seqs * tokens, layers, k).astype(np.int32), num_experts=experts,
                  seq_ids=np.repeat(np.arange(seqs), tokens), positions=np.tile(np.arange(tokens), seqs),
                  steps=np.tile(np.arange(tokens), seqs))
    n = trace.num_tokens
    return trace, (rng.random((n, layers, experts)), rng.random((n, 2, layers, experts)))


def _check_row(ece_sim, row, trace, probs, batch, fraction, timing, options):
    """Every figure of an ece_sim row, recomputed from the simulator: the best baseline is the fastest (or the
    best-hitting) of the five baselines, never lru-layer-waves or an oracle; ratios are ours over theirs."""
    from expertflow import sim
    from expertflow.policy import make_policy

    replay = trace.rebatch(batch)
    workload = sim.Workload.from_trace(replay)
    steps = sim.step_predictions(replay, *probs)
    slots = sim.capacity_from_fraction(fraction, trace.num_layers, trace.num_experts)
    base = ece_sim.BASELINES
    assert base == ("lru", "lru-layer", "lfu", "lookahead", "prev-step")
    timed = {n: sim.simulate(workload, n, slots, timing)
             for n in base + ("belady", "lru-layer-waves", "belady-waves")}

    def ours(t):
        policy = make_policy("expertflow", slots, trace.num_layers, trace.num_experts, **options)
        return sim.simulate(workload, policy, slots, t, predictions=steps)

    timed["expertflow"] = ef = ours(timing)
    counting = {n: sim.simulate(workload, n, slots).hit_rate for n in base + ("belady",)}
    counting["expertflow"] = ours(None).hit_rate
    ms = {n: r.modeled_ms_per_token for n, r in timed.items()}
    fastest = min(base, key=ms.get)
    best_hit = max(base, key=lambda n: timed[n].hit_rate)
    lower = sim.lower_bound_ms_per_token(workload, slots, timing)  # Belady's loads
    lower_waves = sim.lower_bound_ms_per_token(workload, slots, timing, waves=True)
    assert (row["benchmark"], row["batch"], row["cache_fraction"], row["capacity_slots"]) == (
        "ece_sim", batch, fraction, slots)
    assert row["policies"] == {n: r.as_dict() for n, r in timed.items()}
    assert (row["best_baseline_time"], row["best_baseline_hit_rate"]) == (fastest, best_hit)
    expected = {
        "lower_bound_ms_per_token": round(lower, 4),
        "time_vs_best_baseline": round(ms["expertflow"] / ms[fastest], 4),
        "hit_rate_gain": round(ef.hit_rate - timed[best_hit].hit_rate, 4),
        "untimed_hit_rates": {n: round(v, 4) for n, v in counting.items()},
        "untimed_hit_rate_gain": round(counting["expertflow"] - max(counting[n] for n in base), 4),
        "loads_vs_belady": round(ef.loads / timed["belady"].loads, 4),
        "on_demand_share_of_needs": round(ef.on_demand_loads / ef.needs, 4),
        "prefetches_landed_before_use": ef.prefetch_hits - ef.late_prefetches,
        "time_vs_lower_bound": round(ms["expertflow"] / lower, 4),
        "lower_bound_vs_best_baseline": round(lower / ms[fastest], 4),
        "time_vs_lru_layer_waves": round(ms["expertflow"] / ms["lru-layer-waves"], 4),
        "hit_rate_vs_lru_layer_waves": round(ef.hit_rate - timed["lru-layer-waves"].hit_rate, 4),
        "belady_waves_vs_best_baseline": round(ms["belady-waves"] / ms[fastest], 4),
        "time_vs_belady_waves": round(ms["expertflow"] / ms["belady-waves"], 4),
        "loads_lower_bound": sim.loads_lower_bound(workload, slots),
        "lower_bound_waves_ms_per_token": round(lower_waves, 4),
        "lower_bound_waves_vs_best_baseline": round(lower_waves / ms[fastest], 4),
        "time_vs_lower_bound_waves": round(ms["expertflow"] / lower_waves, 4),
    }
    assert {k: row[k] for k in expected} == expected
    return timed, counting


def test_ece_sim_figures_follow_from_the_policies_it_ran(ece_sim):
    from expertflow import sim

    # a link 8x a layer's compute, a quarter cached, batch 2: lru-layer-waves beats every baseline here, and is
    # still not the best baseline; the oracle with waves and the two lower bounds all differ from their plain kin
    trace, probs = _trace(0, layers=3, experts=8)
    timing = sim.Timing(transfer_ms=4.0, layer_ms=0.5, token_ms=0.05)
    row = ece_sim.run_config(trace, probs, 2, 0.25, timing, {})
    timed, counting = _check_row(ece_sim, row, trace, probs, 2, 0.25, timing, {})
    ms = {n: r.modeled_ms_per_token for n, r in timed.items()}
    assert ms["lru-layer-waves"] < ms[row["best_baseline_time"]] < max(ms[n] for n in ece_sim.BASELINES)
    assert timed["belady-waves"].loads != timed["belady"].loads
    assert row["loads_lower_bound"] < timed["belady"].loads
    assert timed["expertflow"].late_prefetches > 0
    assert any(counting[n] != timed[n].hit_rate for n in ("lookahead", "prev-step", "expertflow"))
    best_untimed = max(ece_sim.BASELINES, key=counting.get)
    assert counting[best_untimed] > counting[row["best_baseline_hit_rate"]], "untimed, another baseline hits most"
    assert row != ece_sim.run_config(trace, probs, 1, 0.25, timing, {}), "the batch is replayed, not ignored"


def test_ece_sim_best_baseline_by_time_and_by_hit_rate_can_differ_and_options_reach_the_policy(ece_sim):
    from expertflow import sim

    # a link faster than compute: prev-step hits most while lru is fastest
    trace, probs = _trace(0, layers=2, experts=6)
    timing = sim.Timing(transfer_ms=0.4, layer_ms=0.5, token_ms=0.05)
    options = {"waves": True, "margin": 8}
    row = ece_sim.run_config(trace, probs, 2, 0.25, timing, options)
    timed, counting = _check_row(ece_sim, row, trace, probs, 2, 0.25, timing, options)
    assert row["best_baseline_time"] != row["best_baseline_hit_rate"]
    hit = {n: timed[n].hit_rate for n in ece_sim.BASELINES}
    assert hit[row["best_baseline_time"]] < hit[row["best_baseline_hit_rate"]]
    plain = ece_sim.run_config(trace, probs, 2, 0.25, timing, {})
    assert plain["policies"]["expertflow"] != row["policies"]["expertflow"], "--policy-kwargs changes the policy"


def test_ece_sim_flags_are_checked_before_any_work(ece_sim, tmp_path):
    assert ece_sim._fractions("1,0.25") == (1.0, 0.25)
    for bad in ("0", "1.5", "-0.5", "x", ""):
        with pytest.raises(argparse.ArgumentTypeError, match=r"give cache fractions in \(0, 1\]"):
            ece_sim._fractions(bad)
    assert ece_sim._policy_kwargs('{"waves": true, "margin": 8}') == {"waves": True, "margin": 8}
    for bad, message in (('{"theta": NaN}', "is not JSON"), ("[1]", "give a JSON object"),
                         ('{"nope": 1}', "unknown option nope of the expertflow policy"),
                         ('{"capacity": 3}', "unknown option capacity"),
                         ('{"margin": -1}', "margin=-1 must be"), ('{"wave_gap": 2}', "only applies when serving")):
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            ece_sim._policy_kwargs(bad)

    def args(**given):
        fields = dict(plot=None, from_results=None, compute_from=None, ratio=8.0, predictor=None, trace=None,
                      split=None, max_new_tokens=None, temperature=None, unseen_only=False)
        return argparse.Namespace(**{**fields, **given})

    trace = tmp_path / "t.safetensors"
    trace.write_bytes(b"")
    results = tmp_path / "rows.pdf"  # a results file given an image name: the plot must not overwrite it
    results.write_text(json.dumps({"benchmark": "ece_sim"}) + "\n")
    no_compute = tmp_path / "none.jsonl"
    no_compute.write_text(json.dumps({"benchmark": "ece_sim"}) + "\n")
    for given, message in (
            (dict(split="test"), "--split chooses among the traces of --trace DIR: add --trace"),
            (dict(trace=str(trace), max_new_tokens=8), "--max-new-tokens: only used when recording"),
            (dict(trace=str(trace), temperature=1.0), "--temperature: only used when recording"),
            (dict(trace=str(trace), unseen_only=True), "--unseen-only: only used when recording"),
            (dict(ratio=0.0), "--ratio 0.0 must be above 0"),
            (dict(compute_from=str(no_compute)), "holds no measured compute"),
            (dict(from_results=str(results)), "--from-results only draws a plot: add --plot FILE.png"),
            (dict(from_results=str(tmp_path / "gone.jsonl"), plot=str(tmp_path / "p.png")), "no such file"),
            (dict(from_results=str(results), plot=str(results)), "is the input"),
            (dict(from_results=str(results), plot=str(tmp_path / "p.png"), compute_from=str(results)),
             "--compute-from is not used with --from-results")):
        with pytest.raises(ValueError, match=message):
            ece_sim.check_args(args(**given))
    ece_sim.check_args(args(trace=str(trace), split="test"))  # fine: nothing else given


def test_ece_sim_unseen_only_leaves_out_the_held_out_prompts_that_repeat_a_train_prompt(ece_sim, monkeypatch, capsys):
    """--unseen-only records the held-out prompts but those whose text (outer blanks aside) is also a train prompt,
    in their order, and names the ones left out; without it, every held-out prompt, as the shipped figures were."""
    import expertflow.models
    import expertflow.recorder

    rows = {"test": [{"id": "a", "prompt": "Same question"}, {"id": "b", "prompt": "Only here"},
                     {"id": "c", "prompt": "Also in train "}, {"id": "d", "prompt": "Last"}],
            "train": [{"id": "x", "prompt": "Same question"}, {"id": "y", "prompt": " Also in train"},
                      {"id": "z", "prompt": "Other"}]}
    recorded = []
    monkeypatch.setattr(expertflow.models, "load_prompts", lambda split: rows[split])
    monkeypatch.setattr(expertflow.recorder, "record", lambda model, prompts, *a, **k: recorded.append(prompts))
    ece_sim.record_heldout(None, None, 2, unseen_only=True)
    assert recorded.pop() == ["Only here", "Last"]
    left_out = "leaving out 2 held-out prompt(s) whose text is also a train prompt (a, c); 2 left"
    assert left_out in capsys.readouterr().err
    ece_sim.record_heldout(None, None, 2)
    assert recorded.pop() == ["Same question", "Only here", "Also in train ", "Last"]
    assert capsys.readouterr().err == ""


def test_the_shipped_held_out_prompts_repeat_one_train_prompt():
    """The one repeat that --unseen-only leaves out, as the prompts' README says."""
    from expertflow.models import load_prompts

    seen = {r["prompt"].strip() for r in load_prompts(split="train")}
    assert [r["id"] for r in load_prompts(split="test") if r["prompt"].strip() in seen] == ["mt-bench-130"]


def test_ece_sim_results_reader_skips_blank_lines_and_other_benchmarks(ece_sim, tmp_path):
    row = {"benchmark": "ece_sim", "batch": 1, "cache_fraction": 0.5, "policies": {}, "best_baseline_time": "lfu",
           "lower_bound_vs_best_baseline": 0.5}
    path = tmp_path / "rows.jsonl"
    path.write_text("\n" + json.dumps(row) + "\n\n" + json.dumps({"benchmark": "ece_sim_summary"}) + "\n   \n")
    assert ece_sim.read_rows(str(path)) == [row]


def test_ece_sim_rows_give_back_their_compute_to_compute_from(ece_sim, monkeypatch, capsys, tmp_path):
    """The `timing` a run prints is what --compute-from reads: the compute per layer without the per-token part, and
    the per-token part, so that a rerun models the same compute."""
    from expertflow import sim

    trace, probs = _trace(1, layers=2, experts=6, seqs=2, tokens=4)
    timing = sim.Timing(transfer_ms=8 * (0.5 + 0.02), layer_ms=0.5, token_ms=0.02)
    monkeypatch.setattr(ece_sim, "prepare", lambda args, parser: (trace, probs, timing))
    monkeypatch.setattr(sys, "argv", ["ece_sim.py", "--batches", "1", "--fractions", "0.5"])
    ece_sim.main()
    out = tmp_path / "out.jsonl"
    out.write_text(capsys.readouterr().out)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["benchmark"] for line in lines] == ["ece_sim", "ece_sim_summary"]
    assert lines[0]["timing"]["transfer_over_layer_compute"] == 8.0 and lines[0]["timing"]["transfer_ms"] == 4.16
    assert ece_sim.read_compute(str(out)) == (0.5, 0.02)
    assert lines[1]["tokens"] == 8 and lines[1]["sequences"] == 2
    assert lines[1]["rows"][0]["time_vs_best_baseline"] == lines[0]["time_vs_best_baseline"]


def test_ece_sim_compute_model_and_link_ratio(ece_sim, monkeypatch):
    """measure_compute splits the batch-1 time into the fixed and per-token parts; the link is `--ratio` times the
    whole batch-1 compute of a layer."""
    import expertflow.demo

    monkeypatch.setattr(expertflow.demo, "fit_layer_compute", lambda model, inputs, layers: (1.0, 0.1))
    assert ece_sim.measure_compute(None, lambda texts, return_tensors: {"input_ids": None}, 6) == (0.9, 0.1)


def test_ece_sim_prepare_sets_the_link_to_ratio_times_a_layers_whole_batch1_compute(ece_sim, monkeypatch, tmp_path):
    """With --trace and --compute-from nothing is measured or recorded: the timing is the file's compute, and the link
    is --ratio x (layer_ms + token_ms), one layer's compute at batch 1."""
    import expertflow.predictor
    import expertflow.predictor.data
    import expertflow.predictor.evaluate
    from expertflow import sim

    trace, _ = _trace(2, layers=2, experts=6)

    class Predictor:
        has_next_head = False

    monkeypatch.setattr(expertflow.predictor, "load_predictor", lambda path: Predictor())
    monkeypatch.setattr(expertflow.predictor.data, "load_traces", lambda paths, split=None: trace)
    monkeypatch.setattr(expertflow.predictor.evaluate, "check_fits", lambda predictor, trace: None)
    monkeypatch.setattr(expertflow.predictor.evaluate, "predict_trace", lambda predictor, trace, with_next: "probs")
    compute = tmp_path / "compute.jsonl"
    compute.write_text(json.dumps({"benchmark": "ece_sim", "timing": {"layer_ms": 0.5, "token_ms": 0.02}}) + "\n")
    args = argparse.Namespace(predictor=None, trace="t.safetensors", split=None, compute_from=str(compute), ratio=6.0,
                              max_new_tokens=None, temperature=None)
    got = ece_sim.prepare(args, argparse.ArgumentParser())
    assert got[:2] == (trace, "probs")
    assert got[2] == sim.Timing(transfer_ms=6.0 * (0.5 + 0.02), layer_ms=0.5, token_ms=0.02)


@pytest.mark.parametrize("unseen_only", [False, True])
def test_ece_sim_prepare_records_with_unseen_only_as_given_and_says_so(ece_sim, monkeypatch, tmp_path, unseen_only):
    """Without --trace the held-out prompts are recorded with --max-new-tokens, --temperature and --unseen-only as
    given, and the summary's `recorded` names --unseen-only when it was given (only then: the shipped outputs stay as
    they were)."""
    import expertflow.predictor.evaluate

    calls = []
    monkeypatch.setattr(ece_sim, "record_heldout", lambda *a: calls.append(a[2:]) or "trace")
    monkeypatch.setattr(expertflow.predictor.evaluate, "predict_trace", lambda predictor, trace, with_next: "probs")
    compute = tmp_path / "compute.jsonl"
    compute.write_text(json.dumps({"benchmark": "ece_sim", "timing": {"layer_ms": 0.5, "token_ms": 0.02}}) + "\n")
    args = argparse.Namespace(predictor=None, trace=None, split=None, compute_from=str(compute), ratio=8.0,
                              max_new_tokens=3, temperature=0.5, unseen_only=unseen_only)
    assert ece_sim.prepare(args, argparse.ArgumentParser())[:2] == ("trace", "probs")
    assert calls == [(3, 0.5, unseen_only)]
    recorded = {"max_new_tokens": 3, "temperature": 0.5, **({"unseen_only": True} if unseen_only else {})}
    assert ece_sim.source_config(args)["recorded"] == recorded


PROMPTS = [{"prompt": "The cat sat"}, {"prompt": "Once upon a time there was"}]


def test_ece_live_report_link_tokens_and_replay(ece_live, monkeypatch, capsys):
    """Compute fixed at 1 ms per layer at batch 1 (0.1 ms of it per row) and every generation timed at 0.5 s: the
    link copies an expert in --ratio x 1 ms, tokens/s count every row's new tokens, a run whose tokens differ from
    the unoffloaded ones is named and fails the script, and the replay of the recorded expertflow run uses the same
    link, the compute without its per-token part and the same policy options."""
    import torch

    import expertflow.models
    from expertflow import sim
    from expertflow.adapters import find_adapter

    monkeypatch.setattr(ece_live, "fit_layer_compute", lambda model, inputs, layers: (1.0, 0.1))
    monkeypatch.setattr(expertflow.models, "load_prompts", lambda split: PROMPTS)
    real_generate, calls = ece_live._generate, []

    def generate(model, inputs, new_tokens):
        out, _ = real_generate(model, inputs, new_tokens)
        calls.append(len(calls))
        if len(calls) == 2:  # the first wrapped run (lfu): as if its last token had come out differently
            out = out.clone()
            out[0, -1] = (out[0, -1] + 1) % model.config.vocab_size
        return out, 0.5

    monkeypatch.setattr(ece_live, "_generate", generate)
    replays, real_simulate = [], sim.simulate

    def simulate(*args, **kwargs):
        replays.append((args, kwargs, real_simulate(*args, **kwargs)))
        return replays[-1][2]

    monkeypatch.setattr(sim, "simulate", simulate)
    monkeypatch.setattr(sys, "argv", ["ece_live.py", "--batch", "2", "--max-new-tokens", "2", "--ratio", "6",
                                      "--policies", "lfu,expertflow",
                                      "--policy-kwargs", '{"waves": true, "margin": 8}'])
    with pytest.raises(SystemExit, match="ece_live: the tokens of lfu differ from the unoffloaded model's"):
        ece_live.main()
    report = json.loads(capsys.readouterr().out)
    slot_bytes = max(layer.layout.nbytes for layer in find_adapter(expertflow.models.tiny_moe(dtype=torch.float32))[1])
    assert (report["layer_compute_ms_batch1"], report["token_ms_per_layer"], report["transfer_ms"]) == (1.0, 0.1, 6.0)
    assert report["transfer_over_layer_compute"] == 6.0
    assert report["emulated_link_MB_per_s"] == round(slot_bytes / 0.006 / 1e6, 3)
    assert report["cache_slots"] == sim.capacity_from_fraction(0.5, 6, 32)
    assert report["full_model_tokens_per_s"] == 2 * 2 / 0.5
    lfu, ours = report["policies"]["lfu"], report["policies"]["expertflow"]
    assert (lfu["same_tokens_as_full"], ours["same_tokens_as_full"]) == (False, True)
    assert lfu["tokens_per_s"] == ours["tokens_per_s"] == 2 * 2 / 0.5, "every row's new tokens"
    assert report["best_baseline"] == "lfu" and report["speedup_vs_best_baseline"] == 1.0
    (args, kwargs, modeled), = replays
    policy, slots, timing = args[1:4]
    assert slots == report["cache_slots"]
    assert timing == sim.Timing(transfer_ms=6.0, layer_ms=0.9, token_ms=0.1)
    assert (policy.name, policy.waves, policy.margin) == ("expertflow", True, 8.0)
    assert report["simulated_expertflow_hit_rate"] == round(modeled.hit_rate, 4)
    assert report["live_minus_simulated_hit_rate"] == round(ours["hit_rate"] - modeled.hit_rate, 4)


def test_ece_live_best_baseline_is_the_fastest_baseline_not_the_waves_variant(ece_live, monkeypatch, capsys):
    """The best baseline is the fastest of those that ran, never lru-layer-waves; every run gets the link that copies
    an expert in --ratio (8) x the 1 ms of a layer's batch-1 compute, in bytes per second."""
    import torch

    import expertflow.models
    from expertflow.adapters import find_adapter

    speeds = {"lru": 10.0, "lfu": 20.0, "lru-layer-waves": 30.0, "expertflow": 25.0}
    links = []

    def live_run(model, inputs, reference, policy, slots, link, *args, **kwargs):
        links.append(link)
        return {"policy": policy, "tokens_per_s": speeds[policy], "same_tokens_as_full": True}, None, reference, []

    monkeypatch.setattr(ece_live, "fit_layer_compute", lambda model, inputs, layers: (1.0, 0.1))
    monkeypatch.setattr(ece_live, "check_predictor_fits", lambda *args: None)
    monkeypatch.setattr(ece_live, "live_run", live_run)
    monkeypatch.setattr(ece_live, "_generate", lambda model, inputs, n: (
        torch.cat([inputs["input_ids"], inputs["input_ids"][:, :n]], dim=1), 0.5))
    monkeypatch.setattr(expertflow.models, "load_prompts", lambda split: PROMPTS)
    monkeypatch.setattr(sys, "argv", ["ece_live.py", "--batch", "2", "--max-new-tokens", "2",
                                      "--policies", "lru,lfu,lru-layer-waves,expertflow"])
    ece_live.main()
    report = json.loads(capsys.readouterr().out)
    assert report["baselines_compared"] == ["lru", "lfu"] and report["best_baseline"] == "lfu"
    assert report["speedup_vs_best_baseline"] == 1.25 and report["speedup_vs_lru_layer_waves"] == round(25 / 30, 4)
    slot_bytes = max(layer.layout.nbytes for layer in find_adapter(expertflow.models.tiny_moe(dtype=torch.float32))[1])
    assert links == [pytest.approx(slot_bytes / 0.008)] * 4
    assert report["emulated_link_MB_per_s"] == round(slot_bytes / 0.008 / 1e6, 3)


def test_ece_live_flags_are_checked_before_any_work(ece_live, monkeypatch, capsys, tmp_path):
    assert ece_live._policies("lfu, expertflow,lfu") == ["lfu", "expertflow"]
    for bad, message in ((" , ", "names no policy"), ("lfu,nope", "unknown policy nope")):
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            ece_live._policies(bad)
    given = argparse.Namespace(plot=None, from_results=None, batch=16, max_new_tokens=32, ratio=8.0, fraction=1.5,
                               model=None, predictor=None, device="cpu")
    with pytest.raises(ValueError, match=r"--fraction 1.5 must be in \(0, 1\]"):
        ece_live._check(given)
    with pytest.raises(ValueError, match="policy expertflow with --model needs --predictor DIR"):
        ece_live._check_predictor(None, argparse.Namespace(policies=["lfu", "expertflow"], model="some/dir",
                                                           predictor=None))
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"benchmark": "ece_sim", "slots_per_layer": {}}))
    monkeypatch.setattr(sys, "argv", ["ece_live.py", "--from-results", str(other), "--plot", str(tmp_path / "p.png")])
    with pytest.raises(SystemExit) as exit_info:
        ece_live.main()
    assert exit_info.value.code == 2 and "is not the output of benchmarks/ece_live.py" in capsys.readouterr().err


def test_ece_live_refuses_a_ratio_that_would_hang_and_a_predictor_no_run_reads(ece_live, monkeypatch, capsys,
                                                                             tmp_path):
    import expertflow.models

    monkeypatch.setattr(expertflow.models, "tiny_moe", lambda **kwargs: pytest.fail("loaded before the flag check"))
    code, last = _exit(ece_live, monkeypatch, capsys, "--ratio", "1e300")
    assert code == 2 and last == ("ece_live.py: error: --ratio 1e+300 must be at most 1000 (one expert copy as long as "
                                  "that many layers' compute; 8 stands for Mixtral-8x7B over PCIe 4.0)")
    ece_live._check(argparse.Namespace(plot=None, from_results=None, policies=["lfu"], batch=16, max_new_tokens=32,
                                       ratio=1000.0, fraction=0.5, model=None, predictor=None, device="cpu"))
    code, last = _exit(ece_live, monkeypatch, capsys, "--policies", "lfu", "--predictor", str(tmp_path))
    assert code == 2 and last == (f"ece_live.py: error: --predictor {tmp_path} is read only by the expertflow policy, "
                                  "and --policies leaves it out: add expertflow to --policies, or drop --predictor")


def test_ece_live_names_a_model_it_cannot_load_or_offload_in_one_line(ece_live, monkeypatch, capsys, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from expertflow.models import tiny_moe_path

    for name in ("empty", "dense"):
        (tmp_path / name).mkdir()
        for file in tiny_moe_path().glob("tokenizer*"):
            (tmp_path / name / file.name).write_bytes(file.read_bytes())
    (tmp_path / "empty" / "config.json").write_text(json.dumps({"model_type": "mixtral"}))
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2)).save_pretrained(tmp_path / "dense")
    code, last = _exit(ece_live, monkeypatch, capsys, "--model", str(tmp_path / "empty"), "--policies", "lfu")
    assert code == 2 and last.startswith(f"ece_live.py: error: --model {tmp_path / 'empty'}: cannot load it as a "
                                         "Hugging Face causal LM")
    code, last = _exit(ece_live, monkeypatch, capsys, "--model", str(tmp_path / "dense"), "--policies", "lfu")
    assert code == 2 and last.startswith(f"ece_live.py: error: --model {tmp_path / 'dense'}: LlamaForCausalLM "
                                         "(model_type='llama') has no Mixture-of-Experts layers")


def _exit(ece_live, monkeypatch, capsys, *argv) -> tuple[int, str]:
    """benchmarks/ece_live.py run with `argv`, which must end it: (its exit status, the last line of its stderr)."""
    monkeypatch.setattr(sys, "argv", ["ece_live.py", *argv])
    with pytest.raises(SystemExit) as exit_info:
        ece_live.main()
    return exit_info.value.code, capsys.readouterr().err.strip().splitlines()[-1]


def _report(**changed) -> dict:
    """A made-up ece_live report with lfu, expertflow and lru-layer-waves, two steps of a two-layer cache of 8."""
    slots = {"lfu": [[4, 4], [3, 5]], "expertflow": [[4, 4], [2, 6]], "lru-layer-waves": [[4, 4], [4, 4]]}
    report = {"benchmark": "ece_live", "timing_note": "CPU, emulated link", "batch": 2, "cache_slots": 8,
              "policies": {name: {"tokens_per_s": 10.0 + i, "hit_rate": 0.4} for i, name in enumerate(slots)},
              "best_baseline": "lfu", "slots_per_layer": slots}
    return {k: v for k, v in {**report, **changed}.items() if v is not None}


def test_ece_live_redraws_a_report_and_refuses_one_it_cannot_draw_in_one_line(ece_live, monkeypatch, capsys,
                                                                             tmp_path):
    """--from-results draws a whole report; one that lacks a key, holds the wrong shapes or has no run of expertflow
    or a baseline (only lru-layer-waves) ends in one line naming the flag, the file and what to give (status 2)."""
    good = tmp_path / "good.json"
    good.write_text(json.dumps(_report()))
    monkeypatch.setattr(sys, "argv", ["ece_live.py", "--from-results", str(good), "--plot", str(tmp_path / "p.png")])
    ece_live.main()
    assert (tmp_path / "p.png").stat().st_size > 10_000
    waves = _report()["slots_per_layer"]["lru-layer-waves"]
    for name, report, why in (
            ("lacking", _report(slots_per_layer=None), "KeyError('slots_per_layer')"),
            ("list", _report(policies=[]), "TypeError"),
            ("waves", _report(best_baseline=None, slots_per_layer={"lru-layer-waves": waves}),
             "no run of expertflow or of a baseline (ran: lru-layer-waves)")):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(report))
        code, last = _exit(ece_live, monkeypatch, capsys, "--from-results", str(path), "--plot",
                           str(tmp_path / "q.png"))
        assert code == 2 and last.startswith(f"ece_live.py: error: --from-results {path}: cannot draw it ("), name
        assert why in last and last.endswith("give the whole output of benchmarks/ece_live.py, from a run with "
                                             "expertflow or a baseline in its --policies"), name
        assert not (tmp_path / "q.png").exists(), name


def test_ece_live_refuses_a_plot_of_lru_layer_waves_alone_before_any_work(ece_live, monkeypatch, capsys, tmp_path):
    """`plot` draws expertflow and the best baseline: --plot with only lru-layer-waves in --policies is refused
    before the model is loaded, and with either of the others beside it, or without --plot, it is not."""
    import expertflow.models

    monkeypatch.setattr(expertflow.models, "tiny_moe", lambda **kwargs: pytest.fail("loaded before the flag check"))
    png = str(tmp_path / "p.png")
    code, last = _exit(ece_live, monkeypatch, capsys, "--policies", "lru-layer-waves", "--plot", png)
    assert code == 2 and last == ("ece_live.py: error: --plot draws the slots of expertflow and of the best baseline, "
                                  "and --policies lru-layer-waves runs neither: add one of them to --policies, or "
                                  "drop --plot")
    for policies, plot in ((["lru-layer-waves"], None), (["lru-layer-waves", "lfu"], png),
                           (["expertflow", "lru-layer-waves"], png)):
        ece_live._check(argparse.Namespace(plot=plot, from_results=None, policies=policies, batch=16, max_new_tokens=32,
                                           ratio=8.0, fraction=0.5, model=None, predictor=None, device="cpu"))
