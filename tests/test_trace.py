"""The trace format: save/load round trip, validation errors, the request view, rebatch, subset and stats."""

from __future__ import annotations

import json
import re
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

import expertflow.trace as trace_module
from expertflow.trace import FORMAT, Trace, TraceFormatError


def _two_sequences() -> Trace:
    # seq 0: a prefill step of 2 tokens, then 2 decode tokens; seq 1: 2 decode tokens. L = 2, K = 2, E = 4.
    experts = np.array([
        [[0, 1], [2, 3]],
        [[1, 2], [3, -1]],
        [[0, 1], [2, 3]],
        [[-1, -1], [0, 1]],
        [[3, 2], [1, 0]],
        [[2, 3], [1, 2]],
    ], dtype=np.int32)
    return Trace(experts=experts, num_experts=4, token_ids=[5, 6, 7, 8, 9, 10], seq_ids=[0, 0, 0, 0, 1, 1],
                 positions=[0, 1, 2, 3, 0, 1], steps=[0, 0, 1, 2, 3, 4], phase=[0, 0, 1, 1, 1, 1],
                 gate_probs=np.full(experts.shape, 0.5), model="tiny", layer_ids=[1, 3], source="hand-made")


def test_save_load_round_trip(tmp_path):
    trace = _two_sequences()
    path = tmp_path / "t.safetensors"
    trace.save(path)
    back = Trace.load(path)
    for name in ("experts", "token_ids", "seq_ids", "positions", "steps", "phase", "gate_probs"):
        np.testing.assert_array_equal(getattr(back, name), getattr(trace, name))
    assert back.experts.dtype == np.int32 and back.phase.dtype == np.uint8 and back.gate_probs.dtype == np.float16
    assert (back.model, back.layer_ids, back.source, back.num_experts) == ("tiny", [1, 3], "hand-made", 4)
    assert back.metadata()["format"] == FORMAT and json.loads(back.metadata()["layer_ids"]) == [1, 3]


def test_the_same_trace_saves_as_the_same_bytes(tmp_path):
    """safetensors writes the metadata in another order each time: the same trace is saved in key order, with
    non-ASCII and escaped text as it was, and reads back the same."""
    trace = _two_sequences()
    trace.model, trace.extra_metadata = "modèle \"x\"\n", {"task": "chat", "split": "test"}
    files = [tmp_path / f"{i}.safetensors" for i in range(6)]
    for path in files:
        trace.save(path)
    assert len({path.read_bytes() for path in files}) == 1
    size = int.from_bytes(files[0].read_bytes()[:8], "little")
    meta = json.loads(files[0].read_bytes()[8:8 + size])["__metadata__"]
    assert list(meta) == sorted(meta) and meta == trace.metadata()
    back = Trace.load(files[0])
    assert (back.model, back.extra_metadata) == (trace.model, trace.extra_metadata)
    np.testing.assert_array_equal(back.experts, trace.experts)


def _write(path, tensors, **meta):
    metadata = {"format": FORMAT, "model": "m", "num_layers": "2", "num_experts": "4", "top_k": "2",
                "layer_ids": "[0, 1]", "source": "s"}
    metadata.update(meta)
    save_file(tensors, str(path), metadata={k: v for k, v in metadata.items() if v is not None})


def _tensors(n: int = 3) -> dict[str, np.ndarray]:
    return {"experts": np.tile(np.array([[0, 1], [2, 3]], np.int32), (n, 1, 1)), "token_ids": np.zeros(n, np.int32),
            "seq_ids": np.zeros(n, np.int32), "positions": np.arange(n, dtype=np.int32),
            "steps": np.arange(n, dtype=np.int32), "phase": np.ones(n, np.uint8)}


@pytest.mark.parametrize("change, message", [
    (lambda t, m: m.update(format="other/2"), "expected 'expertflow.trace/1'"),
    (lambda t, m: t.pop("steps"), "lacks steps"),
    (lambda t, m: m.update(top_k=None), "lacks top_k"),
    (lambda t, m: t.update(steps=np.arange(4, dtype=np.int32)), "steps must have shape"),
    (lambda t, m: t.update(seq_ids=np.zeros(3, np.int64)), "seq_ids is stored as I64, expected I32"),
    (lambda t, m: m.update(num_layers="3"), "metadata says num_layers=3"),
    (lambda t, m: m.update(top_k="3"), "metadata says num_layers=2, top_k=3"),  # the header must match [N, L, K]
    (lambda t, m: t.update(experts=np.full((3, 2, 2), 4, np.int32)), "is num_experts right?"),
    # each metadata value named with what is wrong with it
    (lambda t, m: m.update(num_experts="32.0"), "metadata num_experts='32.0' is not an integer"),
    (lambda t, m: m.update(layer_ids="0,1"), "metadata layer_ids='0,1' must be a JSON list"),
    # more experts than any model has: the statistics would try to allocate terabytes
    (lambda t, m: m.update(num_experts=str(10**11)), "num_experts=100000000000 is more than a trace can hold "
                                                      "(65,536); give the model's expert count (the largest expert "
                                                      "id here is 3)"),
])
def test_load_rejects_malformed_files(tmp_path, change, message):
    tensors, meta = _tensors(), {}
    change(tensors, meta)
    path = tmp_path / "bad.safetensors"
    _write(path, tensors, **meta)
    with pytest.raises(TraceFormatError, match=re.escape(message)):
        Trace.load(path)


