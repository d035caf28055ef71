"""The JSONL importer: the real routing logs in ../shared/data, field inference and flags, and clear errors; the
`trace import` command's summary and progress bar."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from expertflow.cli import main
from expertflow.trace import Trace
from expertflow.trace_import import JsonlFields, TraceImportError, import_jsonl

ROUTING = Path(__file__).resolve().parents[2] / "shared" / "data" / "routing"
MIXTRAL = [ROUTING / "mixtral-8x7b" / name for name in ("humaneval_2_routing.jsonl", "gsm8k_2_routing.jsonl")]
GRANITE = ROUTING / "granite-3.0-1b-a400m" / "routing-trace.jsonl"
needs_mixtral = pytest.mark.skipif(not all(p.is_file() for p in MIXTRAL),
                                   reason="real Mixtral routing logs (../shared/data/routing) are not present")
needs_granite = pytest.mark.skipif(not GRANITE.is_file(),
                                   reason="real Granite routing log (../shared/data/routing) is not present")


@needs_mixtral
@pytest.mark.parametrize("path", MIXTRAL, ids=lambda p: p.name)
def test_mixtral_files_have_the_published_locality(path):
    stats = import_jsonl([path]).stats()
    assert 0.3 <= stats["temporal_overlap"]["mean"] <= 0.45
    assert 1.35 <= stats["load_max_over_mean"]["median"] <= 1.65


@needs_mixtral
def test_mixtral_files_import_together():
    trace = import_jsonl(MIXTRAL)
    assert trace.experts.shape == (585, 32, 2) and trace.num_experts == 8
    assert trace.seq_ids.max() == 3 and trace.steps.tolist() == list(range(585))  # batch size 1, decode only
    assert trace.phase.min() == 1 and trace.gate_probs is not None
    assert trace.layer_ids == list(range(32))
    stats = trace.stats()
    assert stats["missing_cells"] == 52  # cells the logs lack become -1
    assert 0.3 <= stats["temporal_overlap"]["mean"] <= 0.45
    assert 1.35 <= stats["load_max_over_mean"]["per_sequence"] <= 1.65


@needs_granite
def test_granite_log_has_prefill_and_decode():
    trace = import_jsonl([GRANITE])
    assert trace.model == "ibm-granite/granite-3.0-1b-a400m-instruct"
    assert trace.experts.shape == (216, 24, 8) and trace.num_experts == 32
    assert (trace.phase == 0).sum() == 64 and (trace.phase == 1).sum() == 152
    first = trace.seq_ids == 0
    assert trace.steps[first].tolist() == [0] * 8 + list(range(1, 20))  # prefill is one step
    assert trace.positions[first].tolist() == list(range(27))
    assert trace.token_ids[:3].tolist() == [1000, 1001, 1002]
    assert len(np.unique(trace.steps)) == 8 * 20


def _jsonl(tmp_path: Path, rows: list, name: str = "log.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_per_token_layer_rows_with_inferred_names(tmp_path):
    rows = [{"seq_id": s, "layer": l, "token_idx": t, "experts": [(s + l + t) % 4, (s + l + t + 1) % 4]}
            for s in range(2) for l in range(3) for t in range(2)]
    trace = import_jsonl([_jsonl(tmp_path, rows[::-1])])  # any row order
    assert trace.experts.shape == (4, 3, 2) and trace.num_experts == 4 and trace.gate_probs is None
    assert trace.seq_ids.tolist() == [0, 0, 1, 1] and trace.steps.tolist() == [0, 1, 2, 3]
    # sequences are numbered in order of first appearance: reversed rows make log seq 1 trace sequence 0
    assert trace.experts[1, 2].tolist() == [0, 1]  # log seq 1, token 1, layer 2: (1 + 2 + 1) % 4
    assert trace.experts[3, 2].tolist() == [3, 0]  # log seq 0, token 1, layer 2


def test_field_flags_and_step_field(tmp_path):
    rows = [{"req": r, "lyr": 5 + l, "t": 0, "ids": [i, 2], "w": [0.7, 0.3], "fwd": 0, "stage": "prefill"}
            for i, r in enumerate(("a", "b")) for l in range(2)]
    fields = JsonlFields(seq="req", layer="lyr", token="t", experts="ids", probs="w", step="fwd", phase="stage")
    trace = import_jsonl([_jsonl(tmp_path, rows)], fields, num_experts=6)
    assert trace.layer_ids == [5, 6] and trace.num_experts == 6
    assert trace.steps.tolist() == [0, 0] and trace.phase.tolist() == [0, 0]  # one forward step, two sequences
    assert trace.gate_probs[0, 0].tolist() == pytest.approx([0.7, 0.3], abs=1e-3)


def test_without_steps_each_sequences_prefill_is_a_step_of_its_own(tmp_path):
    """Without a step field, sequences run one after another and a sequence's prefill tokens form one step: two
    prompt-only sequences are two steps."""
    rows = [{"seq_id": s, "layer": 0, "token_idx": t, "phase": "prefill", "experts": [t]} for s in range(2)
            for t in range(2)]
    assert import_jsonl([_jsonl(tmp_path, rows)]).steps.tolist() == [0, 0, 1, 1]


def test_step_values_of_different_files_are_different_steps(tmp_path):
    """Sequences of different files never merge: step 0 of one log and step 0 of another are different forward
    passes."""
    a = _jsonl(tmp_path, [{"seq_id": 0, "layer": 0, "token_idx": 0, "step": 0, "experts": [1]}], "a.jsonl")
    b = _jsonl(tmp_path, [{"seq_id": 0, "layer": 0, "token_idx": 0, "step": 0, "experts": [2]}], "b.jsonl")
    trace = import_jsonl([a, b])
    assert trace.seq_ids.tolist() == [0, 1] and trace.steps.tolist() == [0, 1]


def test_imported_positions_count_from_zero_in_every_sequence(tmp_path):
    """`positions` is each token's place in its own sequence."""
    rows = [{"seq_id": s, "layer": 0, "token_idx": t, "experts": [t]} for s in range(3) for t in range(2)]
    assert import_jsonl([_jsonl(tmp_path, rows)]).positions.tolist() == [0, 1, 0, 1, 0, 1]


