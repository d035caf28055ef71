"""The demo's parts (`expertflow.demo`): its prompts, the calibration of the emulated link, the checks made before any
run, and a report whose figures add up. The built-in demo itself is not run here: tiny saved models with two new
tokens and a fixed layer time stand in for it."""

from __future__ import annotations

import pytest
import torch

import expertflow
import expertflow.demo as demo
from families import make_tiny


def test_demo_inputs_are_left_padded_whatever_the_tokenizer_says():
    from transformers import AutoTokenizer

    from expertflow.models import tiny_moe_path

    tokenizer = AutoTokenizer.from_pretrained(tiny_moe_path())
    tokenizer.padding_side = "right"
    mask = demo.demo_inputs(tokenizer, tokenizer.vocab_size)["attention_mask"]
    assert not bool(mask[:, 0].all())  # the prompts differ in length: some rows are padded
    assert bool(mask[:, -1].all())  # on the left, so that every row's last token is real


# -- calibration ------------------------------------------------------------------------------------------------------

def test_decode_step_time_is_the_median_gap_between_steps(monkeypatch):
    clock = iter([0.0, 0.001, 0.003, 0.006, 0.010])  # gaps 1, 2, 3, 4 ms

    class Model:
        def generate(self, max_new_tokens, stopping_criteria, **kwargs):
            ids = torch.zeros(1, 1, dtype=torch.long)
            for _ in range(max_new_tokens):
                stopping_criteria(ids, None)

    monkeypatch.setattr(demo.time, "perf_counter", lambda: next(clock))
    assert demo.decode_step_ms(Model(), {}, steps=4) == pytest.approx(3.0)


@pytest.mark.parametrize("one, four, expected", [
    ([10.0] * 6, [16.0] * 6, (5.0, 1.0)),  # 2 MoE layers: 5 ms a layer at batch 1, (8 - 5) / 3 more a row
    ([10.0] * 6, [8.0] * 6, (5.0, 0.0)),  # a batch that ran faster: no negative extra cost
])
def test_layer_compute_is_per_layer_at_batch_1_with_the_extra_cost_per_row(monkeypatch, one, four, expected):
    times = {1: iter(one), 4: iter(four)}
    monkeypatch.setattr(demo, "decode_step_ms", lambda model, inputs, steps=12: next(times[len(inputs["input_ids"])]))
    assert demo.fit_layer_compute(None, {"input_ids": torch.zeros(4, 3)}, 2) == pytest.approx(expected)


# -- checks before any run --------------------------------------------------------------------------------------------

def test_a_given_predictor_lets_a_given_model_run_expertflow(tmp_path):
    demo.check_policies(("full", "expertflow"), str(tmp_path), str(tmp_path / "predictor"))  # no refusal


def test_checking_the_predictor_leaves_the_model_unwrapped():
    from expertflow.models import tiny_moe
    from expertflow.runtime import runtime_of

    model = tiny_moe(dtype=torch.float32).eval()
    demo.check_predictor_fits(model, ("full", "expertflow"), None)
    with pytest.raises(expertflow.WrapError, match="is not wrapped"):
        runtime_of(model)


def test_run_demo_refuses_an_infinite_transfer_ratio_before_loading(tmp_path, monkeypatch):
    monkeypatch.setattr(demo, "load_demo_model", lambda path: pytest.fail("loaded a model"))
    with pytest.raises(ValueError, match="transfer_ratio=inf must be a number above 0"):
        demo.run_demo(str(tmp_path), ("lru",), transfer_ratio=float("inf"))
    with pytest.raises(ValueError, match="transfer_ratio=1001 must be a number above 0 and at most 1000"):
        demo.run_demo(str(tmp_path), ("lru",), transfer_ratio=1001)  # a link so slow a run seems to hang


def test_run_demo_names_the_model_of_a_dense_one(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    dense = tmp_path / "dense"
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2)).save_pretrained(dense)
    with pytest.raises(ValueError, match=f"^--model {dense}: LlamaForCausalLM \\(model_type='llama'\\) has no "
                                         "Mixture-of-Experts layers"):
        demo.run_demo(str(dense), ("lru",), max_new_tokens=1)