def test_load_ignores_unknown_tensors_and_checks_dtypes_before_reading(tmp_path):
    import torch
    from safetensors.torch import save_file as save_torch

    tensors = {name: torch.from_numpy(array) for name, array in _tensors().items()}
    meta = {"format": FORMAT, "model": "m", "num_layers": "2", "num_experts": "4", "top_k": "2",
            "layer_ids": "[0, 1]", "source": "s"}
    save_torch(tensors | {"hidden": torch.zeros(3, 2, dtype=torch.bfloat16)}, str(tmp_path / "extra.safetensors"),
               metadata=meta)  # NumPy has no bfloat16: an unread extra must not matter
    assert Trace.load(tmp_path / "extra.safetensors").gate_probs is None
    save_torch(tensors | {"gate_probs": torch.zeros(3, 2, 2, dtype=torch.bfloat16)},
               str(tmp_path / "bf16.safetensors"), metadata=meta)
    with pytest.raises(TraceFormatError, match=r"gate_probs is stored as BF16, expected F16 \(float16\)"):
        Trace.load(tmp_path / "bf16.safetensors")


def test_load_rejects_missing_and_foreign_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Trace.load(tmp_path / "none.safetensors")
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file at all")
    with pytest.raises(TraceFormatError, match="not a safetensors file"):
        Trace.load(junk)


def test_defaults_make_one_decode_sequence_of_single_token_steps():
    trace = Trace(experts=np.zeros((3, 1, 1), np.int64), num_experts=2)
    assert trace.steps.tolist() == [0, 1, 2] and trace.seq_ids.tolist() == [0, 0, 0]
    assert trace.phase.tolist() == [1, 1, 1] and trace.token_ids.tolist() == [-1, -1, -1]
    assert trace.layer_ids == [0] and trace.experts.dtype == np.int32


def test_requests_are_step_major_with_sorted_distinct_experts():
    got = [(r.step, r.layer, r.experts, r.tokens) for r in _two_sequences().requests()]
    assert got == [
        (0, 0, (0, 1, 2), 2), (0, 1, (2, 3), 2),
        (1, 0, (0, 1), 1), (1, 1, (2, 3), 1),
        (2, 0, (), 1), (2, 1, (0, 1), 1),
        (3, 0, (2, 3), 1), (3, 1, (0, 1), 1),
        (4, 0, (2, 3), 1), (4, 1, (1, 2), 1),
    ]
    first = next(iter(_two_sequences().requests()))
    assert first.routes == ((0, 1), (1, 2))  # per token, top-k order


def test_requests_list_a_steps_tokens_by_sequence_then_position():
    """`requests()` lists the tokens inside a step in (sequence, position) order, the order in which
    `sim.step_predictions` gives their predictions."""
    from expertflow.sim import step_predictions

    # one prefill step of two sequences, two tokens each, stored position-major; each token names expert = its row
    trace = Trace(experts=np.arange(4, dtype=np.int32).reshape(4, 1, 1), num_experts=4, seq_ids=[0, 1, 0, 1],
                  positions=[0, 0, 1, 1], steps=[0, 0, 0, 0], phase=[0, 0, 0, 0])
    request = next(trace.requests())
    assert request.routes == ((0,), (2,), (1,), (3,))
    per_step = step_predictions(trace, np.eye(4)[:, None, :])[0]  # token i predicts expert i
    assert [int(p.argmax()) for p in per_step] == [route[0] for route in request.routes]


def test_rebatch_interleaves_sequences_step_by_step():
    trace = _two_sequences().rebatch(2)
    # seq 0 has 3 distinct steps (prefill, decode, decode), seq 1 has 2: both start at step 0.
    assert trace.steps.tolist() == [0, 0, 1, 2, 0, 1]
    assert [len(r.routes) for r in trace.requests() if r.layer == 0] == [3, 2, 1]
    assert _two_sequences().rebatch(1).steps.tolist() == [0, 0, 1, 2, 3, 4]


