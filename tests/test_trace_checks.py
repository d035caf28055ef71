"""Checks around trace files and logs: `save` refuses what `load` would refuse, the importer tells a damaged routing
line from another record and refuses logs it would misread, `trace record` tags its trace with the prompts' task and
split, and the argument checks of `subset` / `rebatch`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from expertflow.cli import main
from expertflow.trace import Trace, TraceFormatError
from expertflow.trace_import import TraceImportError, import_jsonl


def _trace(**changes) -> Trace:
    experts = np.array([[[0, 1], [2, 3]], [[1, 2], [3, 0]], [[2, 3], [0, 1]]], dtype=np.int32)
    return Trace(**{"experts": experts, "num_experts": 4, "seq_ids": [0, 0, 1], "model": "toy"} | changes)


def _jsonl(tmp_path: Path, rows: list, name: str = "log.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


# -- save validates ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("change, message", [
    (lambda t: setattr(t, "steps", np.arange(t.num_tokens, dtype=np.int64)), "steps has dtype int64, expected int32"),
    (lambda t: setattr(t, "steps", list(range(t.num_tokens))), "steps is a list, not a NumPy array"),
    (lambda t: setattr(t, "num_experts", 2), r"expert ids must lie in \[-1, 2\)"),
    (lambda t: setattr(t, "layer_ids", [0, 0, 1]), "layer_ids has 3 entries for 2 MoE layers"),
    (lambda t: setattr(t, "experts", t.experts[:, :, 0]), r"experts must be \[N, L, K\]; got shape \(3, 2\)"),
    (lambda t: t.extra_metadata.update(note=3), "extra_metadata 'note': 3 \\(int\\): trace metadata keys and values "
                                                "are strings"),
    (lambda t: t.extra_metadata.update(top_k="1"), "extra_metadata key 'top_k' is one the format writes itself"),
    (lambda t: setattr(t, "model", Path("models/toy")), "model must be a string .*PosixPath|model must be a string"),
    (lambda t: setattr(t, "source", None), "source must be a string"),
    # a name given on a command line in bytes that are not UTF-8 (Python keeps them as lone surrogates)
    (lambda t: setattr(t, "model", "mix\udcfftral"), "metadata 'model': 'mix\\\\udcfftral' is not text a file can "
                                                     "store \\(not valid UTF-8\\); give the name in UTF-8"),
    (lambda t: t.extra_metadata.update({"n\ud800": "x"}), "metadata 'n\\\\ud800'"),
    (lambda t: setattr(t, "layer_ids", 3), "layer_ids must be a list of layer indices; got 3"),
    (lambda t: setattr(t, "layer_ids", "01"), "layer_ids must be a list of layer indices; got '01'"),
])
def test_save_refuses_what_load_would_refuse_and_leaves_the_old_file(tmp_path, change, message):
    path = tmp_path / "t.safetensors"
    _trace().save(path)
    before = path.read_bytes()
    trace = Trace.load(path)
    change(trace)
    with pytest.raises(TraceFormatError, match=message):
        trace.save(path)
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["t.safetensors"]
    Trace.load(path)


def test_layer_ids_set_as_numpy_integers_are_saved_as_a_json_list(tmp_path):
    trace = _trace()
    trace.layer_ids = np.array([1, 3])
    trace.save(tmp_path / "t.safetensors")
    assert Trace.load(tmp_path / "t.safetensors").layer_ids == [1, 3]


def test_a_truncated_file_is_named_as_such(tmp_path):
    path = tmp_path / "t.safetensors"
    _trace().save(path)
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    with pytest.raises(TraceFormatError, match=rf"t.safetensors is truncated \({len(data) - 10:,} of {len(data):,} "
                                               r"bytes\).*copy or write it again"):
        Trace.load(path)
    path.write_bytes(data[:40])
    with pytest.raises(TraceFormatError, match=r"is truncated \(40 bytes, fewer than its [\d,]+-byte header\)"):
        Trace.load(path)
    path.write_bytes(b"not a trace at all, some text")
    with pytest.raises(TraceFormatError, match="is not a safetensors file"):
        Trace.load(path)
    with pytest.raises(TraceFormatError, match="/dev/null is not a regular file"):
        Trace.load("/dev/null")
    path.write_bytes((40).to_bytes(8, "little") + b"not json")  # a small length, then no header: not cut, not ours
    with pytest.raises(TraceFormatError, match="is not a safetensors file"):
        Trace.load(path)
    header = b"[" * 10**5 + b"]" * 10**5  # nested past Python's recursion limit
    path.write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(TraceFormatError, match="is not a safetensors file"):
        Trace.load(path)


# -- subset / rebatch arguments ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("call, message", [
    (lambda t: t.subset([0.7]), r"a sequence id must be an integer; got 0.7"),
    (lambda t: t.subset(["1"]), r"a sequence id must be an integer; got '1'"),
    (lambda t: t.rebatch(True), r"batch_size must be an integer; got True"),
    (lambda t: t.rebatch(1.5), r"batch_size must be an integer; got 1.5"),
])
def test_subset_and_rebatch_refuse_non_integers(call, message):
    with pytest.raises(ValueError, match=message):
        call(_trace())


def test_subset_and_rebatch_take_numpy_integers():
    trace = _trace()
    assert trace.subset(np.array([1])).num_tokens == 1
    assert trace.rebatch(np.int64(2)).steps.tolist() == [0, 1, 0]


# -- the importer ----------------------------------------------------------------------------------------------------
def test_a_routing_line_marked_like_the_others_but_without_its_field_is_refused(tmp_path):
    rows = [{"type": "moe_routing", "layer": 0, "token_idx": t, "experts": [t]} for t in range(3)]
    rows.insert(1, {"type": "kv_event", "what": "evict"})  # another record: skipped
    trace = import_jsonl([_jsonl(tmp_path, rows)])
    assert trace.experts[:, 0, 0].tolist() == [0, 1, 2]
    rows[3] = {"type": "moe_routing", "layer": 0, "token_idx": 2, "expert_ids": [2]}
    with pytest.raises(TraceImportError, match="log.jsonl:4: field 'experts' is missing from a line marked "
                                               "type=\"moe_routing\", as the routing lines are \\(the first complete "
                                               "one is line 1\\)\\. Fix: give every routing line the 'experts' field"):
        import_jsonl([_jsonl(tmp_path, rows)])


def test_a_damaged_routing_line_before_the_first_complete_one_is_refused(tmp_path):
    entries = [{"layer_index": 0, "expert_ids": [1, 2]}]
    rows = [{"row_type": "header", "top_k": 2},
            {"row_type": "kv-event", "blocks": 3},
            {"row_type": "observed-dispatch", "request_id": "r", "token_index": 0, "routing_": entries},
            {"row_type": "observed-dispatch", "request_id": "r", "token_index": 1, "routing_": entries},
            {"row_type": "observed-dispatch", "request_id": "r", "token_index": 2, "routing": entries},
            {"row_type": "footer", "tokens": 3}]
    with pytest.raises(TraceImportError, match="log.jsonl:3: field 'routing' is missing from a line marked "
                                               "row_type=\"observed-dispatch\".*first complete one is line 5"):
        import_jsonl([_jsonl(tmp_path, rows)])  # the first of the damaged lines is named
    for row in rows[2:4]:
        row["routing"] = row.pop("routing_")
    assert import_jsonl([_jsonl(tmp_path, rows)]).num_tokens == 3


def test_a_nested_routing_line_without_its_field_no_longer_drops_the_token(tmp_path):
    """Each line marked as the routing lines are: the damaged one is named, not skipped (its token would vanish)."""
    rows = [{"row_type": "observed-dispatch", "request_id": "r", "token_index": t, "token_id": 100 + t,
             "routing": [{"layer_index": 0, "expert_ids": [t % 4, (t + 1) % 4]}]} for t in range(4)]
    rows[2]["routing_"] = rows[2].pop("routing")
    with pytest.raises(TraceImportError, match="log.jsonl:3: field 'routing' is missing"):
        import_jsonl([_jsonl(tmp_path, rows)])


@pytest.mark.parametrize("header, top_k, message", [
    ([], 4, r"top_k=4 \(--top-k\), but no routing line names more than 2 experts.*Fix: give --top-k 2"),
    ([], 3, r"top_k=3 \(--top-k\), but no routing line names more than 2 experts: every cell would have 1 missing"),
    ([{"row_type": "header", "top_k": 4}], None, r"top_k=4 \(the header's top_k\), but no routing line names more "
                                                 r"than 2 experts.*--top-k 2 .*or fix the header"),
])
def test_a_top_k_larger_than_every_expert_list_is_refused(tmp_path, header, top_k, message):
    rows = header + [{"layer": 0, "token_idx": t, "experts": [t, t + 1]} for t in range(3)]
    with pytest.raises(TraceImportError, match=message):
        import_jsonl([_jsonl(tmp_path, rows)], top_k=top_k)
    assert import_jsonl([_jsonl(tmp_path, rows)], top_k=2).top_k == 2


def test_rows_matched_by_order_must_be_complete_at_every_layer(tmp_path):
    """Without a token field the n-th row of a layer is token n: a row missing at layer 1 would shift the later ones."""
    rows = [{"request_id": "r0", "layer": l, "experts": [t + 4 * l]} for t in range(4) for l in range(2)]
    del rows[3]  # token 1's row at layer 1
    with pytest.raises(TraceImportError, match="log.jsonl: sequence \"r0\" has 4 rows at layer 0 but 3 at layer 1: "
                                               "without a token field.*Fix: name the token field with --token-field"):
        import_jsonl([_jsonl(tmp_path, rows)])
    for t, row in enumerate(rows):
        row["token_idx"] = [0, 0, 1, 2, 2, 3, 3][t]
    trace = import_jsonl([_jsonl(tmp_path, rows)])  # with one: the cell is missing, nothing shifts
    assert trace.experts[:, :, 0].tolist() == [[0, 4], [1, -1], [2, 6], [3, 7]]


def test_rows_matched_by_order_may_lack_only_the_last_tokens_of_a_log_cut_short(tmp_path):
    """A log that ends while the last token is still being logged shifts nothing: its missing cells are unknown."""
    rows = [{"request_id": "r0", "layer": l, "experts": [t + 4 * l]} for t in range(3) for l in range(3)]
    with pytest.warns(UserWarning, match="sequence \"r0\" has 3 rows at layer 0 but 2 at layer 1, all before the rows "
                                         r"it lacks \(a log cut short\?\)"):
        trace = import_jsonl([_jsonl(tmp_path, rows[:-2])])  # token 2 logged at layer 0 only
    assert trace.experts[:, :, 0].tolist() == [[0, 4, 8], [1, 5, 9], [2, -1, -1]]
    middle = rows[:4] + rows[5:]  # token 1's row at layer 1: the later rows of layer 1 would move onto it
    with pytest.raises(TraceImportError, match="has 3 rows at layer 0 but 2 at layer 1: without a token field"):
        import_jsonl([_jsonl(tmp_path, middle)])


@pytest.mark.parametrize("entries, message", [
    ([{"layer_index": 0, "expert_ids": [1]}, {"layer_index": 0, "expert_ids": [2]}],
     r"the routing list names layer 0 twice \(entries 0 and 1\)\. Fix: give each layer once, or name the layer field "
     r"with --layer-field"),
    ([{"layer_index": 1, "expert_ids": [1]}, {"expert_ids": [2]}],
     r"the routing list names layer 1 twice \(entries 0 and 1; an entry without a layer field stands for the layer "
     r"of its place"),
])
def test_a_routing_list_that_names_a_layer_twice_is_told_so(tmp_path, entries, message):
    rows = [{"request_id": "r", "token_index": 0, "routing": entries}]
    with pytest.raises(TraceImportError, match=f"log.jsonl:1: {message}"):
        import_jsonl([_jsonl(tmp_path, rows)])
    header = {"row_type": "header", "moe_layer_indices": [0, 1]}  # layers declared: the same message
    with pytest.raises(TraceImportError, match=f"log.jsonl:2: {message}"):
        import_jsonl([_jsonl(tmp_path, [header] + rows)])


def test_trace_help_names_both_log_shapes(capsys):
    with pytest.raises(SystemExit):
        main(["trace", "--help"])
    assert "per-(token, layer) or per-token JSONL routing logs" in " ".join(capsys.readouterr().out.split())


def test_an_existing_out_is_replaced_only_when_it_is_a_trace(tmp_path, capsys):
    log = _jsonl(tmp_path, [{"layer": 0, "token_idx": t, "experts": [t, t + 1]} for t in range(3)])
    weights = tmp_path / "model.safetensors"  # a model's weights, named by a slip
    from safetensors.numpy import save_file

    save_file({"w": np.ones(3, dtype=np.float32)}, str(weights))
    others = {weights: weights.read_bytes(), tmp_path / "notes.txt": b"keep me"}
    (tmp_path / "notes.txt").write_bytes(b"keep me")
    for path in others:
        for argv in (["trace", "import", "--input", str(log)],
                     ["trace", "record", "--model", "tiny-moe", "--prompts", str(log)]):
            assert main([*argv, "--out", str(path)]) == 2
            assert f"--out {path} exists and is not an expertflow trace; give another file name" in \
                capsys.readouterr().err
    assert all(path.read_bytes() == data for path, data in others.items())
    trace = tmp_path / "t.safetensors"
    _trace().save(trace)
    assert main(["trace", "import", "--input", str(log), "--out", str(trace)]) == 0  # a trace: replaced
    assert Trace.load(trace).num_tokens == 3
    from safetensors.numpy import save_file as save_older

    save_older({"experts": np.zeros((1, 1, 1), dtype=np.int32)}, str(trace), metadata={"format": "expertflow.trace/0"})
    assert main(["trace", "import", "--input", str(log), "--out", str(trace)]) == 0  # an older version's: replaced
    assert Trace.load(trace).num_tokens == 3
    placeholder = tmp_path / "empty.safetensors"  # made empty first, as out=$(mktemp) does
    placeholder.touch()
    assert main(["trace", "import", "--input", str(log), "--out", str(placeholder)]) == 0
    assert Trace.load(placeholder).num_tokens == 3


# -- recording ------------------------------------------------------------------------------------------------------
def test_recording_keeps_the_first_tokens_whatever_the_tokenizers_truncation_side():
    import torch
    from transformers import AutoTokenizer

    from expertflow.models import tiny_moe, tiny_moe_path
    from expertflow.recorder import record

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_moe_path()))
    prompt = "one two three four five six seven eight nine ten"
    first = tokenizer(prompt)["input_ids"][:4]
    tokenizer.truncation_side = "left"
    trace = record(tiny_moe(dtype=torch.float32).eval(), [prompt], tokenizer=tokenizer, max_new_tokens=1,
                   max_prompt_tokens=4, progress=False)
    assert trace.token_ids[trace.phase == 0].tolist() == first
    assert tokenizer.truncation_side == "left"  # given back as it came


def _char_tokenizer(bos: bool, mask: bool = True):
    """One token per character (ids 3..97), padding 0; a start token 1 only with `bos`; no attention mask in its
    output unless `mask`."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{chr(c): c - 29 for c in range(32, 127)}}
    inner = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    inner.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    if bos:
        inner.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=inner, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   model_input_names=["input_ids", "attention_mask"] if mask else ["input_ids"])