def test_prefill_tokens_come_before_decode_tokens_when_the_token_field_counts_per_phase(tmp_path):
    """Within a sequence, tokens are ordered by (phase, token field): a `token_index` that counts the decode tokens
    from 0 again (as in the nested example) does not interleave them with the prompt's."""
    rows = [{"request_id": "p0", "phase": phase, "token_index": t, "routing": [{"layer_index": 0, "expert_ids": [e]}]}
            for phase, t, e in (("decode", 0, 2), ("prefill", 0, 0), ("decode", 1, 3), ("prefill", 1, 1))]
    trace = import_jsonl([_jsonl(tmp_path, rows)])
    assert trace.phase.tolist() == [0, 0, 1, 1] and trace.experts[:, 0, 0].tolist() == [0, 1, 2, 3]
    assert trace.steps.tolist() == [0, 0, 1, 2]


def test_phase_names_are_read_whatever_their_case(tmp_path):
    """Phase names are matched without regard to case (SGLang's forward modes are EXTEND and DECODE)."""
    rows = [{"seq_id": 0, "layer": 0, "token_idx": t, "phase": p, "experts": [t]}
            for t, p in enumerate(("EXTEND", "Decode"))]
    assert import_jsonl([_jsonl(tmp_path, rows)]).phase.tolist() == [0, 1]


def test_a_token_id_given_on_one_layer_row_is_kept_when_another_row_has_null(tmp_path):
    """A token's vocabulary id comes from whichever of its rows gives one: null means unknown."""
    rows = [{"layer": 0, "token_idx": 0, "token_id": 42, "experts": [1]},
            {"layer": 1, "token_idx": 0, "token_id": None, "experts": [2]}]
    assert import_jsonl([_jsonl(tmp_path, rows)]).token_ids.tolist() == [42]


def test_a_token_whose_routing_list_is_empty_is_kept_with_every_cell_missing(tmp_path):
    """An empty routing list is a token that ran without its routes logged: it keeps its place, id and step, as
    with a list of empty entries (it vanished, and the next token took its position)."""
    def token(t, routing):
        return {"request_id": "a", "token_index": t, "token_id": 100 + t, "step": t, "routing": routing}
    for empty in ([], [[], []]):
        path = _jsonl(tmp_path, [token(0, [[1, 2], [3, 4]]), token(1, empty), token(2, [[5, 6], [7, 0]])])
        trace = import_jsonl([path])
        assert trace.experts.tolist() == [[[1, 2], [3, 4]], [[-1, -1], [-1, -1]], [[5, 6], [7, 0]]]
        assert (trace.token_ids.tolist(), trace.positions.tolist(), trace.steps.tolist()) == \
            ([100, 101, 102], [0, 1, 2], [0, 1, 2])