def test_rebatch_groups_follow_one_another():
    trace = Trace(experts=np.zeros((7, 1, 1), np.int32), num_experts=1, seq_ids=[0, 0, 1, 2, 2, 2, 3],
                  steps=[0, 1, 2, 3, 4, 5, 6])
    assert trace.rebatch(2).steps.tolist() == [0, 1, 0, 2, 3, 4, 2]


def test_rebatch_ranks_a_sequences_steps_by_step_not_by_position():
    """Within a sequence, each distinct original step gets its rank; positions play no part (here a producer that
    did not know them wrote 0 for all, and the rows are not in step order)."""
    trace = Trace(experts=np.zeros((3, 1, 1), np.int32), num_experts=1, seq_ids=[0, 0, 0], positions=[0, 0, 0],
                  steps=[7, 3, 5])
    assert trace.rebatch(1).steps.tolist() == [2, 0, 1]


def test_subset_keeps_the_chosen_sequences():
    sub = _two_sequences().subset([1])
    assert sub.token_ids.tolist() == [9, 10] and sub.steps.tolist() == [3, 4]
    with pytest.raises(ValueError, match=r"sequence ids \[7\] are not in the trace"):
        _two_sequences().subset([7])


def test_stats_by_hand():
    stats = _two_sequences().stats()
    assert (stats["tokens"], stats["sequences"], stats["steps"], stats["missing_cells"]) == (6, 2, 5, 1)
    assert stats["phases"] == {"prefill": 2, "decode": 4}
    # layer 0 counts: e0 2, e1 3, e2 3, e3 2 -> max 3 / mean 2.5; layer 1: e0 2, e1 3, e2 3, e3 3 -> 3 / 2.75
    assert stats["load_max_over_mean"]["per_layer"] == [1.2, round(3 / 2.75, 4)]
    # layer 0 pairs: (01,12)->1/2, (12,01)->1/2, (01,--) skipped, (32,23)->2/2; layer 1: (23,3)->1/2, (3,23)->1/2,
    # (23,01)->0, (10,12)->1/2
    assert stats["temporal_overlap"]["per_layer"] == [round(2 / 3, 4), 0.375]
    # layer 0 distinct per step: 3, 2, (missing: left out), 2, 2 -> 2.25; layer 1: 2, 2, 2, 2, 2 -> 2
    assert stats["distinct_experts_per_step"]["per_layer"] == [2.25, 2.0]


def test_stats_count_the_distinct_steps_of_a_subset():
    """`steps` is the number of forward steps in the trace: a subset keeps its steps as they were (3 and 4 here), so
    they need not start at 0."""
    assert _two_sequences().subset([1]).stats()["steps"] == 2


def test_distinct_experts_per_step_leaves_out_steps_with_no_known_expert():
    """-1 is ignored everywhere: a (step, layer) whose cells are all missing is no step that needed 0 experts."""
    experts = np.array([[[1, 2], [-1, -1]], [[-1, -1], [-1, -1]], [[0, -1], [-1, -1]]])
    distinct = Trace(experts=experts, num_experts=4).stats()["distinct_experts_per_step"]
    assert distinct == {"mean": 1.5, "per_layer": [1.5, None]}  # layer 1 names no expert at all


def test_distinct_experts_per_step_mean_is_over_the_step_layer_pairs_that_name_one():
    """Layer 0 names 2 experts at one step of three, layer 1 one expert at each: 5 experts over 4 pairs, not the
    mean of the layers' means (1.5)."""
    experts = np.array([[[0], [1]], [[1], [1]], [[-1], [1]], [[-1], [1]]])
    trace = Trace(experts=experts, num_experts=4, steps=[0, 0, 1, 2])
    assert trace.stats()["distinct_experts_per_step"] == {"mean": 1.25, "per_layer": [2.0, 1.0]}


