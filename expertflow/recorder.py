"""Record routing traces by running generation: which experts every token chose at every MoE layer.

Owns: hooks on the model's forward (a step per call) and forward pre-hooks on the experts modules (installed for the
run and always removed), mapping the rows each forward call computed back to (sequence, position, token), and
building a `Trace`. Does not know: caching or simulation. Recording never changes outputs: hooks only read the routing
the model computed anyway.

Only real tokens are recorded: left padding of a batch and the filler a finished sequence is fed after its end are
left out (they run through the experts in a batched run, so a wrapped model serving a batch does a little more work
than its trace shows; with batch size 1 the two match exactly). A sequence ends on any of the ids `generate` stops on
(`model.generation_config.eos_token_id`, one id or a list). In a batch, the row of a sequence that has just ended is
fed its end token once more while the others go on, and that forward is recorded as the sequence's last token; alone
(batch size 1) generation stops first, so the same prompt's trace has one token fewer.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import sys
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from expertflow.adapters import MoELayer, find_adapter
from expertflow.errors import first_line
from expertflow.runtime import module_calls, recorded_name
from expertflow.trace import Trace

__all__ = ["RouteRecorder", "record", "read_prompts", "DECODER_ONLY"]

DECODER_ONLY = "trace recording supports decoder-only models; encoder-decoder models (Switch) are not recorded yet"


class RouteRecorder:
    """Context manager: while active, every MoE layer call appends (step, layer, top-k ids, weights). A step is one
    call of the model's forward: a MoE layer that runs twice in one (a looped model) is refused, since a trace holds
    one routing per (token, MoE layer). Layers run outside the model's forward call (a compiled model's `generate`
    calls the module it wraps) run in order, once each per forward, so there an index that does not go up (a lower
    one, or the same one again, as in a model with a single MoE layer) starts a step."""

    def __init__(self, model: nn.Module) -> None:
        runtime = getattr(model, "_expertflow_runtime", None)
        self.model = model
        live = runtime is not None and not runtime.unwrapped  # not a shallow copy of a model since unwrapped
        self.layers: list[MoELayer] = runtime.layers if live else find_adapter(model)[1]
        ids = [layer.layer_id for layer in self.layers]
        shared = [layer.name for layer in self.layers if ids.count(layer.layer_id) > 1]
        if shared:  # e.g. text and vision experts side by side: the trace's layer ids would repeat
            raise ValueError(f"experts modules {', '.join(shared)} sit in the same model layer; a trace holds one "
                             "routing per token and model layer, so a model with more than one experts module in a "
                             "layer cannot be recorded")
        self.calls: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []
        self.step = -1
        self._ran: set[int] | None = None  # MoE layers the running forward call has run; None outside one
        self._owner: int | None = None  # the thread of that forward call
        self._last = 10**9  # the last layer run outside a forward call
        self._handles: list = []

    def reset(self) -> None:
        """Forget recorded calls and restart step numbering (before a new generate call)."""
        self.calls.clear()
        self.step, self._ran, self._owner, self._last = -1, None, None, 10**9

    def __enter__(self) -> "RouteRecorder":
        self._handles += [self.model.register_forward_pre_hook(self._enter_forward),
                          self.model.register_forward_hook(self._leave_forward, always_call=True)]
        for layer in self.layers:
            self._handles.append(layer.module.register_forward_pre_hook(self._hook(layer)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _enter_forward(self, module, args) -> None:
        if _calls_of(module) == 1:  # not the model's forward calling itself again, which is the same step
            if self._owner not in (None, threading.get_ident()) and _calls_of(module, self._owner):
                raise RuntimeError("the recorded model is running a forward call in another thread; a recorder "
                                   "numbers one forward call at a time: record from one thread, or give each "
                                   "thread its own model")
            self.step += 1
            self._ran, self._owner, self._last = set(), threading.get_ident(), 10**9

    def _leave_forward(self, module, args, output) -> None:
        # Also called when the forward raised, even in a pre-hook before `_enter_forward` (the runtime's refusal of
        # a second thread): only the outermost call of the thread that entered ends the step. A Ctrl-C skips this;
        # the next call's `_enter_forward` starts afresh.
        if self._owner == threading.get_ident() and _calls_of(module) == 1:
            self._ran, self._owner = None, None

    def _hook(self, layer: MoELayer):
        def hook(module, args):
            _, index, weights = args[:3]
            if index.dim() == 3:  # Switch: one-hot dispatch mask [T, 1, E], zero rows = dropped by capacity
                routed = index.sum(dim=-1) > 0
                index = torch.where(routed, index.argmax(dim=-1), -1)
            if self._ran is not None and self._owner == threading.get_ident():
                if layer.index in self._ran:
                    raise ValueError(f"MoE layer {layer.layer_id} ({layer.name}) ran twice in one forward pass (a "
                                     "model that loops over its layers); a trace holds one routing per token and MoE "
                                     "layer, so such a model cannot be recorded: record one that runs each MoE layer "
                                     "once")
                self._ran.add(layer.index)
            elif layer.index <= self._last:  # outside the model's forward call
                self.step += 1
            self._last = layer.index
            index = torch.where((index >= 0) & (index < layer.num_experts), index, -1)
            self.calls.append((self.step, layer.index, index.detach().to("cpu", torch.int32),
                               weights.detach().to("cpu", torch.float16).reshape(index.shape)))
        return hook

    def per_step(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """step → (experts [rows, L, K], weights [rows, L, K]) in layer order."""
        grouped: dict[int, list] = {}
        for step, layer, index, weights in self.calls:
            grouped.setdefault(step, [None] * len(self.layers))[layer] = (index, weights)
        out = {}
        for step, per_layer in grouped.items():
            skipped = [f"{self.layers[i].layer_id} ({self.layers[i].name})" for i, p in enumerate(per_layer)
                       if p is None]
            if skipped:  # its tokens would lack those layers' routes: refused rather than left out of the trace
                raise ValueError(f"forward {step} skipped MoE layer(s) {', '.join(skipped)}; a trace holds every "
                                 "token's routing at every MoE layer: record a model that runs each MoE layer in "
                                 "every forward pass")
            out[step] = (torch.stack([p[0] for p in per_layer], 1), torch.stack([p[1] for p in per_layer], 1))
        return out


def _calls_of(module: nn.Module, thread: int | None = None) -> int:
    """How many calls of `module` the calling thread's stack is inside (1: only the one whose hook is running), or
    the stack of `thread` (0 once it has left them: a Ctrl-C skips the hook that clears a recorded owner)."""
    frame = sys._getframe(1) if thread is None else sys._current_frames().get(thread)
    return module_calls(frame, lambda m: m is module)


def read_prompts(path: str | Path, task: str | None = None, limit: int | None = None,
                 split: str | None = None) -> list[dict]:
    """Rows of a prompts JSONL file ({"id", "task", "prompt"}), optionally one task, one split (rows whose "split"
    field is `split`) and the first `limit`."""
    if limit is not None and limit < 1:
        raise ValueError(f"limit={limit} must be at least 1 (or None for every row)")
    rows = []
    if Path(path).is_dir():
        raise ValueError(f"prompts file {path} is a directory; give a JSONL file such as {Path(path) / 'chat.jsonl'}")
    if not Path(path).is_file():
        raise ValueError(f"prompts file {path} does not exist; give a JSONL file with one {{\"prompt\": …}} object "
                         "per line")
    with open(path, encoding="utf-8-sig") as fh:
        try:
            lines = fh.readlines()
        except UnicodeDecodeError:
            raise ValueError(f"{path} is not UTF-8 text; give a prompts JSONL file (one {{\"prompt\": …}} object per "
                             "line)") from None
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: not JSON ({err.msg}); one object per line expected") from None
            except RecursionError:  # brackets nested thousands deep
                raise ValueError(f"{path}:{number}: JSON nested too deeply to read; one object per line expected, "
                                 "with a string field 'prompt'") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise ValueError(f"{path}:{number}: each line needs a string field 'prompt'")
            if (task is None or row.get("task") == task) and (split is None or row.get("split") == split):
                rows.append(row)
    return rows if limit is None else rows[:limit]


# Smaller temperatures divide a model's logits past float32's range (sampling then fails on infinite scores); at
# this one a logit difference of a millionth decides, which is greedy decoding in all but name
MIN_TEMPERATURE = 1e-6


def check_sampling(temperature: float | None, top_p: float, seed: int, flags: bool = False) -> None:
    """`record`'s sampling settings: top_p and seed only with a temperature, a temperature of at least
    MIN_TEMPERATURE, top_p in (0, 1], a seed in torch's range (a negative one would name another seed's sampling).
    Errors name them as `record`'s arguments, or as `trace record`'s flags with `flags`."""
    def named(setting: str, value) -> str:
        return f"--{setting.replace('_', '-')} {value}" if flags else f"{setting}={value!r}"

    if temperature is None:
        for setting, value, default in (("top_p", top_p, 1.0), ("seed", seed, 0)):
            if value != default:
                raise ValueError(f"{named(setting, value)} applies to sampling: give "
                                 f"{'--temperature' if flags else 'a temperature'} too (greedy by default)")
        return
    if not (_real(temperature) and math.isfinite(temperature) and temperature >= MIN_TEMPERATURE):
        raise ValueError(f"{named('temperature', temperature)} must be a finite number of at least "
                         f"{MIN_TEMPERATURE:g} (a smaller one divides the logits past float32's range); leave it out "
                         "to decode greedily")
    if not (_real(top_p) and 0 < top_p <= 1):
        raise ValueError(f"{named('top_p', top_p)} must be in (0, 1]")
    if not isinstance(seed, numbers.Integral) or isinstance(seed, bool):  # numpy's integers too
        raise ValueError(f"{named('seed', seed)} must be an integer")
    if not 0 <= seed < 2**64:
        raise ValueError(f"{named('seed', seed)} must be in [0, 2**64) (torch's seed range)")


def _real(value) -> bool:
    """A number that is not a bool: Python's or numpy's."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def record(model: nn.Module, prompts: Sequence[str] | Iterable[str], tokenizer=None, batch_size: int = 8,
           max_new_tokens: int = 32, max_prompt_tokens: int = 256, model_name: str | None = None,
           progress: bool = True, temperature: float | None = None, top_p: float = 1.0, seed: int = 0) -> Trace:
    """Generate over `prompts` in batches and return the routing trace of every real token: greedily, or sampling
    with `temperature` (and nucleus `top_p`) from torch's generator seeded with `seed` when a temperature is given.
    One sequence per prompt, one new token per step, whatever the model's generation config asks for (beams, several
    returned sequences, contrastive search, candidate tokens from prompt lookup or an assistant: see
    `_PLAIN_DECODING`)."""
    check_sampling(temperature, top_p, seed)
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError(DECODER_ONLY)
    prompts = list(prompts)
    if not prompts:
        raise ValueError("no prompts to record; give at least one")
    for name, value in (("batch_size", batch_size), ("max_new_tokens", max_new_tokens),
                        ("max_prompt_tokens", max_prompt_tokens)):
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            raise ValueError(f"{name}={value!r} must be a positive integer")
    recorder = RouteRecorder(model)  # first: a model without MoE layers is refused before anything is loaded
    if tokenizer is None:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(model.name_or_path)
        except (OSError, ValueError, TypeError, ImportError, KeyError, AttributeError) as exc:  # damaged files
            raise ValueError(f"cannot load the tokenizer of {model.name_or_path} ({first_line(exc)}); save it beside "
                             "the model (tokenizer.save_pretrained(DIR)), or from Python pass record(..., "
                             "tokenizer=)") from None
    # the caller's tokenizer is given back as it came
    saved = tokenizer.padding_side, tokenizer.pad_token, getattr(tokenizer, "truncation_side", None)
    rng = torch.random.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if temperature is not None and torch.cuda.is_initialized() else None
    try:
        tokenizer.padding_side = "left"
        tokenizer.truncation_side = "right"  # a longer prompt keeps its first max_prompt_tokens, whatever was saved
        if tokenizer.pad_token is None:
            tokenizer.pad_token = padding_token(tokenizer)
        parts = _record_batches(model, prompts, tokenizer, recorder, batch_size, max_new_tokens, max_prompt_tokens,
                                progress, temperature, top_p, seed)
    finally:
        tokenizer.padding_side = saved[0]
        if saved[2] is not None:
            tokenizer.truncation_side = saved[2]
        if saved[1] is None:
            tokenizer.pad_token = None
        if temperature is not None:  # sampling seeded torch's generators: give the caller's back
            torch.random.set_rng_state(rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state_all(cuda_rng)
    tensors = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    return Trace(experts=tensors["experts"], num_experts=max(layer.num_experts for layer in recorder.layers),
                 token_ids=tensors["token_ids"], seq_ids=tensors["seq_ids"], positions=tensors["positions"],
                 steps=tensors["steps"], phase=tensors["phase"], gate_probs=tensors["gate_probs"],
                 model=model_name or _stored_name(model),
                 layer_ids=[layer.layer_id for layer in recorder.layers],
                 source=f"expertflow.recorder batch_size={batch_size} max_new_tokens={max_new_tokens} "
                        f"max_prompt_tokens={max_prompt_tokens}" + (
                     "" if temperature is None else f" sampled temperature={temperature} top_p={top_p} seed={seed}"))


def _stored_name(model: nn.Module) -> str:
    """The model name a trace records: the model's recorded name, made absolute when it is a local directory (as
    `expertflow trace record` stores it), so that a predictor trained from another working directory still finds
    the model's config (its vocabulary). Model names are compared by their last path part (`same_model`), so the
    model loaded again by the relative name or by this path still matches the trace."""
    name = recorded_name(model)
    return os.path.abspath(name) if os.path.isdir(name) else name


# Generation settings reset for a recording, whatever the model's generation config says: each would compute other
# rows than one per sequence and token (beams, return sequences, contrastive search's candidates, candidate tokens of
# prompt lookup / an early-exit assistant / multi-token prediction, a prompt fed in chunks, classifier-free
# guidance's second forward per token), decode otherwise than greedily or by plain sampling (DoLa, constraints),
# end a sequence on other than its EOS ids (stop strings, which `_assemble` cannot see), or return a dict (and extra
# outputs) instead of the token ids. Only those this transformers knows are passed.
_PLAIN_DECODING = {"num_beams": 1, "num_return_sequences": 1, "num_beam_groups": 1, "penalty_alpha": None,
                   "prompt_lookup_num_tokens": None, "assistant_early_exit": None, "use_mtp": None,
                   "prefill_chunk_size": None, "guidance_scale": None, "stop_strings": None,
                   "dola_layers": None, "constraints": None, "force_words_ids": None, "return_dict_in_generate": False,
                   "output_scores": False, "output_logits": False, "output_attentions": False,
                   "output_hidden_states": False}


def _record_batches(model: nn.Module, prompts: list[str], tokenizer, recorder: RouteRecorder, batch_size: int,
                    max_new_tokens: int, max_prompt_tokens: int, progress: bool, temperature: float | None,
                    top_p: float, seed: int) -> list[dict[str, np.ndarray]]:
    parts: list[dict[str, np.ndarray]] = []
    step_offset = 0
    config = getattr(model, "generation_config", None)  # names the settings this transformers knows
    settings = {k: v for k, v in _PLAIN_DECODING.items() if config is None or hasattr(config, k)}
    settings["do_sample"] = False
    if temperature is not None:
        settings.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)
        torch.manual_seed(seed)
    stops = stop_ids(model)
    _check_not_empty(prompts, tokenizer)
    for start in tqdm(range(0, len(prompts), batch_size), desc="recording", unit="batch", disable=not progress):
        batch = tokenizer(prompts[start:start + batch_size], return_tensors="pt", padding=True, truncation=True,
                          max_length=max_prompt_tokens, return_attention_mask=True).to(next(model.parameters()).device)
        check_token_ids(batch["input_ids"], model)
        recorder.reset()
        with recorder, torch.no_grad():
            # with the cache a decode forward computes one row per sequence, as `_assemble` maps them; routing is
            # the same either way, and a generation config with use_cache false would recompute the whole prefix
            out = model.generate(**batch, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                                 use_cache=True, **settings)
        part = _assemble(recorder.per_step(), batch["input_ids"].cpu(), batch["attention_mask"].cpu(), out.cpu(),
                         stops, seq_offset=start, step_offset=step_offset)
        parts.append(part)
        step_offset = int(part["steps"].max()) + 1 if len(part["steps"]) else step_offset
    return parts