def test_rows_of_one_token_that_give_different_token_ids_are_refused(tmp_path):
    """A token has one vocabulary id: rows of the same token that name different ones (a token field that does not
    tell tokens apart, or a damaged log) are refused, as a second routing of a token is, with both lines named."""
    rows = [{"seq_id": 0, "token_idx": 0, "layer": 0, "token_id": 5, "experts": [1]},
            {"seq_id": 0, "token_idx": 0, "layer": 1, "token_id": None, "experts": [2]},
            {"seq_id": 0, "token_idx": 0, "layer": 2, "token_id": 7, "experts": [3]}]
    with pytest.raises(TraceImportError, match=r"log\.jsonl:3: token_id 7 differs from the token_id 5 of the same "
                                               r"token on line 1\. Fix: the token field must tell tokens apart; check "
                                               r"--token-field / --seq-field, or name the vocabulary id field with "
                                               r"--token-id-field$"):
        import_jsonl([_jsonl(tmp_path, rows)])


def test_rows_without_token_field_are_numbered_in_order(tmp_path):
    rows = [{"layer": l, "experts": [t]} for t in range(3) for l in range(2)]
    trace = import_jsonl([_jsonl(tmp_path, rows)])
    assert trace.experts[:, :, 0].tolist() == [[0, 0], [1, 1], [2, 2]] and trace.seq_ids.tolist() == [0, 0, 0]