def test_an_expert_named_twice_in_a_row_is_kept_and_requested_once():
    """A hash router (DeepSeek-V4's takes experts from a fixed table, which may repeat) can name one expert twice for
    a token: the trace holds the routing as the model computed it, and the step needs that expert once."""
    trace = Trace(experts=np.array([[[2, 2]], [[2, 0]]]), num_experts=4, steps=[0, 0])
    assert trace.experts[0, 0].tolist() == [2, 2]
    assert [r.experts for r in trace.requests()] == [(0, 2)]
    # |A ∩ B| / top-k for consecutive tokens counts a shared expert once, in either order: {2} / 2
    for experts in ([[[2, 2]], [[2, 0]]], [[[2, 0]], [[2, 2]]]):
        overlap = Trace(experts=np.array(experts), num_experts=4, steps=[0, 1]).stats()["temporal_overlap"]
        assert overlap["per_layer"] == [0.5]
    # the token count per expert counts the token once: e2 1, e0 1, e1 1, e3 0 -> max 1 / mean 0.75
    balance = Trace(experts=np.array([[[2, 2]], [[0, 1]]]), num_experts=4).stats()["load_max_over_mean"]
    assert balance["per_layer"] == [round(1 / 0.75, 4)]


def test_record_is_forwarded_lazily(monkeypatch):
    fake = types.ModuleType("expertflow.recorder")
    fake.record = lambda *args, **kwargs: ("recorded", args, kwargs)
    monkeypatch.setitem(sys.modules, "expertflow.recorder", fake)
    assert trace_module.record("m", out="x") == ("recorded", ("m",), {"out": "x"})


def test_trace_prints_as_a_summary_and_files_follow_the_umask(tmp_path):
    import os
    import stat

    trace = Trace(experts=np.tile(np.array([[[0, 1]]], np.int32), (3, 1, 1)), num_experts=4, model="toy")
    assert repr(trace) == "Trace(model='toy', tokens=3, sequences=1, steps=3, layers=1, experts=4, top_k=2)"
    mask = os.umask(0o022)
    try:
        trace.save(tmp_path / "t.safetensors")
    finally:
        os.umask(mask)
    assert stat.S_IMODE((tmp_path / "t.safetensors").stat().st_mode) == 0o644


def test_read_prompts_limit_must_keep_a_row(tmp_path):
    from expertflow.recorder import read_prompts

    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    assert [r["prompt"] for r in read_prompts(path, limit=1)] == ["a"]
    with pytest.raises(ValueError, match="limit=-1 must be at least 1"):
        read_prompts(path, limit=-1)  # rows[:-1] would silently drop the last row


def test_stats_in_small_chunks_equal_stats_in_one(monkeypatch):
    """`stats` works through long traces a bounded number of cells at a time; the boundaries change nothing."""
    import expertflow.trace as trace_module

    rng = np.random.default_rng(3)
    n, layers, experts, k = 900, 3, 7, 2
    routes = rng.random((n, layers, experts)).argsort(2)[:, :, :k]  # k distinct experts per cell
    routes[rng.random((n, layers, k)) < 0.1] = -1  # some slots missing, and whole cells: some steps name none
    trace = Trace(experts=routes, num_experts=experts, seq_ids=rng.integers(0, 5, n), positions=np.arange(n),
                  steps=rng.integers(0, 200, n), phase=np.ones(n, np.uint8))
    whole = trace.stats()
    monkeypatch.setattr(trace_module, "_CHUNK_CELLS", 50)  # a few tokens / steps / sequences per chunk
    assert trace.stats() == whole
    assert whole["distinct_experts_per_step"]["mean"] > 0 and whole["load_max_over_mean"]["per_sequence"] > 1


_PROMPTS = ["Hi", "Translate English to Finnish: the boy was found in the garden."]  # in a batch, the first is padded


def test_a_recorded_batch_numbers_positions_from_each_sequences_first_real_token():
    import torch

    from expertflow.models import tiny_moe
    from expertflow.trace import record

    model = tiny_moe(dtype=torch.float32)
    trace = record(model, _PROMPTS, batch_size=2, max_new_tokens=3, progress=False)
    solo = record(model, _PROMPTS[:1], batch_size=1, max_new_tokens=3, progress=False)
    for seq in (0, 1):
        rows = trace.seq_ids == seq
        assert sorted(trace.positions[rows].tolist()) == list(range(rows.sum())), seq
    np.testing.assert_array_equal(trace.positions[trace.seq_ids == 0], solo.positions)
    np.testing.assert_array_equal(trace.token_ids[trace.seq_ids == 0], solo.token_ids)