@pytest.mark.parametrize("prompts, batch_size, numbers", [([""], 1, "number 1,"), (["", "hello"], 2, "number 1,"),
                                                          (["hello", ""], 1, "number 2,")])
def test_a_prompt_that_gives_no_tokens_is_refused_before_anything_is_generated(prompts, batch_size, numbers,
                                                                                 monkeypatch):
    """An empty text with a tokenizer that adds no start token: its row would be all padding (at batch 1 a failure
    inside attention, after the batches before it were generated; in a batch, made-up tokens recorded)."""
    import torch

    from expertflow.recorder import record
    from families import make_tiny

    model = make_tiny("qwen3_moe")
    calls = []
    monkeypatch.setattr(type(model), "generate", lambda self, **kw: calls.append(kw) or torch.zeros(1, 1))
    with pytest.raises(ValueError, match=f"^1 of the {len(prompts)} prompts give no tokens with this tokenizer "
                                         rf"\(an empty text, and it adds no start token\): {numbers} counting"):
        record(model, prompts, _char_tokenizer(bos=False), batch_size=batch_size, max_new_tokens=2, progress=False)
    assert calls == []
    monkeypatch.undo()
    trace = record(model, prompts, _char_tokenizer(bos=True), batch_size=batch_size, max_new_tokens=2,
                   progress=False)  # with a start token an empty text is one token
    assert trace.token_ids[(trace.seq_ids == prompts.index("")) & (trace.phase == 0)].tolist() == [1]


