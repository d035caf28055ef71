"""Traces as predictor examples: one example per sequence (its prompt, all its tokens in order, their routes).

Owns: splitting a trace into sequences (and the digest that identifies them), joining several traces into one,
choosing traces by task, padding examples into batches and the multi-hot targets. Does not know: the network, training
or metrics.

Shape legend: N = trace tokens, S = prompt tokens, T = tokens of a sequence, L = MoE layers, K = top-k,
E = experts per layer, B = sequences in a batch.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from expertflow.trace import PREFILL, Trace

__all__ = ["SequenceExample", "sequences", "sequences_digest", "concat_traces", "load_traces", "pad_batch", "multi_hot",
           "length_batches", "same_model", "check_same_model"]

TASK_KEY = "task"  # trace metadata naming the prompt family a trace was recorded on
SPLIT_KEY = "split"  # trace metadata naming the prompt split ("train" / "test")


@dataclass(frozen=True)
class SequenceExample:
    """One sequence of a trace: `index` maps its tokens (position order) back to trace rows."""

    seq_id: int
    prompt: np.ndarray  # [S] int64 token ids of the prefill-phase tokens
    tokens: np.ndarray  # [T] int64 token ids, prompt first, then generated tokens
    experts: np.ndarray  # [T, L, K] int32, -1 = none
    index: np.ndarray  # [T] trace row of each token


def sequences(trace: Trace) -> list[SequenceExample]:
    """Split `trace` into per-sequence examples, tokens in (position, step) order, ascending sequence id."""
    if trace.num_tokens and (trace.token_ids < 0).any():
        raise ValueError(f"trace from {trace.source or trace.model!r} lacks token ids (-1); a route predictor needs "
                         "them: record the trace with `expertflow trace record`")
    order = np.lexsort((trace.steps, trace.positions, trace.seq_ids))
    seq = trace.seq_ids[order]
    bounds = np.flatnonzero(np.diff(seq)) + 1
    out = []
    for idx in np.split(order, bounds) if len(order) else []:
        tokens = trace.token_ids[idx].astype(np.int64)
        prompt = tokens[trace.phase[idx] == PREFILL]
        out.append(SequenceExample(int(trace.seq_ids[idx[0]]), prompt, tokens, trace.experts[idx], idx))
    return out


def sequences_digest(examples: Sequence[SequenceExample]) -> str:
    """A short hash (16 hex digits of SHA-256) of the sequences' token ids, sequence by sequence in order: the same
    for the same traces given in the same order, whatever their files are called. A training split drawn by a seed
    depends on exactly this, so equal digests mean the same split."""
    h = hashlib.sha256()
    h.update(np.array([len(e.tokens) for e in examples], dtype="<i8").tobytes())
    for e in examples:
        h.update(np.ascontiguousarray(e.tokens, dtype="<i8").tobytes())
    return h.hexdigest()[:16]


def _model_key(name: str) -> str:
    """A recorded model name's last path part, lower-case: a trace keeps the path of the machine that recorded it,
    or a hub id. A snapshot in the Hugging Face cache (`.../models--org--name/snapshots/<hash>`) is known by its
    repository's name, as the hub id `org/name` of the same model is."""
    if not name:
        return ""
    parts = Path(name.rstrip("/")).parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3].split("--")[-1].lower()
    return parts[-1].lower() if parts else ""


_UNKNOWN = ("", "unknown")  # keys of traces that do not name their model (`trace import` without a model name)


def same_model(a: str, b: str) -> bool:
    """Whether two recorded model names can be the same model: equal last path parts, or one of them unknown."""
    keys = [_model_key(a), _model_key(b)]
    return keys[0] == keys[1] or any(k in _UNKNOWN for k in keys)


def check_same_model(traces: Sequence[Trace], names: Sequence[str] | None = None) -> None:
    """Refuse traces of different models (by shape or by name); `names` (the files) are used in the message.
    Every named trace is compared with the first named one, so that an unnamed trace cannot join two models."""
    names = list(names) if names is not None else [repr(t.source or t.model) for t in traces]
    first = traces[0]
    named = next((i for i, t in enumerate(traces) if _model_key(t.model) not in _UNKNOWN), 0)
    for t, name in zip(traces[1:], names[1:]):
        shape, first_shape = (t.num_layers, t.num_experts, t.top_k), (first.num_layers, first.num_experts, first.top_k)
        if shape != first_shape:
            raise ValueError(f"traces of different models: {names[0]} has (layers, experts, top_k) {first_shape}, "
                             f"{name} has {shape}; give traces of one model")
    for t, name in zip(traces, names):
        if not same_model(traces[named].model, t.model):
            raise ValueError(f"traces of different models: {names[named]} is of {traces[named].model!r}, {name} of "
                             f"{t.model!r}; give traces of one model")