def test_a_sequence_that_ends_in_a_batch_is_recorded_up_to_its_end_token_and_no_filler():
    """Only real tokens are recorded: not the filler a finished sequence is fed after its end. In a batch, the row
    of a sequence that has just ended is fed its end token once more while the others go on, and that forward is
    recorded as the sequence's last token; alone, generation stops first, so its trace has one token fewer."""
    import torch

    from expertflow.models import tiny_moe
    from expertflow.trace import record

    model = tiny_moe(dtype=torch.float32)
    model.generation_config.eos_token_id = 261  # greedy, "Hi" goes on 14, 261, ...: it ends at its second new token
    trace = record(model, _PROMPTS, batch_size=2, max_new_tokens=6, progress=False)
    solo = record(model, _PROMPTS[:1], batch_size=1, max_new_tokens=6, progress=False)
    assert trace.token_ids[trace.seq_ids == 0].tolist() == [1, 42, 75, 14, 261]
    assert solo.token_ids.tolist() == [1, 42, 75, 14]
    assert (trace.seq_ids == 1).sum() == 16 + 5  # the other sequence goes on: its prompt and 5 fed tokens


def test_recorded_phases_steps_and_sequences_of_batches_run_one_after_another():
    """`phase` is 0 for the prompt's forward (prefill) and 1 for the decode forwards; `seq_ids` has one sequence per
    prompt; `steps` numbers the forward calls: with batch size 1, two prompts and 3 new tokens that is 6 distinct
    steps, the second prompt's all after the first's."""
    import torch

    from expertflow.models import tiny_moe
    from expertflow.trace import record

    trace = record(tiny_moe(dtype=torch.float32), _PROMPTS, batch_size=1, max_new_tokens=3, progress=False)
    assert sorted(set(trace.seq_ids.tolist())) == [0, 1]
    assert sorted(set(trace.steps.tolist())) == list(range(6))
    assert trace.steps[trace.seq_ids == 0].max() < trace.steps[trace.seq_ids == 1].min()
    for seq in (0, 1):
        rows = trace.seq_ids == seq
        first_step = trace.steps[rows].min()
        np.testing.assert_array_equal(trace.phase[rows], (trace.steps[rows] != first_step).astype(np.uint8))
        assert (trace.phase[rows] == 0).sum() == rows.sum() - 2  # the prompt; then 2 decode forwards


def test_recording_without_a_temperature_is_greedy_whatever_the_generation_config_says():
    """`record` decodes greedily unless it is given a temperature, also for a model whose generation config asks
    for sampling."""
    import torch

    from expertflow.models import tiny_moe
    from expertflow.trace import record

    model = tiny_moe(dtype=torch.float32)
    greedy = record(model, _PROMPTS, batch_size=2, max_new_tokens=8, progress=False)
    model.generation_config.do_sample = True
    model.generation_config.temperature = 5.0
    torch.manual_seed(1)
    again = record(model, _PROMPTS, batch_size=2, max_new_tokens=8, progress=False)
    np.testing.assert_array_equal(again.token_ids, greedy.token_ids)


def test_expert_parallel_sentinels_are_recorded_as_none():
    """An expert id >= num_experts names no expert of the layer (an expert-parallel sentinel): the trace stores it
    as -1, none."""
    import torch

    from expertflow.models import tiny_moe
    from expertflow.recorder import RouteRecorder

    model = tiny_moe(dtype=torch.float32)
    recorder = RouteRecorder(model)
    layer = recorder.layers[0]
    routed = []

    def sentinel(module, args):  # the ids as an expert-parallel rank gets them: token 0's second expert is elsewhere
        routed.append(args[1])
        index = args[1].clone()
        index[0, 1] = layer.num_experts
        return (args[0], index, *args[2:])

    def restore(module, args):  # the experts compute with the router's ids
        return (args[0], routed[-1], *args[2:])

    with recorder, torch.no_grad():
        handles = [layer.module.register_forward_pre_hook(sentinel, prepend=True),  # before the recorder's hook
                   layer.module.register_forward_pre_hook(restore)]  # after it
        try:
            model(input_ids=torch.tensor([[5, 6, 7]]))
        finally:
            for handle in handles:
                handle.remove()
    expected = routed[0].clone()
    expected[0, 1] = -1
    assert recorder.calls[0][2].tolist() == expected.tolist()


def test_another_format_is_named_before_its_tensors_are_checked(tmp_path):
    tensors = _tensors() | {"seq_ids": np.zeros(3, np.int64)}  # stored otherwise, as another version might
    _write(tmp_path / "old.safetensors", tensors, format="expertflow.trace/0")
    with pytest.raises(TraceFormatError, match="comes from another version of expertflow"):
        Trace.load(tmp_path / "old.safetensors")
    _write(tmp_path / "foreign.safetensors", tensors, format=None)
    with pytest.raises(TraceFormatError, match="is this an expertflow trace"):
        Trace.load(tmp_path / "foreign.safetensors")