@pytest.mark.parametrize("rows, line, message", [
    ([{"layer": 0, "experts": [1]}, '{"layer": 1, "experts": [1]', ], 2,
     r"not valid JSON \(Expecting ',' delimiter at column 28: the line ends too soon, cut short\?\)"),
    ([{"layer": 0, "experts": [1]}, '{"layer": 1, "experts": [1], "gating_probs": "0.'], 2,
     r"not valid JSON \(Unterminated string starting at column 46: the line ends too soon, cut short\?\)"),
    ([{"layer": 0, "experts": [1]}, '{"layer": 1,, "experts": [1]}', ], 2,
     r"not valid JSON \(Expecting property name enclosed in double quotes at column 13\)\. Fix"),
    # a nested log's routing field that is not a list, on a line after the first
    ([{"seq_id": 0, "routing": [[1]]}, {"seq_id": 0, "routing": None}], 2,
     "field 'routing' is null, not a list of per-layer routing entries"),
    ([{"seq_id": 0, "routing": [[1]]}, {"seq_id": 0, "routing": {"layer": 0, "experts": [1]}}], 2,
     "field 'routing' is {\"layer\": 0, \"experts\": \\[1\\]}, not a list"),
    ([{"seq_id": 0, "routing": [[1]]}, {"seq_id": 0, "routing": "oops"}], 2, "field 'routing' is \"oops\""),
    # one token, two steps: the last would win and move the token to another forward pass
    ([{"seq_id": 0, "token_idx": 0, "layer": 0, "step": 0, "experts": [1]},
      {"seq_id": 0, "token_idx": 0, "layer": 1, "step": 7, "experts": [2]}], 2,
     "step 7 differs from the step 0 of the same token on line 1"),
    ([{"layer": 0, "experts": [1]}, {"layer": 1, "experts": "1,2"}], 2, "must be a list of integers"),
    ([{"layer": 0, "experts": [1]}, {"experts": [1]}], 2, "field 'layer' .* --layer-field"),
    ([{"layer": 0, "token_idx": 0, "experts": [1]}, {"layer": 0, "token_idx": 0, "experts": [2]}], 2,
     "first on line 1"),
    ([{"layer": 0, "experts": [1], "phase": "warmup"}], 1, "neither prefill nor decode"),
    ([{"msg": "hello"}], 1, "no expert field .* --experts-field"),
    ([{"layer": 0, "experts": [1], "gating_probs": [0.5, 0.5]}], 1, "must be a list of 1 numbers"),
    ([{"layer": 0, "experts": [1]}, {"layer": 0, "experts": [-3]}], 2, "negative expert id"),
    ([{"layer": 0, "experts": [1]}, "[" * 10**5 + "]" * 10**5], 2, "JSON nested too deeply to read"),
    # more experts than the header's top_k: named with its line, not left to NumPy's broadcasting error
    ([{"row_type": "header", "top_k": 1}, {"layer": 0, "experts": [1]}, {"layer": 0, "experts": [1, 2]}], 3,
     r"experts \[1, 2\] do not fit top_k=1"),
    # a field the first routing line has, every one has
    ([{"seq_id": 0, "layer": 0, "experts": [1]}, {"layer": 0, "experts": [2]}], 2, "field 'seq_id' .* --seq-field"),
    ([{"token_idx": 0, "layer": 0, "experts": [1]}, {"layer": 0, "experts": [2]}], 2,
     "field 'token_idx' .* --token-field"),
    ([{"step": 0, "layer": 0, "experts": [1]}, {"layer": 0, "experts": [2]}], 2, "field 'step' .* --step-field"),
    ([{"phase": "decode", "layer": 0, "experts": [1]}, {"layer": 0, "experts": [2]}], 2, "field 'phase'"),
    # a null phase: taken as decode, one line of a prefill token would split it into two tokens
    ([{"phase": "prefill", "layer": 0, "experts": [1]}, {"phase": None, "layer": 1, "experts": [2]}], 2,
     "phase value null in field 'phase'.*--phase-field"),
    # values a router cannot produce, or a trace cannot hold
    ([{"layer": 0, "experts": [1, 2]}, {"layer": 0, "experts": [2, 2]}], 2, r"an expert is named twice in \[2, 2\]"),
    ([{"layer": 0, "experts": [1]}, {"layer": -1, "experts": [2]}], 2, "layer index -1 is negative"),
    ([{"layer": 0, "experts": [1], "gating_probs": [float("nan")]}], 1, "'gating_probs' holds \\[nan\\]"),
    ([{"layer": 0, "experts": [1], "gating_probs": [1e6]}], 1, "float16, finite and at most 65504"),
    ([{"layer": 0, "experts": [1], "gating_probs": [10**400]}], 1, "float16, finite and at most 65504"),
    ([{"layer": 0, "experts": [1], "gating_probs": [-1e6]}], 1, "float16, finite and at most 65504"),
    ([{"layer": 0, "experts": [1], "gating_probs": [-10**400]}], 1, "float16, finite and at most 65504"),
    # one stray longer list would make the whole trace top-3
    ([{"layer": l, "token_idx": t, "experts": [t, t + 1]} for t in range(3) for l in range(2)]
     + [{"layer": 0, "token_idx": 3, "experts": [1, 2, 3]}], 7,
     "3 experts \\[1, 2, 3\\], where 6 of the 7 routing entries name 2.*--top-k 3"),
    # step and sequence values: a null step is a missing one; text steps would sort as text ("10" before "8")
    ([{"step": 0, "layer": 0, "experts": [1]}, {"step": None, "layer": 0, "experts": [2]}], 2,
     "step value null is not an integer.*--step-field"),
    ([{"step": "8", "layer": 0, "experts": [1]}], 1, 'step value "8" is not an integer'),
    ([{"step": [0], "layer": 0, "experts": [1]}], 1, "step value \\[0\\] is not an integer"),
    ([{"seq_id": "a", "layer": 0, "experts": [1]}, {"seq_id": [0], "layer": 0, "experts": [2]}], 2,
     "sequence id \\[0\\] is neither a string nor an integer.*--seq-field"),
    ([{"seq_id": True, "layer": 0, "experts": [1]}], 1, "sequence id true"),
    # layers the header does not declare
    ([{"moe_layer_indices": [1, 3], "row_type": "header"}, {"layer": 2, "experts": [1]}], 2,
     "layer 2 is not one of the header's moe_layer_indices \\[1, 3\\].*--layer-field"),
    ([{"moe_layer_indices": [1, 3], "row_type": "header"}, {"seq_id": 0, "routing": [[0], [1], [2]]}], 2,
     "more than the 2 MoE layers of the header's moe_layer_indices"),
    # header values
    ([{"row_type": "header", "top_k": "two"}, {"layer": 0, "experts": [1]}], 1, "header top_k='two' is not a "
                                                                              "positive integer.*--top-k"),
    ([{"row_type": "header", "top_k": 2.0}, {"layer": 0, "experts": [1]}], 1, "header top_k=2.0"),
    ([{"provenance": {"expert_count": "4"}}, {"layer": 0, "experts": [1]}], 1, "header expert_count='4'"),
    ([{"provenance": {"moe_layer_indices": [0, "1"]}}, {"layer": 0, "experts": [1]}], 1,
     "header moe_layer_indices=\\[0, '1'\\] is not a list of layer indices"),
    ([{"provenance": "run-3"}, {"layer": 0, "experts": [1]}], 1, "header field 'provenance' is a JSON str, not an "
                                                                 "object"),
    ([{"layer": 0, "experts": [1]}, {"provenance": ["a"]}], 2, "'provenance' is a JSON list"),
    # integers beyond what a trace stores: int32 token ids and steps, 65,536 experts per layer
    ([{"layer": 0, "experts": [1], "token_id": 2**32 + 1}], 1, "token_id value 4294967297 is outside the int32"),
    ([{"layer": 0, "experts": [1, 3000000000]}], 1, "expert id 3000000000 is beyond the 65,536 experts per layer"),
    ([{"layer": 0, "experts": [1, 2]}, {"layer": 0, "experts": [70000, 3]}], 2, "expert id 70000 is beyond the 65,536"),
    ([{"layer": 0, "experts": [1], "step": 2**32 + 1}], 1, "step value 4294967297 is outside the int32 range"),
    # a probability field the first routing line (or entry) has, every one has: else it would be stored as 0.0
    ([{"layer": 0, "experts": [1], "gating_probs": [1.0]}, {"layer": 0, "experts": [2]}], 2,
     "field 'gating_probs' \\(probs\\) is missing.*--probs-field"),
    ([{"layer": 0, "experts": [1], "gating_probs": [1.0]}, {"layer": 0, "experts": [2], "gating_probs": None}], 2,
     "'gating_probs' must be a list of 1 numbers, got None"),
    ([{"seq_id": 0, "routing": [{"expert_ids": [1], "gate_weights": [1.0]}, {"expert_ids": [2]}]}], 1,
     "field 'gate_weights' \\(probs\\) is missing"),
    ([{"seq_id": 0, "routing": [{"expert_ids": [1], "gate_weights": [1.0]}]}, {"seq_id": 0, "routing": [[2]]}], 2,
     "routing entry 0 is a plain list, without the 'gate_weights' field"),
])
def test_bad_lines_name_the_line_and_the_fix(tmp_path, rows, line, message):
    path = _jsonl(tmp_path, rows)
    with pytest.raises(TraceImportError, match=f"log.jsonl:{line}: .*{message}.*Fix:|log.jsonl:{line}: {message}"):
        import_jsonl([path])