def test_a_model_directory_with_damaged_weights_or_another_models_tokenizer_is_one_clear_error(tmp_path, capsys):
    from transformers import AutoTokenizer

    from expertflow.cli import main
    from expertflow.models import tiny_moe_path
    from expertflow.recorder import record

    model = make_tiny("mixtral")
    model.save_pretrained(tmp_path / "m")
    AutoTokenizer.from_pretrained(str(tiny_moe_path())).save_pretrained(tmp_path / "m")  # ids far past its vocabulary
    with pytest.raises(ValueError, match=rf"^--model {tmp_path / 'm'}: the tokenizer gives token ids up to \d+, but "
                                         rf"the model's input embedding has {model.config.vocab_size} rows: it is "
                                         "another model's tokenizer"):
        demo.run_demo(str(tmp_path / "m"), ("lru",), max_new_tokens=1)
    with pytest.raises(ValueError, match="it is another model's tokenizer"):
        record(model.eval(), ["hello there"], AutoTokenizer.from_pretrained(str(tmp_path / "m")), max_new_tokens=1,
               progress=False)
    from expertflow.recorder import check_token_ids

    class Unsaid(torch.nn.Module):  # a model that does not say where its embedding is, as transformers' default
        def get_input_embeddings(self):
            raise NotImplementedError

    check_token_ids(torch.tensor([[10**6]]), Unsaid())  # not checked, not failed
    rows = model.get_input_embeddings().num_embeddings
    with pytest.raises(ValueError, match=f"token ids up to {rows}, but the model's input embedding has {rows} rows"):
        check_token_ids(torch.tensor([[0, rows]]), model)
    check_token_ids(torch.tensor([[0, rows - 1]]), model)  # the last row: fine
    check_token_ids(torch.zeros(1, 0, dtype=torch.long), model)  # no tokens: nothing to check
    tokenizer_json = tmp_path / "m" / "tokenizer.json"
    whole = tokenizer_json.read_text()
    for damaged in (whole[:500], "{}"):  # cut short; a JSON object without the tokenizer's fields (a KeyError)
        tokenizer_json.write_text(damaged)
        with pytest.raises(ValueError, match=rf"^--model {tmp_path / 'm'}: cannot load its tokenizer \(.*\); save "
                                             "it beside the model again"):
            demo.load_demo_model(str(tmp_path / "m"))
        with pytest.raises(ValueError, match=r"cannot load the tokenizer of .*; save it beside the model "
                                             r"\(tokenizer\.save_pretrained\(DIR\)\), or from Python pass"):
            model.name_or_path = str(tmp_path / "m")  # where record looks for the tokenizer
            record(model.eval(), ["hello there"], max_new_tokens=1, progress=False)
    from transformers import AutoTokenizer as Auto

    for error in (PermissionError(13, "Permission denied"), TypeError("bos_token must be a string")):
        def refuses(*args, error=error, **kwargs):
            raise error

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(Auto, "from_pretrained", refuses)
            with pytest.raises(ValueError, match=f"cannot load its tokenizer \\(.*{error.args[-1]}"):
                demo.load_demo_model(str(tmp_path / "m"))
    weights = tmp_path / "m" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # a download cut short
    with pytest.raises(ValueError, match=rf"^--model {tmp_path / 'm'}: its weights cannot be read \(.*\); a weights "
                                         "file is damaged or incomplete: download or save the model again"):
        demo.load_demo_model(str(tmp_path / "m"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "hello"}\n')
    assert main(["trace", "record", "--model", str(tmp_path / "m"), "--prompts", str(prompts), "--out",
                 str(tmp_path / "t.safetensors")]) == 2
    assert "its weights cannot be read (Error while deserializing header" in capsys.readouterr().err
    assert not (tmp_path / "t.safetensors").exists()


@pytest.mark.parametrize("dtype, said", [(torch.float32, ""), (torch.bfloat16, " (saved in bfloat16, run in float32)")])
def test_a_model_saved_in_another_dtype_is_run_in_float32_and_said_so(tmp_path, dtype, said):
    make_tiny("qwen2_moe").to(dtype).save_pretrained(tmp_path)
    model, _, description = demo.load_demo_model(str(tmp_path))
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert description == str(tmp_path) + said


# -- runs and the report ----------------------------------------------------------------------------------------------

def test_run_demo_report_adds_up(tmp_path, monkeypatch):
    make_tiny("qwen2_moe").save_pretrained(tmp_path)  # no tokenizer: four rows of random ids
    monkeypatch.setattr(demo, "calibrate_layer_ms", lambda *args: 2.0)
    real_stats, loads = expertflow.stats, []

    def stats(model):
        s = real_stats(model)
        loads.append(s.loads)
        return s

    monkeypatch.setattr(expertflow, "stats", stats)
    report = demo.run_demo(str(tmp_path), ("lru",), (0.5,), max_new_tokens=2, transfer_ratio=4.0, quiet=True)
    model = demo.load_demo_model(str(tmp_path))[0]
    full = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    assert any(True for _ in model.buffers())  # buffers count in the full model's bytes
    assert report["emulated_link_bytes_per_s"] == pytest.approx(report["expert_bytes"] / (4.0 * 2.0 / 1000))
    [run] = report["runs"]  # no "full" row when it is not asked for
    assert run["policy"] == "lru" and run["matches_full"]
    assert run["new_tokens"] == report["batch_size"] * 2 == 8
    assert run["full_bytes"] == full and run["device_bytes"] < full
    assert run["device_fraction"] == pytest.approx(run["device_bytes"] / full)
    assert run["loads_per_token"] == pytest.approx(loads[-1] / 8)
    assert run["on_demand_rate"] is not None and 0 < run["on_demand_rate"] <= 1


def test_the_demo_table_shows_the_cache_share_without_rounding_it_away():
    from expertflow.commands.demo import _table

    run = dict(policy="lru", slots=1, hit_rate=0.5, loads_per_token=1.0, on_demand_rate=0.5, device_bytes=1e6,
               device_fraction=0.5, tokens_per_s=1.0, matches_full=True)
    report = dict(model="m", moe_layers=2, experts=192, batch_size=1, max_new_tokens=1, transfer_over_compute=8.0,
                  layer_compute_ms=1.0, emulated_link_bytes_per_s=1e6,
                  runs=[dict(run, cache_fraction=f) for f in (0.001, 0.125, 0.25)])
    cache = [line.split()[1] for line in _table(report).splitlines()[-3:]]
    assert cache == ["0.1%", "12.5%", "25%"]  # were 0% (of a cache with a slot) and 12%


def test_run_demo_full_row_counts_the_tokens_of_every_row(tmp_path, monkeypatch):
    make_tiny("mixtral").save_pretrained(tmp_path)  # no tokenizer: four rows of random ids
    monkeypatch.setattr(demo, "calibrate_layer_ms", lambda *args: 2.0)
    report = demo.run_demo(str(tmp_path), ("full",), (0.5,), max_new_tokens=2, quiet=True)
    [full] = report["runs"]
    assert full["policy"] == "full" and full["new_tokens"] == report["batch_size"] * 2 == 8


def test_an_offloaded_run_whose_tokens_differ_does_not_match():
    model = make_tiny("mixtral")
    inputs = demo.demo_inputs(None, model.config.vocab_size, num_prompts=2)
    wrong = torch.zeros(inputs["input_ids"].shape[0], inputs["input_ids"].shape[1] + 2, dtype=torch.long)
    run = demo._offloaded_run(model, inputs, wrong, "lru", 0.5, 8, 1e12, 2, 1, True)
    assert run.matches_full is False


def test_generate_shows_no_progress_when_quiet(capsys):
    model = make_tiny("mixtral")
    inputs = demo.demo_inputs(None, model.config.vocab_size, num_prompts=1)
    demo._generate(model, inputs, 2, "full", quiet=True)
    assert capsys.readouterr().err == ""
    demo._generate(model, inputs, 2, "full", quiet=False)
    assert "full" in capsys.readouterr().err