def padding_token(tokenizer) -> str:
    """A token to pad a batch on the left with, for a tokenizer that names none: its end-of-sequence token, else its
    unknown token, else the token of id 0 (padding is masked out and never recorded: any token serves)."""
    for token in (tokenizer.eos_token, tokenizer.unk_token, tokenizer.convert_ids_to_tokens(0)):
        if isinstance(token, str) and token:
            return token
    raise ValueError("the tokenizer names no padding, end-of-sequence or unknown token and has no token of id 0 to "
                     "pad a batch with; set one (tokenizer.pad_token = ...) and save it again")


def _check_not_empty(prompts: list[str], tokenizer) -> None:
    """Refuse, before any batch is generated, prompts that give no token (an empty text with a tokenizer that adds no
    start token): such a row is all padding, and would fail inside attention or record made-up tokens."""
    empty = [number for number, ids in enumerate(tokenizer(prompts, add_special_tokens=True)["input_ids"], 1)
             if len(ids) == 0]
    if empty:
        shown = ", ".join(map(str, empty[:5])) + (f" and {len(empty) - 5} more" if len(empty) > 5 else "")
        raise ValueError(f"{len(empty)} of the {len(prompts)} prompts give no tokens with this tokenizer (an empty "
                         f"text, and it adds no start token): number {shown}, counting from 1 in the order given; "
                         "drop them or give them text")