def concat_traces(traces: Sequence[Trace]) -> Trace:
    """One trace holding all sequences of `traces`; sequence ids and steps are shifted so that none collide."""
    if not traces:
        raise ValueError("no traces given")
    first = traces[0]
    check_same_model(traces)
    if len(traces) == 1:
        return first
    parts: dict[str, list[np.ndarray]] = {k: [] for k in ("experts", "token_ids", "seq_ids", "positions", "steps",
                                                          "phase")}
    seq_offset = step_offset = 0
    for t in traces:
        for name in parts:
            value = getattr(t, name)
            value = value + seq_offset if name == "seq_ids" else value + step_offset if name == "steps" else value
            parts[name].append(value)
        seq_offset += int(t.seq_ids.max(initial=-1)) + 1
        step_offset += int(t.steps.max(initial=-1)) + 1
    joined = {k: np.concatenate(v) for k, v in parts.items()}
    tasks = sorted({t.extra_metadata.get(TASK_KEY, "") for t in traces} - {""})
    extra = {TASK_KEY: ",".join(tasks)} if tasks else {}
    model = next((t.model for t in traces if _model_key(t.model) not in _UNKNOWN), first.model)  # the one named
    return replace(first, **joined, model=model, gate_probs=None, extra_metadata=extra,
                   source=" + ".join(t.source for t in traces))


def load_traces(paths: Iterable[str | Path], tasks: Sequence[str] | None = None, split: str | None = None) -> Trace:
    """Load trace files (a directory stands for its *.safetensors) and join them, keeping those whose metadata
    `task` is in `tasks` and whose `split` is `split` (when given)."""
    files: list[Path] = []
    for path in paths:
        if not str(path):  # Path("") is ".": the current directory's traces, read without being asked for
            raise ValueError("an empty trace path, which would be read as the current directory; give trace files or "
                             "a directory of them")
        path = Path(path)
        found = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
        if not found:
            raise ValueError(f"{path} is a directory without trace files (*.safetensors); record some with "
                             "`expertflow trace record` or give the trace files")
        files.extend(found)
    seen: dict[Path, Path] = {}
    for f in files:  # a file read twice would count its sequences twice (and put copies of them in both splits)
        first = seen.setdefault(f.resolve(), f)
        if first is not f:
            also = "" if str(first) == str(f) else f" (also as {first})"
            raise ValueError(f"{f} is given twice{also}; give each trace file once")
    loaded = [Trace.load(f) for f in files]
    if loaded:
        check_same_model(loaded, [str(f) for f in files])
    named = dict(zip(map(id, loaded), files))
    for key, wanted in ((TASK_KEY, set(tasks or ())), (SPLIT_KEY, {split} if split else set())):
        if not wanted:
            continue
        kept = [t for t in loaded if t.extra_metadata.get(key) in wanted]
        missing = sorted(wanted - {t.extra_metadata.get(key) for t in kept})
        if kept and missing:
            found = sorted({t.extra_metadata.get(key, "(none)") for t in loaded})
            raise ValueError(f"no trace has {key} {missing}; the traces given have {key} {found}")
        if not kept:
            found = sorted({t.extra_metadata.get(key, "(none)") for t in loaded})
            raise ValueError(f"no trace has {key} in {sorted(wanted)}; the traces given have {key} {found} (trace "
                             f"metadata {key!r}, stored by `expertflow trace record --{key}` and by "
                             "benchmarks/assets/train_predictor.py)")
        loaded = kept
    _check_no_copies([named[id(t)] for t in loaded], loaded)  # among the traces kept: only they are read
    return concat_traces(loaded)


def _check_no_copies(files: list[Path], traces: list[Trace]) -> None:
    """A copy of a trace under another name, or of its sequences (re-batched, a subset, renumbered), would count them
    twice, and in training put them in both splits: a file all of whose sequences another file holds is refused
    (named against the first file that holds each, the later of two copies named as the copy), whatever their order;
    one that shares only some sequences with the files before it is warned about (the same prompt recorded in two
    sets, say)."""
    keys = [_sequence_keys(t) for t in traces]
    holders: dict[str, list[int]] = {}
    for i, mine in enumerate(keys):
        for key in dict.fromkeys(mine):
            holders.setdefault(key, []).append(i)
    for i in reversed(range(len(files))):
        mine = keys[i]
        if mine and all(len(holders[key]) > 1 for key in mine):
            where = sorted({next(j for j in holders[key] if j != i) for key in mine})
            raise ValueError(f"{files[i]} holds the same routes as {' and '.join(str(files[j]) for j in where)} (a "
                             f"copy?): every one of its {len(mine)} sequences is there too, with the same tokens and "
                             "experts, so its sequences would count twice, and in training land in both splits; give "
                             "each trace once")
    for i, mine in enumerate(keys):
        repeated = [key for key in mine if holders[key][0] < i]
        if repeated:
            where = sorted({holders[key][0] for key in repeated})
            warnings.warn(f"{len(repeated)} of the {len(mine)} sequences of {files[i]} are also in "
                          f"{' and '.join(str(files[j]) for j in where)}, with the same tokens and experts: they "
                          "count twice", stacklevel=3)