def test_a_tokenizer_that_returns_no_attention_mask_still_records():
    from expertflow.recorder import record
    from families import make_tiny

    model = make_tiny("qwen3_moe")
    plain = record(model, ["ab", "hello"], _char_tokenizer(bos=True), batch_size=2, max_new_tokens=3, progress=False)
    trace = record(model, ["ab", "hello"], _char_tokenizer(bos=True, mask=False), batch_size=2, max_new_tokens=3,
                   progress=False)
    assert trace.num_tokens == plain.num_tokens and int((trace.phase == 0).sum()) == 3 + 6  # the prompts, with <s>
    np.testing.assert_array_equal(trace.experts, plain.experts)
    np.testing.assert_array_equal(trace.token_ids, plain.token_ids)


def test_a_tokenizer_that_names_no_padding_or_end_token_pads_with_another_and_records_the_same():
    """No pad, end-of-sequence or unknown token (a model whose config and tokenizer name none): the recorder and the
    demo pad with the token of id 0 (padding is masked out and never recorded); the tokenizer is given back as it
    came."""
    from transformers import PreTrainedTokenizerFast

    import expertflow.demo as demo
    from expertflow.recorder import record
    from families import make_tiny

    bare = PreTrainedTokenizerFast(tokenizer_object=_char_tokenizer(bos=True).backend_tokenizer)
    assert (bare.pad_token, bare.eos_token, bare.unk_token) == (None, None, None)
    model = make_tiny("qwen3_moe")
    plain = record(model, ["ab", "hello"], _char_tokenizer(bos=True), batch_size=2, max_new_tokens=3, progress=False)
    trace = record(model, ["ab", "hello"], bare, batch_size=2, max_new_tokens=3, progress=False)
    assert bare.pad_token is None
    np.testing.assert_array_equal(trace.token_ids, plain.token_ids)
    np.testing.assert_array_equal(trace.experts, plain.experts)
    inputs = demo.demo_inputs(bare, model.config.vocab_size)
    assert inputs["input_ids"].shape[0] > 1 and bare.pad_token == "<pad>"  # the token of id 0