@pytest.mark.parametrize("change, message", [
    # values a cast to the stored dtype would wrap round: 2**32 + 1 would become expert 1, 257 a decode token
    (dict(experts=np.array([[[2**32 + 1, 0]]])), "experts holds 4294967297, outside the int32 range"),
    (dict(token_ids=np.array([2**32 + 5])), "token_ids holds 4294967301, outside the int32 range"),
    (dict(phase=[257]), r"phase values must be 0 \(prefill\) or 1 \(decode\); found 257"),
    (dict(num_experts=2.7), r"num_experts must be an integer; got 2.7"),
    (dict(layer_ids=[-3]), r"layer_ids \[-3\] must be distinct layer indices >= 0"),
    (dict(experts=np.zeros((1, 2, 2), np.int32) + [0, 1], layer_ids=[3, 3]), r"layer_ids \[3, 3\] must be distinct"),
    (dict(layer_ids=[1.5]), "a layer_ids entry must be an integer; got 1.5"),
    (dict(gate_probs=[[[np.nan, 0.5]]]), "gate_probs holds NaN or infinite values"),
    (dict(gate_probs=[[[1e6, 0.5]]]), "gate_probs holds NaN or infinite values"),  # inf in float16
    (dict(experts=np.zeros((3, 0, 2), np.int32), layer_ids=[]), r"shape \(3, 0, 2\): a trace needs at least one MoE"),
    (dict(experts=np.zeros((3, 2, 0), np.int32)), r"shape \(3, 2, 0\): a trace needs at least one MoE layer"),
])
def test_construction_refuses_values_the_format_cannot_hold(change, message):
    parts = dict(experts=np.array([[[0, 1]]]), num_experts=4) | change
    with pytest.raises(TraceFormatError, match=message):
        Trace(**parts)


def test_validate_checks_values_set_after_construction():
    trace = _two_sequences()
    trace.num_experts = 4.0
    with pytest.raises(TraceFormatError, match="num_experts must be an integer"):
        trace.validate()
    trace.num_experts, trace.phase = 4, trace.phase.astype(np.int64)
    with pytest.raises(TraceFormatError, match="phase has dtype int64, expected uint8"):
        trace.validate()


@pytest.mark.parametrize("change, message", [
    (lambda t, m: m.update(layer_ids="[1, 1]"), r"layer_ids \[1, 1\] must be distinct layer indices"),
    (lambda t, m: (t.update(experts=np.zeros((3, 0, 2), np.int32)), m.update(num_layers="0", layer_ids="[]")),
     "needs at least one MoE layer"),
    (lambda t, m: t.update(gate_probs=np.full((3, 2, 2), np.inf, np.float16)), "gate_probs holds NaN or infinite"),
])
def test_load_refuses_files_with_values_the_format_does_not_allow(tmp_path, change, message):
    tensors, meta = _tensors(), {}
    change(tensors, meta)
    _write(tmp_path / "bad.safetensors", tensors, **meta)
    with pytest.raises(TraceFormatError, match=f"bad.safetensors: .*{message}"):
        Trace.load(tmp_path / "bad.safetensors")


def test_a_looped_model_is_refused_rather_than_recorded_with_wrong_tokens(monkeypatch):
    """inkling2_loop runs MoE layers 1-2 twice per forward; the trace has one cell per (token, MoE layer)."""
    import torch

    from expertflow.recorder import RouteRecorder

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from families_sweep import build_model

    torch.manual_seed(0)
    model, _ = build_model("inkling2_loop")
    ids = torch.tensor([[5, 17, 33, 9]])
    recorder = RouteRecorder(model)
    with pytest.raises(ValueError, match=r"MoE layer 1 \(.*experts\) ran twice in one forward pass"):
        with recorder, torch.no_grad():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
                           pad_token_id=0)
    assert [call[:2] for call in recorder.calls] == [(0, 0), (0, 1), (0, 2)]  # step 0, each layer once, then refused


def test_recorded_steps_are_forward_calls_of_the_model():
    """A step starts with the model's forward, not when a lower MoE layer runs; layers run outside that forward (a
    wrapper that hands `generate` to the model inside it) fall back to layer order."""
    import torch
    from torch import nn

    from expertflow.models import tiny_moe
    from expertflow.recorder import RouteRecorder

    model = tiny_moe(dtype=torch.float32).eval()
    recorder = RouteRecorder(model)
    ids = torch.tensor([[5, 6, 7]])
    with recorder, torch.no_grad():
        model(input_ids=ids)
        model(input_ids=ids)
    layers = len(recorder.layers)
    expected = [(s, i) for s in (0, 1) for i in range(layers)]
    assert [call[:2] for call in recorder.calls] == expected
    assert sorted(recorder.per_step()) == [0, 1]
    del recorder.calls[layers + 2]  # as if the second forward had skipped MoE layer 2: its tokens would lack it
    with pytest.raises(ValueError, match=r"forward 1 skipped MoE layer\(s\) 2 \(model\.layers\.2\."):
        recorder.per_step()

    class Outer(nn.Module):  # like a compiled model: its generate runs the inner model, never its own forward
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

    outer = RouteRecorder(Outer(model))
    with outer, torch.no_grad():
        model(input_ids=ids)
        model(input_ids=ids)
    assert [call[:2] for call in outer.calls] == expected and sorted(outer.per_step()) == [0, 1]