def test_shorter_expert_lists_are_missing_experts_and_a_given_top_k_allows_longer(tmp_path):
    rows = [{"layer": 0, "token_idx": t, "experts": [t, t + 1]} for t in range(3)]
    trace = import_jsonl([_jsonl(tmp_path, rows + [{"layer": 0, "token_idx": 3, "experts": [1]}])])
    assert trace.top_k == 2 and trace.experts[3, 0].tolist() == [1, -1]
    path = _jsonl(tmp_path, rows + [{"layer": 0, "token_idx": 3, "experts": [1, 2, 3]}])
    assert import_jsonl([path], top_k=3).experts[0, 0].tolist() == [0, 1, -1]


def test_minus_one_in_an_expert_list_is_a_missing_expert(tmp_path):
    """Expert ids are >= 0, and -1 means none: a -1 in a list is a missing cell, not an error."""
    trace = import_jsonl([_jsonl(tmp_path, [{"layer": 0, "experts": [3, -1]}, {"layer": 0, "experts": [1, 2]}])])
    assert trace.experts[:, 0].tolist() == [[3, -1], [1, 2]]


def test_top_k_does_not_depend_on_line_order_when_lengths_tie(tmp_path):
    rows = [{"layer": 0, "token_idx": 0, "experts": [1]}, {"layer": 0, "token_idx": 1, "experts": [1, 2]}]
    assert import_jsonl([_jsonl(tmp_path, rows)]).top_k == 2
    assert import_jsonl([_jsonl(tmp_path, rows[::-1], "reversed.jsonl")]).top_k == 2


