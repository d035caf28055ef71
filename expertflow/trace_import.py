"""Import routing logs written by serving engines (vLLM / SGLang profilers and the like) as `expertflow` traces.

Owns: reading JSONL routing logs in either of two shapes, inferring their field names, and turning them into a
`Trace`. Does not know: models, caches or the simulator.

Accepted shapes (one JSON object per line):
  * per (token, layer): `{"problem_id": 0, "layer": 3, "token_idx": 17, "experts": [6, 5], "gating_probs": [..]}`;
  * per token, all layers nested: `{"request_id": "p0", "phase": "decode", "token_id": 32, "token_index": 0,
    "routing": [{"layer_index": 0, "expert_ids": [...]}, ...]}` (a list of per-layer id lists also works).
Lines without routing that carry a record-type marker (`row_type`, `type`, `kind`, ...) are skipped, unless the
marker is the routing lines' own (such a line is a routing line without its routing field: refused); a header line
(`provenance` or `row_type: header`) may give the model name, expert count, top-k and MoE layer indices. When it
declares the layers, every layer must be one of them, and the i-th entry of a routing list without a layer field is
the i-th declared layer. Without one, the MoE layers are those that name an expert on some line; a layer that names
none on any line (a dense layer logged with empty expert lists) is left out, with a warning.

Steps: with a step field (integers), tokens sharing its value share a step. Otherwise the log is read as batch size
1: sequences run one after another (in order of first appearance), the prefill tokens of a sequence form one step
and every decode token is a step of its own. Within a sequence, tokens are ordered by (phase, token field), or by
order of appearance when there is no token field (per-(token, layer) rows are then matched by their order at each
layer, so every layer of a sequence must have as many rows); `positions` is that order. Cells a log lacks become -1.
"""

from __future__ import annotations

import json
import re
import warnings
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from expertflow.trace import DECODE, MAX_EXPERTS, PREFILL, Trace

__all__ = ["JsonlFields", "TraceImportError", "import_jsonl", "CANDIDATES"]

CANDIDATES: dict[str, tuple[str, ...]] = {
    "seq": ("request_id", "seq_id", "sequence_id", "req_id", "rid", "problem_id", "prompt_id", "sample_id"),
    "token": ("token_idx", "token_index", "token_pos", "position", "pos"),
    "layer": ("layer", "layer_id", "layer_idx", "layer_index"),
    "experts": ("experts", "expert_ids", "topk_ids", "topk_experts", "selected_experts", "topk_idx"),
    "probs": ("gating_probs", "gate_probs", "gate_weights", "probs", "topk_weights", "expert_weights", "weights",
              "scores"),
    "phase": ("phase", "stage", "forward_mode"),
    "token_id": ("token_id", "input_id"),
    "step": ("step", "forward_step", "step_id", "iteration"),
    "routing": ("routing", "routes", "layers", "moe_layers"),
}
_FLAG = {"seq": "--seq-field", "token": "--token-field", "layer": "--layer-field", "experts": "--experts-field",
         "probs": "--probs-field", "phase": "--phase-field", "token_id": "--token-id-field", "step": "--step-field",
         "routing": "--routing-field"}
_FP16_MAX = 65504.0  # the largest finite float16: gate_probs are stored in it
_INT32 = (-2**31, 2**31 - 1)  # token ids, expert ids and steps are stored as int32
_MARKERS = ("row_type", "type", "kind", "event", "record_type")
# the header fields read; another that looks like an expert count, top-k or layer list is warned about
_HEADER_FIELDS = ("model_id", "model", "expert_count", "num_experts", "top_k", "moe_layer_indices", "layer_ids")
_PHASES = {"prefill": PREFILL, "prompt": PREFILL, "extend": PREFILL, "context": PREFILL,
           "decode": DECODE, "decoding": DECODE, "generate": DECODE, "generation": DECODE}


class TraceImportError(ValueError):
    """A log line the importer cannot interpret; the message names the file, the line and the fix."""


@dataclass(frozen=True)
class JsonlFields:
    """Field names; None = infer from `CANDIDATES` on the first routing line."""

    seq: str | None = None
    token: str | None = None
    layer: str | None = None
    experts: str | None = None
    probs: str | None = None
    phase: str | None = None
    token_id: str | None = None
    step: str | None = None
    routing: str | None = None


@dataclass
class _Cell:
    token: tuple  # (file, seq value, phase, token key)
    layer: int | None  # None: a token whose routing list is empty (known to have run, its routes not logged)
    experts: list[int]
    probs: list[float] | None
    token_id: int
    step: int | None
    line: int
    ordinal: bool = False  # `layer` comes from the entry's place in a routing list, not from a layer field
    entry: int | None = None  # the entry's place in its line's routing list (nested rows)