def _sequence_keys(trace: Trace) -> list[str]:
    """A hash per sequence of what it records (token ids, routes, positions and phases, in position order), whatever
    its sequence id, its steps or the file it is in."""
    if not trace.num_tokens:
        return []
    order = np.lexsort((trace.positions, trace.seq_ids))
    starts = np.flatnonzero(np.diff(trace.seq_ids[order]) != 0) + 1
    keys = []
    for rows in np.split(order, starts):
        h = hashlib.sha256()
        for name in ("token_ids", "experts", "positions", "phase"):
            value = np.ascontiguousarray(getattr(trace, name)[rows])
            h.update(f"{name}{value.dtype.str}{value.shape}".encode())
            h.update(value.tobytes())
        keys.append(h.hexdigest())
    return keys


def multi_hot(experts: np.ndarray, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """[..., L, K] expert ids -> (targets [..., L, E] float32, known [..., L] bool: at least one id >= 0)."""
    hot = np.zeros((*experts.shape[:-1], num_experts + 1), dtype=np.float32)
    np.put_along_axis(hot, np.where(experts >= 0, experts, num_experts).astype(np.int64), 1.0, axis=-1)
    return hot[..., :num_experts], (experts >= 0).any(-1)


def pad_batch(examples: Sequence[SequenceExample], num_experts: int | None = None) -> dict[str, torch.Tensor]:
    """Right-padded tensors: encoder ids/mask [B, S], decoder ids/mask [B, T] and, with `num_experts`, targets
    [B, T, L, E] and the loss mask [B, T, L] (padding and missing (token, layer) cells are 0)."""
    b = len(examples)
    s = max(max(len(e.prompt) for e in examples), 1)  # an empty prompt still gets one masked encoder slot
    t = max(len(e.tokens) for e in examples)
    out = {"encoder_ids": torch.zeros(b, s, dtype=torch.long), "encoder_mask": torch.zeros(b, s, dtype=torch.long),
           "decoder_ids": torch.zeros(b, t, dtype=torch.long), "decoder_mask": torch.zeros(b, t, dtype=torch.long)}
    for i, e in enumerate(examples):
        out["encoder_ids"][i, :len(e.prompt)] = torch.from_numpy(e.prompt)
        out["encoder_mask"][i, :len(e.prompt)] = 1
        out["decoder_ids"][i, :len(e.tokens)] = torch.from_numpy(e.tokens)
        out["decoder_mask"][i, :len(e.tokens)] = 1
    if num_experts is not None:
        layers = examples[0].experts.shape[1]
        targets = torch.zeros(b, t, layers, num_experts)
        known = torch.zeros(b, t, layers)
        for i, e in enumerate(examples):
            hot, ok = multi_hot(e.experts, num_experts)
            targets[i, :len(e.tokens)] = torch.from_numpy(hot)
            known[i, :len(e.tokens)] = torch.from_numpy(ok.astype(np.float32))
        out["targets"], out["known"] = targets, known
    return out


def length_batches(examples: Sequence[SequenceExample], max_tokens: int, rng: np.random.Generator | None = None
                   ) -> list[list[int]]:
    """Indices of `examples` grouped by similar length so that each padded batch holds <= max_tokens decoder tokens
    (at least one sequence). With `rng`, lengths are jittered and the batch order shuffled."""
    lengths = np.array([len(e.tokens) for e in examples], dtype=np.float64)
    keys = lengths + (rng.uniform(0, 8, len(lengths)) if rng is not None else 0)
    order = np.argsort(keys, kind="stable")
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order.tolist():
        longest_if = max(longest, int(lengths[i]))
        if current and longest_if * (len(current) + 1) > max_tokens:
            batches.append(current)
            current, longest_if = [], int(lengths[i])
        current.append(i)
        longest = longest_if
    if current:
        batches.append(current)
    if rng is not None:
        rng.shuffle(batches)
    return batches