def test_gate_weights_are_read_as_routing_weights(tmp_path):
    rows = [{"layer": 0, "experts": [1, 2], "gate_weights": [0.75, 0.25]}]
    assert import_jsonl([_jsonl(tmp_path, rows)]).gate_probs[0, 0].tolist() == [0.75, 0.25]


def test_expert_beyond_num_experts_is_rejected(tmp_path):
    path = _jsonl(tmp_path, [{"layer": 0, "experts": [1]}, {"layer": 0, "experts": [9]}])
    with pytest.raises(TraceImportError, match="log.jsonl:2: .*num_experts=8"):
        import_jsonl([path], num_experts=8)


def test_header_and_marked_rows_are_skipped(tmp_path):
    rows = [{"row_type": "header", "provenance": {"model_id": "m/x", "expert_count": 16, "top_k": 2}},
            {"row_type": "event", "what": "kv"},
            {"request_id": "r", "phase": "decode", "token_index": 0,
             "routing": [{"layer_index": 0, "expert_ids": [3, 4]}, {"layer_index": 1, "expert_ids": [5, 6]}]},
            {"request_id": "r", "phase": "decode", "token_index": 1, "routing": [[1, 2], [7, 8]]}]
    trace = import_jsonl([_jsonl(tmp_path, rows)])
    assert trace.model == "m/x" and trace.num_experts == 16
    assert trace.experts.tolist() == [[[3, 4], [5, 6]], [[1, 2], [7, 8]]]


