"""Routing traces: which experts every token chose at every MoE layer, and in which forward step it ran.

Owns: the `expertflow.trace/1` file format (safetensors tensors + string metadata), its validation, the request view
the simulator replays (`requests()`), re-batching, subsets and summary statistics. Does not know: models, policies,
caches or how a trace was obtained (the recorder and the JSONL importer build `Trace` objects; they live elsewhere).

Shape legend: N = tokens, L = MoE layers, K = experts per token (top-k), E = experts per layer, S = steps.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

__all__ = ["FORMAT", "Trace", "TraceFormatError", "Request", "record"]

FORMAT = "expertflow.trace/1"
MAX_EXPERTS = 1 << 16  # experts per layer a trace may declare: far above any model's, small enough for dense stats
PREFILL, DECODE = 0, 1
_INT_TENSORS = ("token_ids", "seq_ids", "positions", "steps")
_REQUIRED = ("experts", *_INT_TENSORS, "phase")
_META = ("format", "model", "num_layers", "num_experts", "top_k", "layer_ids", "source")
_DTYPES = {name: np.int32 for name in ("experts", *_INT_TENSORS)} | {"phase": np.uint8, "gate_probs": np.float16}
_STORED = {name: {np.int32: "I32", np.uint8: "U8", np.float16: "F16"}[dtype] for name, dtype in _DTYPES.items()}


def _sort_metadata(path: str | Path) -> None:
    """Put the metadata of the safetensors file `path` in key order: safetensors writes it in an order that changes
    from one process to the next, so the same trace would not be the same bytes (checksums and diffs would differ).
    The header keeps its length, so the tensors stay where they are."""
    with open(path, "r+b") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
        if "__metadata__" not in header:
            return
        header = {"__metadata__": dict(sorted(header.pop("__metadata__").items())), **header}
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        if len(text) <= size:  # as safetensors wrote it, but for the order: the same length
            f.seek(8)
            f.write(text.ljust(size, b" "))  # safetensors pads its header with spaces


def umask_permissions(path: str | Path, directory: bool = False) -> None:
    """Give a file (or directory) the permissions the user's umask asks for: safetensors and `tempfile` create them
    readable by the owner only."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, (0o777 if directory else 0o666) & ~mask)


class TraceFormatError(ValueError):
    """A trace file or Trace object that does not follow `expertflow.trace/1`."""


class Request(NamedTuple):
    """R(step, layer): the distinct experts (ascending) named by all tokens of `step` at MoE layer `layer`."""

    step: int
    layer: int
    experts: tuple[int, ...]
    routes: tuple[tuple[int, ...], ...]  # per token of the step, top-k order, -1 = none
    tokens: int


def record(*args: Any, **kwargs: Any) -> Any:
    """Record a trace by running a model (see `expertflow.recorder.record`; imported lazily, it needs torch)."""
    from expertflow.recorder import record as _record

    return _record(*args, **kwargs)


def _check_format(path: Path, meta: dict[str, str]) -> None:
    """The file's metadata names this format (else say whose it may be)."""
    found = meta.get("format")
    if found != FORMAT and str(found).startswith(FORMAT.split("/")[0] + "/"):
        raise TraceFormatError(f"{path}: format {found!r} comes from another version of expertflow; this one "
                               f"reads {FORMAT!r}: record or import the trace again with this version")
    if found != FORMAT:
        raise TraceFormatError(f"{path}: metadata format={found!r}, expected {FORMAT!r}; "
                               "is this an expertflow trace? (import logs with `expertflow trace import`)")