class _LogReader:
    """Reads one file's lines into cells, resolving field names on its first routing line."""

    def __init__(self, path: Path, file_index: int, given: JsonlFields) -> None:
        self.path, self.file_index, self.given = path, file_index, given
        self.names: dict[str, str | None] | None = None
        self.nested = False
        self._probs_open = False  # nested rows: the probability field is inferred from the first routing entry
        self.header: dict[str, Any] = {}
        self._counters: dict[tuple, int] = {}
        self._row_lines: dict[tuple, list[int]] = {}  # no token field: the line of each row of (seq, phase, layer)
        self._first_line = 0  # the first routing line, which fixed the field names
        self._marker: dict[str, Any] = {}  # the record-type markers of that line: the routing lines' own
        self._skipped: dict[str, tuple[int, dict]] = {}  # marked lines skipped before it: markers -> (line, markers)
        self._unread: set[str] = set()  # roles already warned about

    def fail(self, line: int, problem: str, fix: str) -> TraceImportError:
        where = f"{self.path}:{line}" if line else str(self.path)  # line 0: the whole file
        return TraceImportError(f"{where}: {problem}. Fix: {fix}")

    def check(self) -> None:
        """The log is a readable file."""
        if self.path.is_dir():
            raise self.fail(0, "a directory", f"give the log files in it, such as {self.path / '*.jsonl'}")
        if not self.path.is_file():
            raise self.fail(0, "no such file", "give an existing JSONL routing log")

    def read(self, bar: tqdm | None = None) -> list[_Cell]:
        cells: list[_Cell] = []
        seen = 0  # `import_jsonl` has checked every file before reading any
        with open(self.path, "rb") as f:
            for line, raw in enumerate(f, start=1):
                if bar is not None:
                    bar.update(len(raw))
                try:
                    text = raw.decode("utf-8-sig" if line == 1 else "utf-8")
                except UnicodeDecodeError:
                    raise self.fail(line, "not UTF-8 text", "give a JSONL routing log (one JSON object per line); a "
                                    "trace file (.safetensors) needs no import") from None
                if text.strip():
                    seen += 1
                    cells.extend(self._row(line, self._parse(line, text)))
        if not seen:
            raise self.fail(0, "the file is empty", "give a JSONL routing log with one JSON object per line")
        if self.names is None:
            raise self.fail(0, "no routing line found", f"name the experts field with {_FLAG['experts']} "
                            f"(looked for {', '.join(CANDIDATES['experts'] + CANDIDATES['routing'])})")
        if not self.nested and self.names["token"] is None:
            self._check_row_counts()
        return cells

    def _parse(self, line: int, text: str) -> dict:
        try:
            text = text.rstrip("\r\n")  # so that an error at the line's end is placed there, not on the next line
            row = json.loads(text)
        except json.JSONDecodeError as exc:
            where = f"{exc.msg}{'' if exc.msg.endswith(' at') else ' at'} column {exc.colno}"  # "… starting at"
            if exc.pos >= len(text.rstrip()) or exc.msg.startswith("Unterminated string"):  # cut inside a string
                raise self.fail(line, f"not valid JSON ({where}: the line ends too soon, cut short?)",
                                "each line must be one JSON object; delete a last line a crash cut short") from exc
            raise self.fail(line, f"not valid JSON ({where})", "each line must be one JSON object") from exc
        except RecursionError:  # brackets nested thousands deep: no routing log has them
            raise self.fail(line, "JSON nested too deeply to read", "each line must be one JSON object of routing "
                            "fields") from None
        if not isinstance(row, dict):
            raise self.fail(line, f"a JSON {type(row).__name__}, not an object", "each line must be one JSON object")
        return row

    def _row(self, line: int, row: dict) -> list[_Cell]:
        if "provenance" in row or row.get("row_type") == "header":
            provenance = row.get("provenance")
            if provenance is not None and not isinstance(provenance, dict):
                raise self.fail(line, f"header field 'provenance' is a JSON {type(provenance).__name__}, not an "
                                "object", 'make it an object such as {"model_id": …, "top_k": 2} or drop it')
            self.header = self._checked_header(line, {**row, **(provenance or {})})
            return []
        if self.names is None and self._resolve(row):
            self._first_line = line
            self._marker = _markers(row)
            for earlier, markers in sorted(self._skipped.values(), key=lambda skipped: skipped[0]):
                if self._marks_routing(markers):  # a routing line before the first one, its routing field missing
                    raise self._missing(earlier)
            self._skipped.clear()
        elif self.names is None:
            if any(m in row for m in _MARKERS):  # another record (or a damaged routing line: told once one is read)
                markers = _markers(row)
                self._skipped.setdefault(json.dumps(markers, sort_keys=True, default=str), (line, markers))
                return []
            raise self.fail(line, f"no expert field (looked for {', '.join(CANDIDATES['experts'])}, or nested "
                            f"{', '.join(CANDIDATES['routing'])}); keys are {sorted(row)}",
                            f"pass {_FLAG['experts']} NAME (or {_FLAG['routing']} NAME for per-token rows)")
        names = self.names
        if names["routing" if self.nested else "experts"] not in row:
            markers = _markers(row)
            if markers and not self._marks_routing(markers):  # another kind of record
                return []
            raise self._missing(line)
        self._warn_unread(line, row)
        return self._cells(line, row)

    def _marks_routing(self, markers: dict[str, Any]) -> bool:
        """Whether a line's record-type markers are those of the routing lines (which then have some)."""
        return bool(self._marker) and all(k in markers and markers[k] == v for k, v in self._marker.items())

    def _missing(self, line: int) -> TraceImportError:
        """A routing line (unmarked, or marked as the routing lines are) without the routing field."""
        what = self.names["routing" if self.nested else "experts"]
        if not self._marker:
            return self.fail(line, f"field {what!r} is missing", "give every routing line the same fields")
        marked = ", ".join(f"{k}={_shown(v)}" for k, v in self._marker.items())
        return self.fail(line, f"field {what!r} is missing from a line marked {marked}, as the routing lines are "
                         f"(the first complete one is line {self._first_line})", f"give every routing line the "
                         f"{what!r} field (an empty list for one not logged); mark lines of other records otherwise")

    def _check_row_counts(self) -> None:
        """Without a token field the n-th row of (sequence, phase, layer) is token n: a row missing at one layer
        would move every later token's route at that layer onto the token before. Refused, unless the rows a layer
        lacks are only at the sequence's end (a log cut short while the last tokens were still being logged: every
        row of that layer comes before the first of the tokens it lacks at the others), which shifts nothing: those
        cells are left unknown, with a warning."""
        per_sequence: dict[tuple, dict[int, list[int]]] = {}
        for (seq, phase, layer), lines in self._row_lines.items():
            per_sequence.setdefault((seq, phase), {})[layer] = lines
        for (seq, phase), rows in per_sequence.items():
            counts = {layer: len(lines) for layer, lines in rows.items()}
            if len(set(counts.values())) == 1:
                continue
            most = max(counts, key=lambda layer: (counts[layer], -layer))
            fewest = min(counts, key=lambda layer: (counts[layer], layer))
            which = "the log" if self.names["seq"] is None else f"sequence {_shown(seq)}"
            if self.names["phase"] is not None:
                which += " (prefill)" if phase == PREFILL else " (decode)"
            if all(rows[short][-1] < rows[other][counts[short]] for short in rows for other in rows
                   if counts[other] > counts[short]):
                warnings.warn(f"{self.path}: {which} has {counts[most]} rows at layer {most} but {counts[fewest]} at "
                              f"layer {fewest}, all before the rows it lacks (a log cut short?): the routes never "
                              "logged are left unknown (-1)", stacklevel=2)
                continue
            raise self.fail(0, f"{which} has {counts[most]} rows at layer {most} but {counts[fewest]} at layer "
                            f"{fewest}: without a token field, rows are matched to tokens by their order at each "
                            "layer, and a missing row would move every later route of that layer onto the token "
                            f"before", f"name the token field with {_FLAG['token']}, or give a log with a row for "
                            "every token at every layer")

    def _checked_header(self, line: int, header: dict) -> dict:
        """The header's counts are positive integers and its layer list holds layer indices."""
        for key, flag in (("top_k", "--top-k"), ("expert_count", "--num-experts"), ("num_experts", "--num-experts")):
            value = header.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise self.fail(line, f"header {key}={value!r} is not a positive integer",
                                f"fix the header, or give the value with {flag}")
        for key in ("moe_layer_indices", "layer_ids"):
            value = header.get(key)
            if value is not None and not (isinstance(value, list) and all(
                    isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)):
                shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:59] + "…"
                raise self.fail(line, f"header {key}={shown} is not a list of layer indices (integers >= 0)",
                                "fix the header or drop the field")
        unread = sorted(k for k, v in header.items() if k not in _HEADER_FIELDS and _looks_like_a_count_or_layers(k, v))
        if unread:  # e.g. n_experts: without a warning the counts would be inferred from the routing, perhaps wrongly
            warnings.warn(f"{self.path}:{line}: header field(s) {', '.join(unread)} are not read; the header fields "
                          "read are " + ", ".join(_HEADER_FIELDS) + ". Rename them, or give --num-experts / --top-k",
                          stacklevel=2)
        return header

    def _resolve(self, row: dict) -> bool:
        """Fix the field names from the first routing row; False when `row` holds no routing."""
        given = {f.name: getattr(self.given, f.name) for f in fields(JsonlFields)}
        pick = {role: name if name else next((c for c in CANDIDATES[role] if c in row), None)
                for role, name in given.items()}
        routing = pick["routing"]
        self.nested = routing is not None and isinstance(row.get(routing), list) and not (
            given["experts"] and given["experts"] in row)
        if not self.nested and (pick["experts"] is None or pick["experts"] not in row):
            return False
        if self.nested and not given["probs"]:  # it sits beside the expert ids, in each routing entry
            pick["probs"], self._probs_open = None, True
        self.names = pick
        return True

    def _warn_unread(self, line: int, row: dict) -> None:
        """A step or phase field that the first routing line lacked is not read (the field names are fixed there):
        say so, as the log is then replayed as one token per forward pass, or all decode."""
        for role in ("step", "phase"):
            if self.names[role] is None and role not in self._unread:
                name = next((c for c in CANDIDATES[role] if c in row), None)
                if name is not None:
                    self._unread.add(role)
                    warnings.warn(f"{self.path}:{line}: field {name!r} ({role}) is not read: the first routing line "
                                  f"(line {self._first_line}) has none, and the fields are taken from it. Give every "
                                  f"routing line the field, or drop it", stacklevel=2)

    def _value(self, line: int, row: dict, role: str, required: bool = False) -> Any:
        name = self.names[role]
        if name is None:
            return None
        if name not in row:
            if required or getattr(self.given, role):
                raise self.fail(line, f"field {name!r} ({role}) is missing",
                                f"give every routing line a {name!r} field or pass {_FLAG[role]} NAME")
            return None
        return row[name]

    def _cells(self, line: int, row: dict) -> list[_Cell]:
        # a field the first routing line has, every routing line has: a line without it would silently become
        # another sequence, a decode token, or (step) turn the whole log into batch size 1
        seq = self._value(line, row, "seq", required=True)
        if self.names["seq"] is not None and (isinstance(seq, bool) or not isinstance(seq, (str, int))):
            raise self.fail(line, f"sequence id {json.dumps(seq)} is neither a string nor an integer",
                            "give every routing line a string or integer id, or name the sequence field with "
                            f"{_FLAG['seq']}")
        phase = self._value(line, row, "phase", required=True)
        if self.names["phase"] is not None and phase is None:  # as decode, a prefill token's line would split it
            raise self.fail(line, f"phase value null in field {self.names['phase']!r}", f"give every routing line "
                            f"one of {sorted(_PHASES)} or 0/1, or name another field with {_FLAG['phase']}")
        phase = _phase(self, line, phase)
        token_id = _int(self, line, self._value(line, row, "token_id", required=True), "token_id", default=-1)
        step = self._value(line, row, "step", required=True)
        # a null would turn the whole log into batch size 1, like a missing step; text would sort "10" before "8"
        if self.names["step"] is not None and (isinstance(step, bool) or not isinstance(step, int)):
            raise self.fail(line, f"step value {json.dumps(step)} is not an integer", "give every routing line the "
                            f"integer index of its forward pass, or name another field with {_FLAG['step']}")
        if step is not None and not _INT32[0] <= step <= _INT32[1]:
            raise self.fail(line, f"step value {step} is outside the int32 range a trace stores steps in",
                            f"give the index of the forward pass, or name another field with {_FLAG['step']}")
        if self.nested:
            entries = row[self.names["routing"]]
            if not isinstance(entries, list):  # the first routing line's is one: this line's is damaged
                raise self.fail(line, f"field {self.names['routing']!r} is {_shown(entries)}, not a list of "
                                "per-layer routing entries", "give every routing line a list (an empty one for a "
                                "token not logged), or mark other lines with a row_type field")
            token = self._token_key(line, row, (seq, phase))
            if not entries:  # the token ran but its routes were not logged: all its cells are missing (-1)
                return [_Cell((self.file_index, seq, phase, token), None, [], None, token_id, step, line)]
            return [self._layer_cell(line, entry, index, (seq, phase, token), token_id, step)
                    for index, entry in enumerate(entries)]
        layer = _int(self, line, self._value(line, row, "layer", required=True), "layer")
        token = self._token_key(line, row, (seq, phase, layer))
        experts, probs = self._experts(line, row)
        return [_Cell((self.file_index, seq, phase, token), layer, experts, probs, token_id, step, line)]

    def _token_key(self, line: int, row: dict, counter_key: tuple) -> int:
        value = self._value(line, row, "token", required=True)
        if value is None:  # no token field: the n-th row of (sequence, phase[, layer]) is token n
            value = self._counters.get(counter_key, 0)
            self._counters[counter_key] = value + 1
            if len(counter_key) == 3:  # (sequence, phase, layer): flat rows, checked by `_check_row_counts`
                self._row_lines.setdefault(counter_key, []).append(line)
        return _int(self, line, value, "token")

    def _layer_cell(self, line: int, entry: Any, index: int, token: tuple, token_id: int,
                    step: int | None) -> _Cell:
        ordinal = True  # no layer field: the place in the list (`_layer_ids` maps it to a model layer)
        if isinstance(entry, dict):
            name = self.names["layer"] or next((c for c in CANDIDATES["layer"] if c in entry), None)
            ordinal = name is None or name not in entry
            layer = index if ordinal else entry[name]
            experts, probs = self._experts(line, entry)
        else:
            self._probs_open = False  # a plain id list: this log gives no probabilities
            if self.names["probs"] is not None:
                raise self.fail(line, f"routing entry {index} is a plain list, without the {self.names['probs']!r} "
                                "field (probs) of the others", f"give every entry a {self.names['probs']!r} field, "
                                f"or pass {_FLAG['probs']} only for logs that have one")
            layer, experts, probs = index, self._expert_list(line, entry), None
        return _Cell((self.file_index, *token), _int(self, line, layer, "layer"), experts, probs, token_id, step,
                     line, ordinal, index)

    def _experts(self, line: int, obj: dict) -> tuple[list[int], list[float] | None]:
        name = self.names["experts"] or next((c for c in CANDIDATES["experts"] if c in obj), None)
        if name is None or name not in obj:
            raise self.fail(line, f"no expert list in {sorted(obj)}", f"pass {_FLAG['experts']} NAME")
        experts = self._expert_list(line, obj[name])
        if self._probs_open:  # the first routing entry decides, as the first routing line does for other fields
            self.names["probs"] = next((c for c in CANDIDATES["probs"] if c in obj), None)
            self._probs_open = False
        probs_name = self.names["probs"]
        if probs_name is None:
            return experts, None
        if probs_name not in obj:  # stored as 0.0, a missing weight could not be told from a real one
            raise self.fail(line, f"field {probs_name!r} (probs) is missing", f"give every routing line a "
                            f"{probs_name!r} field or pass {_FLAG['probs']} NAME")
        probs = obj[probs_name]
        if (not isinstance(probs, list) or len(probs) != len(experts)
                or not all(isinstance(p, (int, float)) for p in probs)):
            raise self.fail(line, f"{probs_name!r} must be a list of {len(experts)} numbers, got {probs!r}",
                            f"fix the line or name the right field with {_FLAG['probs']}")
        if not all(abs(p) <= _FP16_MAX for p in probs):  # False for NaN and inf; exact for an int of any size
            raise self.fail(line, f"{probs_name!r} holds {probs}: traces store routing weights as float16, finite "
                            f"and at most {_FP16_MAX:g} in size", f"fix the line or name another field with "
                            f"{_FLAG['probs']}")
        return experts, probs

    def _expert_list(self, line: int, value: Any) -> list[int]:
        if not isinstance(value, list) or not all(isinstance(e, int) and not isinstance(e, bool) for e in value):
            raise self.fail(line, f"expert ids must be a list of integers, got {value!r}",
                            f"fix the line or name the right field with {_FLAG['experts']}")
        if any(e < -1 for e in value):
            raise self.fail(line, f"negative expert id in {value}", "expert ids are >= 0 (-1 = none)")
        if any(e >= MAX_EXPERTS for e in value):
            raise self.fail(line, f"expert id {max(value)} is beyond the {MAX_EXPERTS:,} experts per layer a trace "
                            "holds", f"fix the line or name the right field with {_FLAG['experts']}")
        chosen = [e for e in value if e >= 0]
        if len(set(chosen)) != len(chosen):
            raise self.fail(line, f"an expert is named twice in {value}", "each expert at most once per token and "
                            "layer (a top-k router picks k distinct experts)")
        return value