def test_a_model_with_one_moe_layer_run_outside_its_forward_gets_a_step_per_call():
    """Outside the model's forward call, a MoE layer index that does not go up starts a step (each layer runs once
    per forward): with a single MoE layer, every call is a step of its own."""
    import torch
    from torch import nn
    from transformers import MixtralConfig, MixtralForCausalLM

    from expertflow.recorder import RouteRecorder

    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
                                             num_experts_per_tok=2)).eval()

    class Outer(nn.Module):  # its generate would run the inner model, never its own forward
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

    recorder = RouteRecorder(Outer(model))
    with recorder, torch.no_grad():
        model(input_ids=torch.tensor([[5, 6, 7]]))
        model(input_ids=torch.tensor([[8]]))
    assert [call[:2] for call in recorder.calls] == [(0, 0), (1, 0)]


def test_a_forward_that_calls_itself_again_is_one_step():
    """A step starts with a call of the model's forward, not with the model's forward calling itself again, which
    is the same step."""
    import torch
    from torch import nn

    from expertflow.models import tiny_moe
    from expertflow.recorder import RouteRecorder

    class Reentrant(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, again=True):
            return self(input_ids, again=False) if again else self.inner(input_ids=input_ids)

    model = Reentrant(tiny_moe(dtype=torch.float32))
    recorder = RouteRecorder(model)
    with recorder, torch.no_grad():
        model(torch.tensor([[5, 6, 7]]))
        model(torch.tensor([[8, 9]]))
    layers = len(recorder.layers)
    assert [call[:2] for call in recorder.calls] == [(s, i) for s in (0, 1) for i in range(layers)]


def test_a_recorder_carries_on_after_an_interrupted_forward():
    """Ctrl-C inside the model's forward skips the hook that ends the step: the next forward call still starts a
    new one (it was refused as a model that runs a layer twice)."""
    import torch

    from expertflow.models import tiny_moe
    from expertflow.recorder import RouteRecorder

    model = tiny_moe(dtype=torch.float32).eval()
    recorder = RouteRecorder(model)
    ids = torch.tensor([[5, 6, 7]])

    def interrupt(module, args):
        raise KeyboardInterrupt

    handle = recorder.layers[1].module.register_forward_pre_hook(interrupt)
    with pytest.raises(KeyboardInterrupt), recorder, torch.no_grad():
        model(input_ids=ids)
    handle.remove()
    with recorder, torch.no_grad():
        model(input_ids=ids)
    assert [call[:2] for call in recorder.calls] == [(0, 0)] + [(1, i) for i in range(len(recorder.layers))]


def _record_with_a_second_thread_trying(model):
    """Record one forward of thread A while thread B calls the model from inside A's first MoE layer; returns the
    recorder and B's errors."""
    import threading

    import torch

    from expertflow.recorder import RouteRecorder

    ids = torch.tensor([[5, 6, 7]])
    recorder = RouteRecorder(model)
    inside, tried, errors = threading.Event(), threading.Event(), []

    def pause(module, args):  # thread A, inside its forward: let B try, then go on
        if threading.current_thread().name == "A":
            inside.set()
            tried.wait(30)

    def other():
        inside.wait(30)
        try:
            model(input_ids=ids)
        except RuntimeError as error:
            errors.append(error)
        tried.set()

    handle = recorder.layers[0].module.register_forward_pre_hook(pause)
    thread = threading.Thread(target=other)
    thread.start()
    try:
        with recorder, torch.no_grad():
            first = threading.Thread(target=lambda: model(input_ids=ids), name="A")
            first.start()
            first.join()
        thread.join()
    finally:
        handle.remove()
    return recorder, errors