def test_trace_record_stores_the_task_and_split_the_predictor_selects_by(tmp_path, capsys):
    from expertflow.predictor.data import load_traces

    prompts = _jsonl(tmp_path, [{"id": f"p{i}", "task": "chat", "split": split, "prompt": f"hello number {i}"}
                                for i, split in enumerate(["train", "test", "test"])], "prompts.jsonl")
    out = tmp_path / "chat-test.safetensors"
    assert main(["trace", "record", "--model", "tiny-moe", "--prompts", str(prompts), "--split", "test",
                 "--max-new-tokens", "2", "--batch-size", "2", "--out", str(out)]) == 0
    capsys.readouterr()
    assert Trace.load(out).extra_metadata == {"task": "chat", "split": "test"}
    assert load_traces([out], tasks=["chat"], split="test").num_tokens == Trace.load(out).num_tokens
    mixed = _jsonl(tmp_path, [{"id": "a", "task": "chat", "prompt": "hi"}, {"id": "b", "task": "code", "prompt": "x"}],
                   "mixed.jsonl")
    assert main(["trace", "record", "--model", "tiny-moe", "--prompts", str(mixed), "--max-new-tokens", "1",
                 "--out", str(tmp_path / "mixed.safetensors")]) == 0
    assert Trace.load(tmp_path / "mixed.safetensors").extra_metadata == {}  # no one task, no split: none stored