def _markers(row: dict) -> dict[str, Any]:
    """A line's record-type markers (`row_type`, `type`, …) and their values."""
    return {k: row[k] for k in _MARKERS if k in row}


def _shown(value: Any) -> str:
    """A JSON value as the log has it, cut to a readable length."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:39] + "…"


def _int(reader: _LogReader, line: int, value: Any, role: str, default: int | None = None) -> int:
    if value is None and default is not None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise reader.fail(line, f"{role} value {value!r} is not an integer",
                          f"name an integer field with {_FLAG[role]}")
    if role == "layer" and value < 0:
        raise reader.fail(line, f"layer index {value} is negative", f"layers are numbered from 0; name the layer "
                          f"field with {_FLAG['layer']}")
    if role == "token_id" and not _INT32[0] <= value <= _INT32[1]:
        raise reader.fail(line, f"token_id value {value} is outside the int32 range a trace stores token ids in",
                          f"fix the line or name the vocabulary id field with {_FLAG[role]}")
    return value


def _phase(reader: _LogReader, line: int, value: Any) -> int:
    if value is None:  # the log has no phase field
        return DECODE
    if isinstance(value, int) and value in (PREFILL, DECODE):
        return value
    if isinstance(value, str) and value.lower() in _PHASES:
        return _PHASES[value.lower()]
    raise reader.fail(line, f"phase value {value!r} is neither prefill nor decode",
                      f"use one of {sorted(_PHASES)} or 0/1, or name another field with {_FLAG['phase']}")


def import_jsonl(paths: Sequence[str | Path], fields: JsonlFields = JsonlFields(), num_experts: int | None = None,
                 top_k: int | None = None, model: str | None = None, progress: bool = False) -> Trace:
    """Read one or more JSONL routing logs (sequences of different files never merge) into one `Trace`; the files
    must come from one model. `progress` shows a bar of the bytes read on stderr."""
    readers = [_LogReader(Path(p), i, fields) for i, p in enumerate(paths)]
    seen: dict[tuple[int, int], Path] = {}
    for reader in readers:
        reader.check()
        stat = reader.path.stat()
        first = seen.setdefault((stat.st_dev, stat.st_ino), reader.path)  # also through a link or another spelling
        if first is not reader.path:
            same = "" if first == reader.path else f" (as {first} and {reader.path})"
            raise TraceImportError(f"{reader.path} is given twice{same}: its sequences would be counted twice. Fix: "
                                   "give each log once")
    size = sum(r.path.stat().st_size for r in readers)
    with tqdm(total=size, desc="reading logs", unit="B", unit_scale=True, delay=1, disable=not progress) as bar:
        per_file = [reader.read(bar) for reader in readers]
    _check_one_model(readers, per_file)
    _check_same_fields(readers)
    cells = [cell for part in per_file for cell in part]
    if not any(cell.experts for cell in cells):
        raise _no_expert(readers)
    header = {k: v for r in readers for k, v in r.header.items()}
    return _assemble(cells, readers, header, num_experts, top_k, model)


def _check_one_model(readers: list[_LogReader], per_file: list[list[_Cell]]) -> None:
    """Refuse logs of different models: their headers, top-k or MoE layers disagree."""
    def facts(reader: _LogReader, cells: list[_Cell]) -> dict[str, Any]:
        named = {"model": reader.header.get("model_id") or reader.header.get("model"),
                 "num_experts": reader.header.get("expert_count") or reader.header.get("num_experts"),
                 "top_k": reader.header.get("top_k")}
        return {**{k: v for k, v in named.items() if v is not None},
                "experts per token": max((len(c.experts) for c in cells), default=0),
                "MoE layers": sorted({c.layer for c in cells if c.layer is not None})}

    first = facts(readers[0], per_file[0])
    for reader, cells in zip(readers[1:], per_file[1:]):
        other = facts(reader, cells)
        differ = [key for key in first if key in other and first[key] != other[key]]
        if differ:
            key = differ[0]
            raise TraceImportError(f"{readers[0].path} and {reader.path} come from different models ({key} "
                                   f"{_short(first[key])} vs {_short(other[key])}). Fix: import each model's logs "
                                   "into a trace of its own")


def _check_same_fields(readers: list[_LogReader]) -> None:
    """Refuse files of which some have step values or probabilities and others none: without steps the whole
    trace would be read as batch size 1, and missing probabilities would be stored as 0.0."""
    for role, what in (("step", "step values"), ("probs", "routing probabilities")):
        having = [r for r in readers if r.names[role] is not None]
        lacking = [r for r in readers if r.names[role] is None]
        if having and lacking:
            raise TraceImportError(f"{having[0].path} has {what} (field {having[0].names[role]!r}) but "
                                   f"{lacking[0].path} has none. Fix: import them into separate traces, or give "
                                   f"every file a {having[0].names[role]!r} field")


def _no_expert(readers: list[_LogReader]) -> TraceImportError:
    """The logs hold no routing at all: no line names an expert."""
    return TraceImportError(f"{', '.join(str(r.path) for r in readers)}: no routing line names an expert. Fix: give "
                            f"logs with expert ids, or name their field with {_FLAG['experts']}")


def _short(value: Any) -> str:
    """A layer list as first..last when it is a run, else the value as it is."""
    if isinstance(value, list) and value and value == list(range(value[0], value[-1] + 1)):
        return f"{value[0]}..{value[-1]}"
    return repr(value)


def _assemble(cells: list[_Cell], readers: list[_LogReader], header: dict, num_experts: int | None,
              top_k: int | None, model: str | None) -> Trace:
    first = {}
    for cell in cells:
        first.setdefault(cell.token[:2], len(first))  # sequences in order of first appearance
    tokens = sorted({c.token for c in cells}, key=lambda t: (first[t[:2]], t[2], t[3]))
    row_of = {t: i for i, t in enumerate(tokens)}
    layer_ids = _layer_ids(cells, readers, header)
    layer_of = {layer: i for i, layer in enumerate(layer_ids)}
    k = top_k or header.get("top_k") or _common_k(cells, readers)
    longest = max(len(c.experts) for c in cells)
    if k > longest:  # every cell would get k - longest missing experts, and overlap is counted out of k
        given = "--top-k" if top_k else "the header's top_k"
        raise TraceImportError(f"{', '.join(str(r.path) for r in readers)}: top_k={k} ({given}), but no routing line "
                               f"names more than {longest} experts: every cell would have {k - longest} missing, and "
                               f"the overlap statistics would count out of {k}. Fix: give --top-k {longest} (the "
                               "experts the model routes each token to)" + ("" if top_k else ", or fix the header"))
    n_exp = num_experts or header.get("expert_count") or header.get("num_experts") or \
        max(max(c.experts, default=-1) for c in cells) + 1
    experts = np.full((len(tokens), len(layer_ids), k), -1, dtype=np.int32)
    probs = np.zeros(experts.shape, dtype=np.float16) if any(c.probs is not None for c in cells) else None
    seen: dict[tuple[int, int], _Cell] = {}
    token_ids = np.full(len(tokens), -1, dtype=np.int32)
    id_line: dict[int, int] = {}  # row -> the line that gave its token id
    step_line: dict[int, int] = {}  # row -> the line that gave its step
    step_values: list[int | None] = [None] * len(tokens)
    for cell in cells:
        reader = readers[cell.token[0]]
        row, col = row_of[cell.token], layer_of.get(cell.layer)  # None: a layer left out as dense
        if cell.layer is not None and (row, cell.layer) in seen:
            before = seen[row, cell.layer]
            if before.line == cell.line:  # one routing list: the token field cannot help
                place = "; an entry without a layer field stands for the layer of its place in the list" \
                    if before.ordinal or cell.ordinal else ""
                raise reader.fail(cell.line, f"the routing list names layer {cell.layer} twice (entries "
                                  f"{before.entry} and {cell.entry}{place})", f"give each layer once, or name the "
                                  f"layer field with {_FLAG['layer']}")
            raise reader.fail(cell.line, f"a second routing for the same token and layer {cell.layer} "
                              f"(first on line {before.line})", f"the token field must tell tokens apart; "
                              f"check {_FLAG['token']} / {_FLAG['seq']}")
        seen[row, cell.layer] = cell
        if len(cell.experts) > k or max(cell.experts, default=-1) >= n_exp:
            raise reader.fail(cell.line, f"experts {cell.experts} do not fit top_k={k}, num_experts={n_exp}",
                              "pass the right --top-k / --num-experts")
        if col is not None:
            experts[row, col, :len(cell.experts)] = cell.experts
            if probs is not None and cell.probs is not None:
                probs[row, col, :len(cell.probs)] = cell.probs
        if cell.token_id != -1:  # -1 (null): this line does not know the token's vocabulary id
            if row not in id_line:
                token_ids[row], id_line[row] = cell.token_id, cell.line
            elif token_ids[row] != cell.token_id:
                raise reader.fail(cell.line, f"token_id {cell.token_id} differs from the token_id {token_ids[row]} "
                                  f"of the same token on line {id_line[row]}", f"the token field must tell tokens "
                                  f"apart; check {_FLAG['token']} / {_FLAG['seq']}, or name the vocabulary id field "
                                  f"with {_FLAG['token_id']}")
        if cell.step is not None:
            if row not in step_line:
                step_values[row], step_line[row] = cell.step, cell.line
            elif step_values[row] != cell.step:  # the last one winning would move the token to another pass
                raise reader.fail(cell.line, f"step {cell.step} differs from the step {step_values[row]} of the same "
                                  f"token on line {step_line[row]}", f"a token runs in one forward pass; the token "
                                  f"field must tell tokens apart: check {_FLAG['token']} / {_FLAG['seq']}, or name "
                                  f"the step field with {_FLAG['step']}")
    seq_ids = np.array([first[t[:2]] for t in tokens], dtype=np.int32)
    phase = np.array([t[2] for t in tokens], dtype=np.uint8)
    positions = _positions(seq_ids)
    steps = _steps(seq_ids, phase, [(t[0], v) for t, v in zip(tokens, step_values)])
    model = model or header.get("model_id") or header.get("model") or "unknown"
    source = "jsonl:" + ",".join(r.path.name for r in readers)
    return Trace(experts=experts, num_experts=int(n_exp), token_ids=token_ids, seq_ids=seq_ids,
                 positions=positions, steps=steps, phase=phase, gate_probs=probs, model=str(model),
                 layer_ids=layer_ids, source=source)


def _layer_ids(cells: list[_Cell], readers: list[_LogReader], header: dict) -> list[int]:
    """The model's indices of the MoE layers. With a header that declares them, every layer must be one of them, and
    the i-th entry of a routing list (no layer field) is the i-th declared layer (a model's first layers may be
    dense); without one, the layers the log names an expert at. A layer that names none on any line (a dense layer
    logged with empty expert lists) is left out, with a warning: counted, its experts would not exist."""
    key = next((k for k in ("moe_layer_indices", "layer_ids") if header.get(k)), None)
    if key is None:
        routed = sorted({c.layer for c in cells if any(e >= 0 for e in c.experts)})
        if not routed:
            raise _no_expert(readers)
        dense = sorted({c.layer for c in cells if c.layer is not None} - set(routed))
        if dense:
            named = f"layer {dense[0]} names" if len(dense) == 1 else f"layers {_short(dense)} name"
            warnings.warn(f"{', '.join(str(r.path) for r in readers)}: {named} no expert on any line: taken as "
                          f"dense and left out of the trace (MoE layers {_short(routed)}); a header line with "
                          "moe_layer_indices declares the MoE layers explicitly", stacklevel=4)
        return routed
    declared = sorted(set(header[key]))
    for cell in cells:
        if cell.layer is None:
            continue
        if cell.ordinal and cell.layer >= len(declared):
            raise readers[cell.token[0]].fail(
                cell.line, f"the routing list has more than the {len(declared)} MoE layers of the header's {key} "
                f"{_short(declared)}", f"fix the header's {key}, or drop it")
        if cell.ordinal:
            cell.layer = declared[cell.layer]
        elif cell.layer not in declared:
            raise readers[cell.token[0]].fail(
                cell.line, f"layer {cell.layer} is not one of the header's {key} {_short(declared)}",
                f"fix the header's {key} (or drop it), or name the layer field with {_FLAG['layer']}")
    return declared


def _common_k(cells: list[_Cell], readers: list[_LogReader]) -> int:
    """Top-k when neither --top-k nor a header gives it: the most common length of the lines' expert lists. Shorter
    lists are cells with experts missing (padded with -1); a longer one is refused, since one stray line would
    otherwise make the whole trace top-(k+1)."""
    lengths = Counter(len(c.experts) for c in cells if c.experts)
    k = max(lengths, key=lambda n: (lengths[n], n))  # a tie goes to the longer list: line order must not matter
    longer = next((c for c in cells if len(c.experts) > k), None)
    if longer is not None:
        raise readers[longer.token[0]].fail(
            longer.line, f"{len(longer.experts)} experts {longer.experts}, where {lengths[k]} of the "
            f"{sum(lengths.values())} routing entries name {k}", f"give --top-k {len(longer.experts)} if the model "
            f"routes each token to {len(longer.experts)} experts, else fix the line")
    return k


def _positions(seq_ids: np.ndarray) -> np.ndarray:
    """Index of each token within its sequence (tokens are already in sequence order)."""
    starts = np.r_[0, np.flatnonzero(np.diff(seq_ids)) + 1]
    lengths = np.diff(np.r_[starts, len(seq_ids)])
    return (np.arange(len(seq_ids)) - np.repeat(starts, lengths)).astype(np.int32)


def _steps(seq_ids: np.ndarray, phase: np.ndarray, step_values: Iterable[tuple[int, int | None]]) -> np.ndarray:
    values = list(step_values)
    if all(v is not None for _, v in values) and values:
        order = {key: i for i, key in enumerate(sorted(set(values), key=lambda fv: (fv[0], fv[1])))}
        return np.array([order[v] for v in values], dtype=np.int32)
    steps = np.empty(len(seq_ids), dtype=np.int32)  # batch size 1: one prefill step, then one per decode token
    step = -1
    for i in range(len(seq_ids)):
        new_seq = i == 0 or seq_ids[i] != seq_ids[i - 1]
        if new_seq or phase[i] == DECODE or phase[i - 1] == DECODE:
            step += 1
        steps[i] = step
    return steps


def _looks_like_a_count_or_layers(key: str, value: Any) -> bool:
    """A header field that could be meant as the expert count or top-k (an integer named so: `n_experts`,
    `topk`, not `expert_parallel_size` or `stop_token_id`) or the MoE layers (a list of integers named after layers)
    under a name the importer does not read."""
    if isinstance(value, int) and not isinstance(value, bool):
        return re.search(r"(num|n|count)_?experts?|experts?_?(count|num|number)|top_?k", key, re.I) is not None
    return (isinstance(value, list) and re.search("layer", key, re.I) is not None
            and all(isinstance(v, int) and not isinstance(v, bool) for v in value))