def check_token_ids(input_ids: torch.Tensor, model: nn.Module) -> None:
    """Refuse token ids the model's input embedding has no row for (a tokenizer of another model saved beside it),
    which would fail deep inside the embedding with an IndexError."""
    try:
        embedding = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):  # a model that does not say where its embedding is: not checked
        return
    rows = getattr(embedding, "num_embeddings", None)
    if rows is not None and input_ids.numel() and int(input_ids.max()) >= rows:
        raise ValueError(f"the tokenizer gives token ids up to {int(input_ids.max())}, but the model's input "
                         f"embedding has {rows} rows: it is another model's tokenizer; save the model's own beside it "
                         "(tokenizer.save_pretrained(DIR))")


def stop_ids(model: nn.Module) -> frozenset[int]:
    """The token ids `generate` ends a sequence on: the generation config's `eos_token_id` (one id or a list)."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        return frozenset()
    return frozenset(int(i) for i in (eos.tolist() if torch.is_tensor(eos) else eos if isinstance(eos, (list, tuple))
                                      else [eos]))


def _assemble(steps: dict, input_ids: torch.Tensor, mask: torch.Tensor, out: torch.Tensor, stops: frozenset[int],
              seq_offset: int, step_offset: int) -> dict[str, np.ndarray]:
    """Map each forward's rows to tokens. Prefill (step 0) rows are [B*T]; decode step i rows are [B]."""
    batch, prompt_len = input_ids.shape
    pads = (mask == 0).sum(dim=1).tolist()
    rows: dict[str, list] = {k: [] for k in ("experts", "gate_probs", "token_ids", "seq_ids", "positions", "steps",
                                             "phase")}
    finished = [False] * batch
    fed = out.shape[1] - prompt_len  # forwards generate makes: one per new token (the last one is never fed)
    if steps and max(steps) >= fed:
        raise ValueError(f"generate made {len(steps)} forwards for {fed} new tokens per sequence; record with a "
                         "model whose generate runs one forward per new token (a custom generate, or one that "
                         "calls the model again within a step, makes more)")
    for step in sorted(steps):
        experts, weights = steps[step]
        width = prompt_len if step == 0 else 1
        if experts.shape[0] != batch * width:
            tokens = f"{width} prompt tokens (padded)" if step == 0 else "1 new token"
            raise ValueError(f"forward {step} of generate computed {experts.shape[0]} rows where {batch} sequences x "
                             f"{tokens} = {batch * width} were expected; record with a model whose generate runs "
                             "one sequence per prompt and one new token per decode step, with a KV cache (a custom "
                             "generate or a generation config that asks for beams, several sequences per prompt or "
                             "candidate tokens computes other rows)")
        for b in range(batch):
            for t in range(width):
                column = t if step == 0 else prompt_len + step - 1
                if (step == 0 and t < pads[b]) or finished[b]:
                    continue
                row = b * width + t
                rows["experts"].append(experts[row].numpy())
                rows["gate_probs"].append(weights[row].numpy())
                rows["token_ids"].append(int(out[b, column]))
                rows["seq_ids"].append(seq_offset + b)
                rows["positions"].append(column - pads[b])
                rows["steps"].append(step_offset + step)
                rows["phase"].append(0 if step == 0 else 1)
            if step > 0 and int(out[b, prompt_len + step - 1]) in stops:
                finished[b] = True  # later steps feed this row filler tokens
    out_arrays = {k: np.asarray(v) for k, v in rows.items()}
    out_arrays["experts"] = out_arrays["experts"].astype(np.int32)
    out_arrays["gate_probs"] = out_arrays["gate_probs"].astype(np.float16)
    return out_arrays