@dataclass
class Trace:
    """The tensors and metadata of one trace. Omitted per-token tensors get neutral defaults (see `__post_init__`)."""

    experts: np.ndarray  # [N, L, K] int32, -1 = none/missing
    num_experts: int
    token_ids: np.ndarray | None = None  # [N] int32, -1 = unknown
    seq_ids: np.ndarray | None = None  # [N] int32
    positions: np.ndarray | None = None  # [N] int32
    steps: np.ndarray | None = None  # [N] int32
    phase: np.ndarray | None = None  # [N] uint8, 0 prefill / 1 decode
    gate_probs: np.ndarray | None = None  # [N, L, K] float16
    model: str = "unknown"
    layer_ids: list[int] | None = None
    source: str = ""
    extra_metadata: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.experts = _int_array(self.experts, "experts", np.int32)
        if self.experts.ndim != 3:
            raise TraceFormatError(f"experts must be [N, L, K]; got shape {tuple(self.experts.shape)}")
        n = len(self.experts)
        defaults = {"token_ids": np.full(n, -1), "seq_ids": np.zeros(n, dtype=np.int32), "positions": np.arange(n),
                    "steps": np.arange(n), "phase": np.full(n, DECODE)}
        for name, default in defaults.items():
            value = getattr(self, name)
            dtype = np.uint8 if name == "phase" else np.int32
            setattr(self, name, _int_array(default if value is None else value, name, dtype))
        if self.gate_probs is not None:
            with np.errstate(over="ignore"):  # a weight beyond float16 becomes inf, which `validate` refuses
                self.gate_probs = _as_numpy(self.gate_probs).astype(np.float16, copy=False)
        self.num_experts = _integer(self.num_experts, "num_experts")
        self.layer_ids = list(range(self.num_layers)) if self.layer_ids is None else [
            _integer(i, "a layer_ids entry") for i in self.layer_ids]
        self.validate()

    # -- shape ------------------------------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return int(self.experts.shape[0])

    @property
    def num_layers(self) -> int:
        return int(self.experts.shape[1])

    @property
    def top_k(self) -> int:
        return int(self.experts.shape[2])

    def __repr__(self) -> str:  # a summary: the tensors can hold millions of entries
        return (f"Trace(model={self.model!r}, tokens={self.num_tokens}, sequences={len(np.unique(self.seq_ids))}, "
                f"steps={len(np.unique(self.steps))}, layers={self.num_layers}, experts={self.num_experts}, "
                f"top_k={self.top_k})")

    def validate(self) -> None:
        """Raise TraceFormatError naming the first inconsistency (`save` calls it: what `load` would refuse is never
        written)."""
        tensors = [*_REQUIRED, *(["gate_probs"] if self.gate_probs is not None else [])]
        for name in tensors:  # a value set after construction is checked here, not cast (that could wrap it)
            value = getattr(self, name)
            if not isinstance(value, np.ndarray):
                raise TraceFormatError(f"{name} is a {type(value).__name__}, not a NumPy array; build a new Trace "
                                       "from the values")
            if value.dtype != _DTYPES[name]:
                raise TraceFormatError(f"{name} has dtype {value.dtype}, expected {np.dtype(_DTYPES[name]).name}; "
                                       "build a new Trace from the values")
        if self.experts.ndim != 3:
            raise TraceFormatError(f"experts must be [N, L, K]; got shape {tuple(self.experts.shape)}")
        n = self.num_tokens
        for name in (*_INT_TENSORS, "phase"):
            shape = tuple(getattr(self, name).shape)
            if shape != (n,):
                raise TraceFormatError(f"{name} must have shape [N]=({n},) like experts; got {shape}")
        _integer(self.num_experts, "num_experts")
        if not isinstance(self.layer_ids, (list, tuple, np.ndarray)):
            raise TraceFormatError(f"layer_ids must be a list of layer indices; got {self.layer_ids!r}")
        for layer in self.layer_ids:
            _integer(layer, "a layer_ids entry")
        self._validate_metadata()
        if self.gate_probs is not None and self.gate_probs.shape != self.experts.shape:
            raise TraceFormatError(f"gate_probs shape {tuple(self.gate_probs.shape)} != experts shape "
                                   f"{tuple(self.experts.shape)}")
        if self.num_experts < 1:
            raise TraceFormatError(f"num_experts={self.num_experts} must be at least 1")
        if self.num_experts > MAX_EXPERTS:  # every statistic and policy keeps a row per (layer, expert)
            top = int(self.experts.max(initial=-1))
            raise TraceFormatError(f"num_experts={self.num_experts} is more than a trace can hold ({MAX_EXPERTS:,}); "
                                   f"give the model's expert count (the largest expert id here is {top})")
        if not self.num_layers or not self.top_k:  # every statistic and request is per (MoE layer, top-k slot)
            raise TraceFormatError(f"experts has shape {tuple(self.experts.shape)}: a trace needs at least one MoE "
                                   "layer (L) and one expert per token (K); record or import it from a MoE model")
        if len(self.layer_ids) != self.num_layers:
            raise TraceFormatError(f"layer_ids has {len(self.layer_ids)} entries for {self.num_layers} MoE layers")
        if min(self.layer_ids) < 0 or len(set(self.layer_ids)) != len(self.layer_ids):
            raise TraceFormatError(f"layer_ids {self.layer_ids} must be distinct layer indices >= 0 (the model's "
                                   "index of each MoE layer)")
        self._validate_values()

    def _validate_metadata(self) -> None:
        """The metadata a file stores: strings, and no extra key that the format's own would overwrite."""
        for key in ("model", "source"):
            value = getattr(self, key)
            if not isinstance(value, str):
                raise TraceFormatError(f"{key} must be a string (trace metadata is text); got {value!r} "
                                       f"({type(value).__name__})")
        if not isinstance(self.extra_metadata, dict):
            raise TraceFormatError("extra_metadata must be a dict of strings; got "
                                   f"{type(self.extra_metadata).__name__}")
        for key, value in self.extra_metadata.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise TraceFormatError(f"extra_metadata {key!r}: {value!r} ({type(value).__name__}): trace metadata "
                                       "keys and values are strings; store str(value), or json.dumps(value)")
            if key in _META:
                raise TraceFormatError(f"extra_metadata key {key!r} is one the format writes itself ("
                                       f"{', '.join(_META)}); set the Trace's own field, or use another key")
        for key, value in [("model", self.model), ("source", self.source), *self.extra_metadata.items()]:
            for text in (key, value):
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError:  # a lone surrogate: a name given in bytes that are not UTF-8
                    raise TraceFormatError(f"metadata {key!r}: {text!r} is not text a file can store (not valid "
                                           "UTF-8); give the name in UTF-8") from None

    def _validate_values(self) -> None:
        """The values of the tensors whose shapes and dtypes `validate` has checked."""
        n = self.num_tokens
        if n and (self.experts.min() < -1 or self.experts.max() >= self.num_experts):
            raise TraceFormatError(f"expert ids must lie in [-1, {self.num_experts}); found "
                                   f"{int(self.experts.min())}..{int(self.experts.max())} "
                                   "(is num_experts right?)")
        if n and self.phase.max() > DECODE:
            raise TraceFormatError(f"phase values must be 0 (prefill) or 1 (decode); found {int(self.phase.max())}")
        if self.gate_probs is not None and not np.isfinite(self.gate_probs).all():
            raise TraceFormatError("gate_probs holds NaN or infinite values (float16 holds at most 65504 in size); "
                                   "give finite routing weights, or none")

    # -- file format ------------------------------------------------------------------------------------------------
    def metadata(self) -> dict[str, str]:
        meta = dict(self.extra_metadata)
        meta.update(format=FORMAT, model=self.model, num_layers=str(self.num_layers),
                    num_experts=str(self.num_experts), top_k=str(self.top_k),
                    layer_ids=json.dumps([int(i) for i in self.layer_ids]), source=self.source)
        return meta

    def save(self, path: str | Path) -> None:
        """Validate, then write atomically: a trace that `load` would refuse is refused here, before anything is
        written, so an existing file at `path` stays as it was."""
        from safetensors import SafetensorError
        from safetensors.numpy import save_file

        self.validate()  # fields set after construction (an int64 array, another num_experts) are checked here
        tensors = {name: np.ascontiguousarray(getattr(self, name)) for name in _REQUIRED}
        if self.gate_probs is not None:
            tensors["gate_probs"] = np.ascontiguousarray(self.gate_probs)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.partial")  # renamed into place once complete: never a torn file
        try:
            save_file(tensors, str(partial), metadata=self.metadata())
            _sort_metadata(partial)
            umask_permissions(partial)
            os.replace(partial, path)
        except SafetensorError as exc:  # the writer's own error type for a file it cannot create or fill
            raise OSError(f"cannot write {path} ({exc}); give a writable place") from None
        finally:
            try:
                partial.unlink(missing_ok=True)
            except OSError:  # e.g. a read-only file system: the error that got here says more
                pass

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        """Read and validate a trace file; errors name the file, the problem and the fix."""
        from safetensors import SafetensorError, safe_open

        path = Path(path)
        if path.is_dir():
            raise TraceFormatError(f"{path} is a directory; give a trace file (.safetensors)")
        if not path.exists():
            raise FileNotFoundError(f"trace file {path} does not exist")
        if not path.is_file():  # a device, a named pipe: nothing a trace can be read from
            raise TraceFormatError(f"{path} is not a regular file; give a trace file (.safetensors)")
        try:
            with safe_open(str(path), framework="np") as f:
                meta = f.metadata() or {}
                _check_format(path, meta)  # before the tensors: another format's may be stored otherwise
                known = [name for name in (*_REQUIRED, "gate_probs") if name in f.keys()]
                for name in known:  # before reading: NumPy cannot hold e.g. bfloat16, and a clear error is better
                    found = f.get_slice(name).get_dtype()
                    if found != _STORED[name]:
                        raise TraceFormatError(f"{path}: tensor {name} is stored as {found}, expected "
                                               f"{_STORED[name]} ({np.dtype(_DTYPES[name]).name})")
                tensors = {name: f.get_tensor(name) for name in known}  # others are a writer's extras: unread
        except SafetensorError as exc:
            short = _cut_short(path)
            if short is not None:
                raise TraceFormatError(f"{path} is truncated ({short}): it was cut short, e.g. by a partial copy or "
                                       "a full disk; copy or write it again") from exc
            raise TraceFormatError(f"{path} is not a safetensors file ({exc}); give a trace written by `expertflow "
                                   "trace record` or `expertflow trace import`") from exc
        return cls._from_parts(path, meta, tensors)

    @classmethod
    def _from_parts(cls, path: Path, meta: dict[str, str], tensors: dict[str, np.ndarray]) -> Trace:
        """A trace from `load`'s parts: format and dtypes already checked there."""
        missing = [name for name in _REQUIRED if name not in tensors]
        missing += [key for key in _META if key not in meta]
        if missing:
            raise TraceFormatError(f"{path} lacks {', '.join(missing)}; an {FORMAT} file has tensors "
                                   f"{', '.join(_REQUIRED)} and metadata {', '.join(_META)}")
        header = {}
        for key in ("num_layers", "num_experts", "top_k"):
            try:
                header[key] = int(meta[key])
            except ValueError:
                raise TraceFormatError(f"{path}: metadata {key}={meta[key]!r} is not an integer; an {FORMAT} file "
                                       "stores counts as decimal text such as '8'") from None
        try:
            layer_ids = json.loads(meta["layer_ids"])
        except (json.JSONDecodeError, RecursionError):  # not JSON, or lists nested thousands deep
            layer_ids = None
        if not isinstance(layer_ids, list) or not all(type(i) is int for i in layer_ids):
            shown = meta["layer_ids"] if len(meta["layer_ids"]) <= 80 else meta["layer_ids"][:77] + "…"
            raise TraceFormatError(f"{path}: metadata layer_ids={shown!r} must be a JSON list of the model's layer "
                                   "indices, such as [0, 1, 2]")
        shape = tuple(tensors["experts"].shape)
        if len(shape) != 3 or shape[1:] != (header["num_layers"], header["top_k"]):
            raise TraceFormatError(f"{path}: experts has shape {shape} but metadata says num_layers="
                                   f"{header['num_layers']}, top_k={header['top_k']}")
        extra = {k: v for k, v in meta.items() if k not in _META}
        parts = {name: tensors.get(name) for name in (*_REQUIRED, "gate_probs")}
        try:
            return cls(num_experts=header["num_experts"], model=meta["model"], layer_ids=layer_ids,
                       source=meta["source"], extra_metadata=extra, **parts)
        except TraceFormatError as exc:
            raise TraceFormatError(f"{path}: {exc}") from None

    # -- views ------------------------------------------------------------------------------------------------------
    def _select(self, index: np.ndarray, **changes: Any) -> Trace:
        parts = {name: getattr(self, name)[index] for name in _REQUIRED}
        if self.gate_probs is not None:
            parts["gate_probs"] = self.gate_probs[index]
        parts.update(changes)
        return replace(self, **parts)

    def _sequence_order(self) -> np.ndarray:
        """Token indices sorted by (sequence, step, position)."""
        return np.lexsort((self.positions, self.steps, self.seq_ids))

    def requests(self) -> Iterator[Request]:
        """Yield R(step, layer) in (step, layer) order; tokens inside a step in (sequence, position) order."""
        order = np.lexsort((self.positions, self.seq_ids, self.steps))
        steps = self.steps[order]
        bounds = np.flatnonzero(np.diff(steps)) + 1
        for idx in np.split(order, bounds) if len(order) else []:
            step = int(self.steps[idx[0]])
            per_token = self.experts[idx].tolist()  # host lists: the simulator works on Python ints
            for layer in range(self.num_layers):
                routes = tuple(tuple(tok[layer]) for tok in per_token)
                experts = tuple(sorted({e for route in routes for e in route if e >= 0}))
                yield Request(step, layer, experts, routes, len(idx))

    def rebatch(self, batch_size: int) -> Trace:
        """Replay the sequences as if `batch_size` of them ran together.

        Sequences are grouped `batch_size` at a time in ascending sequence id. Within a sequence, each distinct
        original step (a prefill chunk or one decode token) gets its rank r = 0, 1, …; the token's new step is the
        group's first step + r. Groups follow one another; a group lasts as long as its longest sequence.
        """
        batch_size = _integer(batch_size, "batch_size")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be at least 1")
        new_steps = np.empty_like(self.steps)
        if self.num_tokens:
            _, seq_rank = np.unique(self.seq_ids, return_inverse=True)  # [N] 0, 1, … in ascending sequence id
            order = np.lexsort((self.steps, seq_rank))
            seq, steps = seq_rank[order], self.steps[order]
            first = np.r_[True, seq[1:] != seq[:-1]]  # [N] first token of its sequence (sorted order)
            count = np.cumsum(first | np.r_[True, steps[1:] != steps[:-1]])  # distinct (sequence, step) so far
            starts = np.flatnonzero(first)  # [Q] sequences in ascending id
            rank = count - count[starts][seq]  # [N] rank of the token's step within its sequence
            length = np.maximum.reduceat(rank, starts) + 1  # [Q]
            batch_size = min(batch_size, len(starts))  # more than there are sequences: one group
            longest = np.maximum.reduceat(length, np.arange(0, len(starts), batch_size))  # [groups]
            offset = np.r_[0, np.cumsum(longest)[:-1]]
            new_steps[order] = offset[seq // batch_size] + rank
        return replace(self, steps=new_steps, source=f"{self.source} | rebatch({batch_size})".strip(" |"))

    def subset(self, seq_ids: Iterable[int]) -> Trace:
        """The tokens of the given sequences (steps kept as they are)."""
        wanted = np.array(sorted({_integer(s, "a sequence id") for s in seq_ids}), dtype=np.int64)
        unknown = np.setdiff1d(wanted, self.seq_ids)
        if len(unknown):
            raise ValueError(f"sequence ids {unknown.tolist()} are not in the trace "
                             f"(it has {np.unique(self.seq_ids).tolist()})")
        return self._select(np.flatnonzero(np.isin(self.seq_ids, wanted)))

    def stats(self) -> dict[str, Any]:
        """Summary figures: expert load balance, temporal overlap, distinct experts per step (see docs)."""
        load = self._load_max_over_mean()
        per_seq = self._load_per_sequence()
        overlap, pairs = self._temporal_overlap()
        distinct, distinct_mean = self._distinct_per_step()
        missing = int(np.all(self.experts < 0, axis=2).sum())
        return {
            "model": self.model, "tokens": self.num_tokens, "sequences": int(len(np.unique(self.seq_ids))),
            "steps": int(len(np.unique(self.steps))), "num_layers": self.num_layers,
            "num_experts": self.num_experts, "top_k": self.top_k, "missing_cells": missing,
            "phases": {"prefill": int((self.phase == PREFILL).sum()), "decode": int((self.phase == DECODE).sum())},
            "load_max_over_mean": {"median": _nan_stat(np.nanmedian, load), "mean": _nan_stat(np.nanmean, load),
                                   "per_sequence": per_seq, "per_layer": _rounded(load)},
            "temporal_overlap": {"mean": _nan_stat(np.nanmean, overlap), "pairs": pairs,
                                 "per_layer": _rounded(overlap)},
            "distinct_experts_per_step": {"mean": distinct_mean, "per_layer": _rounded(distinct)},
        }

    def _load_max_over_mean(self) -> np.ndarray:  # [L]
        return _max_over_mean(self.experts, self.num_experts)

    def _load_per_sequence(self) -> float | None:
        """Median over layers of max/mean load within each sequence, averaged over sequences (token-weighted)."""
        if not self.num_tokens or not self.num_layers:
            return None
        _, seq, counts = np.unique(self.seq_ids, return_inverse=True, return_counts=True)  # seq: [N] rank
        order = np.argsort(seq, kind="stable")
        starts = np.r_[0, np.cumsum(counts)]
        chunk = max(1, _CHUNK_CELLS // (self.num_layers * self.num_experts))  # sequences per bincount, bounded memory
        per_seq = np.concatenate([  # [Q, L]
            _max_over_mean(self.experts[order[starts[q]:starts[min(q + chunk, len(counts))]]], self.num_experts,
                           seq[order[starts[q]:starts[min(q + chunk, len(counts))]]] - q)
            for q in range(0, len(counts), chunk)])
        keep = ~np.all(np.isnan(per_seq), axis=1)
        if not keep.any():
            return None
        values = [round(float(v), 4) for v in np.nanmedian(per_seq[keep], axis=1)]
        return round(float(np.average(values, weights=counts[keep])), 4)

    def _temporal_overlap(self) -> tuple[np.ndarray, int]:  # [L], pairs
        order = self._sequence_order()
        same = self.seq_ids[order][1:] == self.seq_ids[order][:-1]
        first, second = order[:-1][same], order[1:][same]
        out = np.full(self.num_layers, np.nan)
        earlier = np.tril(np.ones((self.top_k, self.top_k), dtype=bool), -1)  # [k, j]: j before k
        for layer in range(self.num_layers):
            a, b = self.experts[first, layer], self.experts[second, layer]  # [P, K]
            valid = (a >= 0).any(1) & (b >= 0).any(1)
            repeat = ((a[:, :, None] == a[:, None, :]) & earlier).any(2)  # named before in the same cell: count once
            shared = ((a[:, :, None] == b[:, None, :]).any(2) & (a >= 0) & ~repeat).sum(1)  # [P] |A ∩ B|
            if valid.any():
                out[layer] = shared[valid].mean() / self.top_k
        return out, int(len(first))

    def _distinct_per_step(self) -> tuple[np.ndarray, float | None]:
        """Mean distinct experts per (step, layer) over the pairs that name one, per layer [L] (NaN: none does) and
        over all of them (None: none does): a step whose cells are all missing (-1) needed no known expert, and
        counting it as 0 would pull the mean down."""
        _, step_index = np.unique(self.steps, return_inverse=True)
        num_steps = int(step_index.max(initial=-1)) + 1
        if not num_steps:
            return np.full(self.num_layers, np.nan), None
        order = np.argsort(step_index, kind="stable")
        bounds = step_index[order]
        total, known = np.zeros(self.num_layers), np.zeros(self.num_layers)
        chunk = max(1, _CHUNK_CELLS // (self.num_layers * (self.num_experts + 1)))  # steps at a time: bounded memory
        for first in range(0, num_steps, chunk):
            rows = order[np.searchsorted(bounds, first):np.searchsorted(bounds, first + chunk)]
            experts = self.experts[rows]
            hot = np.zeros((min(chunk, num_steps - first), self.num_layers, self.num_experts + 1), dtype=bool)
            layer_index = np.broadcast_to(np.arange(self.num_layers)[None, :, None], experts.shape)
            hot[step_index[rows][:, None, None] - first, layer_index, experts] = True  # -1: the spare last column
            distinct = hot[:, :, :-1].sum(2)  # [steps, L] distinct experts per (step, layer)
            total += distinct.sum(0)
            known += (distinct > 0).sum(0)
        out = np.full(self.num_layers, np.nan)
        np.divide(total, known, out=out, where=known > 0)
        return out, round(float(total.sum() / known.sum()), 4) if known.sum() else None


def _cut_short(path: Path) -> str | None:
    """How much of it there is ("N of M bytes") when the safetensors file at `path` is shorter than its own header
    says, else None (not a safetensors file at all, or another fault)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return None
        length = int.from_bytes(head, "little")
        if length > _HEADER_LIMIT:  # not a header length: another kind of file
            return None
        text = f.read(length)
    if len(text) < length:  # the header itself is cut: the data's size is unknown
        return f"{size:,} bytes, fewer than its {8 + length:,}-byte header" if text.startswith(b"{") else None
    try:
        header = json.loads(text)
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError):
        return None
    need = 8 + length + end
    return f"{size:,} of {need:,} bytes" if size < need else None


_HEADER_LIMIT = 100_000_000  # the largest header safetensors reads


def _as_numpy(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor from the recorder
        value = value.detach().cpu().numpy()
    return np.asarray(value)


def _int_array(value: Any, name: str, dtype: type) -> np.ndarray:
    """`value` as `dtype`, refused when a value would not survive the cast (a cast wraps it round silently)."""
    array = _as_numpy(value)
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise TraceFormatError(f"{name} must hold integers; got dtype {array.dtype}")
    low, high = (PREFILL, DECODE) if name == "phase" else (np.iinfo(dtype).min, np.iinfo(dtype).max)
    if array.size and (array.min() < low or array.max() > high):
        bad = int(array.min()) if array.min() < low else int(array.max())
        if name == "phase":
            raise TraceFormatError(f"phase values must be 0 (prefill) or 1 (decode); found {bad}")
        raise TraceFormatError(f"{name} holds {bad}, outside the {np.dtype(dtype).name} range {low}..{high} the "
                               "trace format stores it in; give values in that range")
    return array.astype(dtype, copy=False)


def _integer(value: Any, what: str) -> int:
    """A Python or NumPy integer as int; anything else (2.7, True, "4") is refused rather than truncated."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TraceFormatError(f"{what} must be an integer; got {value!r} ({type(value).__name__})")
    return int(value)


_CHUNK_CELLS = 1 << 22  # cells of the working arrays `stats` builds at once (tens of MB), however long the trace


def _max_over_mean(experts: np.ndarray, num_experts: int, groups: np.ndarray | None = None) -> np.ndarray:
    """[N, L, K] expert ids -> [L] busiest expert's token count over the mean count per layer (NaN: no id in the
    layer; an expert a token names twice counts once); with `groups` ([N] 0 … G-1), the same per group: [G, L]."""
    layers = experts.shape[1]
    group = np.zeros(len(experts), dtype=np.int64) if groups is None else groups.astype(np.int64)
    size = 1 if groups is None else int(group.max(initial=-1)) + 1
    counts = np.zeros(size * layers * num_experts, dtype=np.int64)
    k = experts.shape[2]
    chunk = max(1, _CHUNK_CELLS // max(1, layers * k * k))  # tokens at a time: bounded memory
    earlier = np.tril(np.ones((k, k), dtype=bool), -1)  # [j, i]: i before j
    for first in range(0, len(experts), chunk):
        part = experts[first:first + chunk]
        repeat = ((part[..., :, None] == part[..., None, :]) & earlier).any(-1)  # named before in the cell: once
        cell = (group[first:first + chunk, None, None] * layers + np.arange(layers)[None, :, None]) * num_experts \
            + part  # [n, L, K]
        counts += np.bincount(cell[(part >= 0) & ~repeat], minlength=counts.size)
    counts = counts.reshape(size, layers, num_experts)  # [G, L, E]
    out = np.full((size, layers), np.nan)
    used = counts.sum(2) > 0
    out[used] = counts.max(2)[used] / counts.mean(2)[used]
    return out[0] if groups is None else out


def _nan_stat(fn: Any, values: np.ndarray) -> float | None:
    return None if np.all(np.isnan(values)) else round(float(fn(values)), 4)


def _rounded(values: np.ndarray) -> list[float | None]:
    return [None if np.isnan(v) else round(float(v), 4) for v in values]