@pytest.mark.parametrize("rows", [[{"task": 7}, {"task": 7}], [{"split": ""}], [{"task": "chat"}, {}],
                                  [{"task": ["chat"]}], [{"split": None}]])
def test_a_task_or_split_that_is_not_one_non_empty_string_is_not_stored(rows):
    """Trace metadata values are strings: storing another would make the save after the recording fail."""
    from expertflow.commands.trace import _shared_fields

    assert _shared_fields(rows) == {}
    assert _shared_fields([{"task": 7, "split": "test"}] * 2) == {"split": "test"}  # the good one is still stored


def test_a_model_with_two_experts_modules_in_one_layer_is_refused_by_the_recorder_naming_them():
    """Side-by-side experts (text and vision ones, say) would give the trace one layer id twice."""
    import copy

    import torch

    from expertflow.recorder import RouteRecorder
    from families import make_tiny

    model = make_tiny("mixtral")
    mlp = model.model.layers[1].mlp
    mlp.vision_experts = copy.deepcopy(mlp.experts)  # never run by the text path
    with pytest.raises(ValueError, match=r"experts modules model\.layers\.1\.mlp\.experts, "
                                         r"model\.layers\.1\.mlp\.vision_experts sit in the same model layer"):
        RouteRecorder(model)
    del mlp.vision_experts
    with RouteRecorder(model) as recorder, torch.no_grad():
        model(input_ids=torch.tensor([[5, 6, 7]]))
    assert len(recorder.per_step()) == 1
    first = model.model.layers[0].mlp  # in the first MoE layer, and in a wrapped model: the same refusal
    first.vision_experts = copy.deepcopy(first.experts)
    import expertflow

    expertflow.wrap(model, cache_slots=2, device="cpu")
    try:
        with pytest.raises(ValueError, match=r"experts modules model\.layers\.0\.mlp\.experts, "
                                             r"model\.layers\.0\.mlp\.vision_experts sit in the same model layer"):
            RouteRecorder(model)
    finally:
        expertflow.unwrap(model)