def test_a_second_thread_refused_by_the_runtime_leaves_the_recording_intact():
    """The runtime refuses a second thread's call in its own forward pre-hook; the recorder's always-called hook
    that ends a step runs for that call too, and must not end the first thread's step."""
    import torch

    import expertflow
    from expertflow.models import tiny_moe

    model = expertflow.wrap(tiny_moe(dtype=torch.float32).eval(), cache_slots=64, policy="lru")
    try:
        recorder, errors = _record_with_a_second_thread_trying(model)
    finally:
        expertflow.unwrap(model)
    assert len(errors) == 1 and "another thread" in str(errors[0])
    assert [call[:2] for call in recorder.calls] == [(0, i) for i in range(len(recorder.layers))]


def test_a_second_thread_recording_an_unwrapped_model_is_refused_and_the_first_is_kept():
    """Without a runtime to refuse it, a second thread's forward reached the recorder mid-step and was recorded as
    part of the first thread's step (then refused at the end as a step that "skipped" layers)."""
    import torch

    from expertflow.models import tiny_moe

    recorder, errors = _record_with_a_second_thread_trying(tiny_moe(dtype=torch.float32).eval())
    assert len(errors) == 1 and "another thread" in str(errors[0])
    assert [call[:2] for call in recorder.calls] == [(0, i) for i in range(len(recorder.layers))]
    assert set(recorder.per_step()) == {0}


def test_an_interrupted_thread_does_not_keep_other_threads_from_recording():
    """A Ctrl-C skips the hook that ends a step, so the recorded owner is stale: another thread may record next."""
    import threading

    import torch

    from expertflow.models import tiny_moe
    from expertflow.recorder import RouteRecorder

    model = tiny_moe(dtype=torch.float32).eval()
    ids = torch.tensor([[5, 6, 7]])
    recorder = RouteRecorder(model)

    def interrupt(module, args):
        raise KeyboardInterrupt

    handle = recorder.layers[1].module.register_forward_pre_hook(interrupt)
    with pytest.raises(KeyboardInterrupt), recorder, torch.no_grad():
        model(input_ids=ids)
    handle.remove()
    errors = []

    def run():
        try:
            model(input_ids=ids)
        except RuntimeError as error:
            errors.append(error)

    with recorder, torch.no_grad():
        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
    assert errors == []
    assert [call[:2] for call in recorder.calls] == [(0, 0)] + [(1, i) for i in range(len(recorder.layers))]


def _script_error(monkeypatch, capsys, script: str, *argv: str) -> str:
    """Run benchmarks/`script`.py's main with `argv`: it must stop as argparse does (status 2, usage and one
    error line); returns that line."""
    import importlib

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    monkeypatch.setattr(sys, "argv", [script, *argv])
    with pytest.raises(SystemExit) as exit_info:
        importlib.import_module(script).main()
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("usage: ") and "Traceback" not in err
    return err.strip().splitlines()[-1]


def test_benchmarks_refuse_a_predictor_that_does_not_fit_in_one_line(tmp_path, monkeypatch, capsys):
    Trace(experts=np.array([[[0, 1], [2, 3]]] * 3), num_experts=4).save(tmp_path / "small.safetensors")
    small = ("--trace", str(tmp_path / "small.safetensors"))
    assert _script_error(monkeypatch, capsys, "eviction_horizon", *small).startswith(
        "eviction_horizon: error: the predictor predicts 6 layers x 32 experts, top-4; the trace has 2 x 4, top-2")
    not_one = f"error: {tmp_path} is not a route predictor directory"
    assert not_one in _script_error(monkeypatch, capsys, "eviction_horizon", *small, "--predictor", str(tmp_path))
    assert f"error: --predictor {tmp_path}: {tmp_path} is not a route predictor directory" in _script_error(
        monkeypatch, capsys, "predictor_overhead", "--predictor", str(tmp_path))


def test_a_generate_that_computes_other_rows_is_named_with_its_likely_causes():
    """A custom generate that runs beams despite the recorder's settings: the refusal counts prompt tokens as such
    and names the generation settings that compute other rows."""
    import torch

    from expertflow.models import tiny_moe
    from expertflow.recorder import record

    model = tiny_moe(dtype=torch.float32).eval()
    plain = model.generate

    def beams(**kwargs):  # as a remote-code model's own generate might
        return plain(**{**kwargs, "num_beams": 3})

    model.generate = beams
    with pytest.raises(ValueError) as err:
        record(model, ["hello there", "hi"], max_new_tokens=2, progress=False)
    message = str(err.value)
    assert message.startswith("forward 0 of generate computed 30 rows where 2 sequences x 5 prompt tokens (padded) "
                              "= 10 were expected")
    assert "new tokens" not in message and "beams, several sequences per prompt or candidate tokens" in message