def test_header_fields_that_look_like_counts_or_layers_but_are_not_read_are_named(tmp_path, capsys):
    """`n_experts` / `moe_layers` are not read: the trace would silently get 10 experts (the largest id + 1)."""
    from expertflow.cli import main

    rows = [{"row_type": "header", "model": "m/x", "n_experts": 16, "top_k": 2, "moe_layers": [1, 3],
             "dispatch_layer_mapping": "framework-layer-id", "layer_count_note": [1.5], "stop_token_id": 2,
             "top_p": 1, "expert_parallel_size": 4},
            {"seq_id": 0, "token_idx": 0, "layer": 1, "experts": [0, 9]},
            {"seq_id": 0, "token_idx": 0, "layer": 3, "experts": [1, 2]}]
    path = _jsonl(tmp_path, rows)
    with pytest.warns(UserWarning, match=r"\.jsonl:1: header field\(s\) moe_layers, n_experts are not read; the header "
                                         r"fields read are model_id, .*Rename them, or give --num-experts"):
        trace = import_jsonl([path])
    assert trace.num_experts == 10  # inferred, as the warning says
    assert main(["trace", "import", "--input", str(path), "--out", str(tmp_path / "t.safetensors"), "--json"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("expertflow trace import: warning: ") and "moe_layers, n_experts are not read" in err


def test_routing_lists_take_the_layer_indices_the_header_declares(tmp_path):
    """Entry i of a routing list without layer fields is the i-th MoE layer: with a dense first layer that is not
    layer i."""
    rows = [{"row_type": "header", "provenance": {"model_id": "m", "expert_count": 4, "moe_layer_indices": [1, 3, 5]}}]
    rows += [{"request_id": "p0", "token_index": t, "routing": [[0, 1], [1, 2], {"expert_ids": [2, 3]}]}
             for t in range(2)]
    trace = import_jsonl([_jsonl(tmp_path, rows)])
    assert trace.layer_ids == [1, 3, 5] and trace.experts[0].tolist() == [[0, 1], [1, 2], [2, 3]]


def _dense_first_layer_log(tmp_path: Path, **header) -> Path:
    """Two tokens of a model whose layer 0 is dense, logged with empty expert lists beside MoE layers 1 and 2."""
    rows = [{"row_type": "header", **header}] if header else []
    rows += [{"request_id": "p0", "token_index": t, "token_id": 7 + t,
              "routing": [{"layer_index": 0, "expert_ids": []}, {"layer_index": 1, "expert_ids": [t, t + 1]},
                          {"layer_index": 2, "expert_ids": [t + 2, t + 3]}]} for t in range(2)]
    return _jsonl(tmp_path, rows)


def test_a_layer_that_names_no_expert_on_any_line_is_left_out_as_dense(tmp_path):
    """Counted as a MoE layer, it would add experts the model does not have (to --cache-fraction, to a predictor)."""
    with pytest.warns(UserWarning, match=r"log.jsonl: layer 0 names no expert on any line: taken as dense and left out "
                                         r"of the trace \(MoE layers 1..2\); a header line with moe_layer_indices"):
        trace = import_jsonl([_dense_first_layer_log(tmp_path)])
    assert trace.layer_ids == [1, 2] and trace.experts.shape == (2, 2, 2) and trace.num_experts == 5
    assert trace.experts[1].tolist() == [[1, 2], [3, 4]] and trace.stats()["missing_cells"] == 0
    assert trace.token_ids.tolist() == [7, 8]
    flat = [{"seq_id": 0, "token_idx": t, "layer": l, "experts": [] if l in (0, 3) else [t, l + 2]}
            for t in range(2) for l in range(4)]
    with pytest.warns(UserWarning, match=r"layers \[0, 3\] name no expert on any line"):
        assert import_jsonl([_jsonl(tmp_path, flat, "flat.jsonl")]).layer_ids == [1, 2]


def test_a_layer_with_some_empty_expert_lists_stays_and_a_header_keeps_every_declared_layer(tmp_path):
    rows = [{"seq_id": 0, "token_idx": t, "layer": l, "experts": [] if (t, l) == (0, 0) else [l]}
            for t in range(2) for l in range(2)]
    assert import_jsonl([_jsonl(tmp_path, rows)]).experts[:, 0].tolist() == [[-1], [0]]  # a missing cell
    trace = import_jsonl([_dense_first_layer_log(tmp_path, moe_layer_indices=[0, 1, 2])])
    assert trace.layer_ids == [0, 1, 2] and (trace.experts[:, 0] == -1).all()  # declared: kept as the header says


def test_a_log_whose_every_layer_names_no_expert_is_refused(tmp_path):
    rows = [{"seq_id": 0, "token_idx": t, "layer": l, "experts": [-1, -1]} for t in range(2) for l in range(2)]
    with pytest.raises(TraceImportError, match="log.jsonl: no routing line names an expert. Fix: give logs with "
                                               "expert ids"):
        import_jsonl([_jsonl(tmp_path, rows)])


def test_a_given_probability_field_is_required_on_every_line(tmp_path):
    path = _jsonl(tmp_path, [{"layer": 0, "experts": [1], "w": [1.0]}, {"layer": 0, "experts": [2]}])
    with pytest.raises(TraceImportError, match="log.jsonl:2: field 'w' \\(probs\\) is missing"):
        import_jsonl([path], JsonlFields(probs="w"))


@pytest.mark.parametrize("field, value", [("step", 0), ("iteration", 3), ("phase", "decode")])
def test_a_step_or_phase_field_that_only_later_lines_have_is_named_as_not_read(tmp_path, field, value):
    """The fields are those of the first routing line: a step field that only later lines carry is not read (the log
    is replayed as one token per forward pass), and the importer says so, once."""
    rows = [{"seq_id": 0, "layer": 0, "experts": [1]}] + [
        {"seq_id": s, "layer": 0, field: value, "experts": [2]} for s in range(3)]
    with pytest.warns(UserWarning, match=rf"log\.jsonl:2: field '{field}' \((step|phase)\) is not read: the first "
                                         r"routing line \(line 1\) has none") as caught:
        import_jsonl([_jsonl(tmp_path, rows)])
    assert len(caught) == 1


def test_num_experts_beyond_what_a_trace_holds_is_refused_by_the_command(tmp_path, capsys):
    path = _jsonl(tmp_path, [{"layer": 0, "experts": [1, 2]}])
    assert main(["trace", "import", "--input", str(path), "--out", str(tmp_path / "t.safetensors"),
                 "--num-experts", str(10**11)]) == 2
    assert "num_experts=100000000000 is more than a trace can hold (65,536)" in capsys.readouterr().err
    assert not (tmp_path / "t.safetensors").exists()


def test_probabilities_follow_the_first_routing_line(tmp_path):
    """A log whose first line has none has none: a later line's values are not stored beside zeros."""
    rows = [{"layer": 0, "token_idx": 0, "experts": [1]}, {"layer": 0, "token_idx": 1, "experts": [2],
                                                          "gating_probs": [1.0]}]
    assert import_jsonl([_jsonl(tmp_path, rows)]).gate_probs is None


@pytest.mark.parametrize("extra, message", [
    ({"step": 0}, "a.jsonl has step values \\(field 'step'\\) but .*b.jsonl has none"),
    ({"gating_probs": [1.0]}, "a.jsonl has routing probabilities \\(field 'gating_probs'\\) but .*b.jsonl has none"),
])
def test_files_with_and_without_a_field_are_not_mixed(tmp_path, extra, message):
    """Without step values the whole trace would be read as batch size 1; missing probabilities would be 0.0."""
    a = _jsonl(tmp_path, [{"seq_id": s, "layer": 0, "experts": [s], **extra} for s in range(2)], "a.jsonl")
    b = _jsonl(tmp_path, [{"seq_id": 0, "layer": 0, "experts": [3]}], "b.jsonl")
    with pytest.raises(TraceImportError, match=f"{message}.*Fix: import them into separate traces"):
        import_jsonl([a, b])
    assert import_jsonl([a]).num_tokens == 2 and import_jsonl([b]).num_tokens == 1


def test_a_file_given_twice_is_refused(tmp_path):
    path = _jsonl(tmp_path, [{"layer": 0, "experts": [1]}])
    with pytest.raises(TraceImportError, match="log.jsonl is given twice: its sequences would be counted twice"):
        import_jsonl([path, path])
    (tmp_path / "link.jsonl").symlink_to(path)
    with pytest.raises(TraceImportError, match="link.jsonl is given twice \\(as .*log.jsonl and .*link.jsonl\\)"):
        import_jsonl([path, tmp_path / "link.jsonl"])


# -- the command -----------------------------------------------------------------------------------------------------

def _step_log(tmp_path: Path) -> Path:
    """Two sequences of three tokens on one layer, with a step field."""
    return _jsonl(tmp_path, [{"seq": s, "token": t, "step": t, "layer": 0, "experts": [(s + t) % 4, (s + t + 1) % 4]}
                             for s in range(2) for t in range(3)])


def test_command_json_turns_the_progress_bar_off(tmp_path, capsys, monkeypatch):
    import expertflow.trace_import as trace_import

    real, seen = trace_import.import_jsonl, []

    def import_jsonl(*args, **kwargs):
        seen.append(kwargs["progress"])
        return real(*args, **kwargs)

    monkeypatch.setattr(trace_import, "import_jsonl", import_jsonl)
    argv = ["trace", "import", "--input", str(_step_log(tmp_path)), "--out", str(tmp_path / "t.safetensors")]
    assert main(argv + ["--json"]) == 0 and main(argv) == 0
    assert seen == [False, True]


def test_command_names_a_layer_it_leaves_out_as_dense(tmp_path, capsys):
    log = _dense_first_layer_log(tmp_path)
    assert main(["trace", "import", "--input", str(log), "--out", str(tmp_path / "t.safetensors"), "--json"]) == 0
    out, err = capsys.readouterr()
    assert err == (f"expertflow trace import: warning: {log}: layer 0 names no expert on any line: taken as dense and "
                   "left out of the trace (MoE layers 1..2); a header line with moe_layer_indices declares the MoE "
                   "layers explicitly\n")
    assert json.loads(out)["num_layers"] == 2 and Trace.load(tmp_path / "t.safetensors").layer_ids == [1, 2]


def test_command_summary_counts_distinct_steps_and_sequences(tmp_path, capsys):
    assert main(["trace", "import", "--input", str(_step_log(tmp_path)), "--out", str(tmp_path / "t.safetensors"),
                 "--seq-field", "seq", "--token-field", "token", "--step-field", "step", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    trace = Trace.load(tmp_path / "t.safetensors")
    assert summary["tokens"] == 6 and summary["sequences"] == 2
    assert summary["steps"] == len(set(trace.steps.tolist())) < 6


def test_the_largest_float16_weight_and_expert_count_a_trace_holds_are_taken(tmp_path):
    trace = import_jsonl([_jsonl(tmp_path, [{"layer": 0, "experts": [1], "gating_probs": [65504]}])])
    assert trace.gate_probs.tolist() == [[[65504.0]]]
    assert Trace(experts=np.array([[[65535]]], np.int32), num_experts=65536).num_experts == 65536
