"""The runtime-facing route predictor: a trained `RouteNet` plus its files, and per-batch prediction sessions.

Owns: the predictor directory (`config.json`, `model.safetensors`, `expert_counts.json`; no pickle), and
`PredictorSession`, which keeps the encoder's cross-attention keys/values and the decoder's self-attention cache of
every row of a batch so that a decode step costs one small incremental step (and, with a next-token head, leaves
its guess for the routes of each row's next tokens in `next_probs`). Batch-first everywhere; rows can be kept/reordered
(`reorder`, beam search), cut back (`crop`, rejected candidate tokens) or sessions joined (`merge`, left padding)
when the runtime changes its batches. Batches that continue with `decode` must be left padded.
Does not know: traces, training or the MoE runtime.

Shape legend: B = sequences, T = tokens, S = prompt tokens, P = tokens seen so far, L = MoE layers, E = experts.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from expertflow.predictor.model import DecoderCache, PredictorConfig, RouteNet, left_pad
from expertflow.trace import umask_permissions

__all__ = ["RoutePredictor", "PredictorSession", "FORMAT", "check_predictor_dir", "holds_predictor"]

FORMAT = "expertflow.predictor/1"
CONFIG_FILE, WEIGHTS_FILE, COUNTS_FILE = "config.json", "model.safetensors", "expert_counts.json"
HALF_PREFIX = "next_head."  # tensors stored in fp16


def holds_predictor(path: str | Path) -> bool:
    """Whether the directory `path` holds a predictor (a `config.json` naming the predictor format)."""
    try:
        with open(os.path.join(path, CONFIG_FILE), encoding="utf-8") as fh:
            return json.load(fh).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def check_predictor_dir(path: str | Path, flag: str | None = None, writable: bool = True) -> None:
    """Refuse (ValueError) a place that cannot take a predictor directory: an empty path (it would be read as the
    current directory), a file or a path under one, or a directory that holds other files and no predictor (a model's,
    whose config.json and model.safetensors would be replaced). A new or empty directory passes, and so does a
    predictor's, which is then replaced. With `writable`, a folder is also made and removed where
    `RoutePredictor.save` makes its own (tried, not read from the permission bits, which root passes everywhere), so
    that a run can be refused before its work. `flag` names where the path was given, in the messages (a command-line
    flag; "--predictor" when a predictor is replaced in place)."""
    if not str(path):  # Path("") is ".": only the string shows it
        raise ValueError(f"{flag or 'the predictor directory'} is an empty path, which would be read as the current "
                         "directory; give a directory (new or existing) for the predictor")
    where = f"{flag} {path}" if flag else str(path)
    from expertflow.predictor import default_predictor_path

    if os.path.realpath(path) == os.path.realpath(default_predictor_path()):
        fix = "give --out DIR" if flag == "--predictor" else "give another directory"
        raise ValueError(f"{where} is the predictor shipped with expertflow, which wrap, demo and simulate use for the "
                         f"built-in model; it is not replaced: {fix} for the new predictor")
    if os.path.islink(path) and not os.path.exists(path):  # the folder would be renamed onto the link: it fails
        raise ValueError(f"{where} is a symbolic link to {os.readlink(path)}, which does not exist; make that "
                         "directory, or give another path for the predictor")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{where} is a file; give a directory (new or existing) for the predictor")
    if os.path.isdir(path) and os.listdir(path) and not holds_predictor(path):
        names = sorted(os.listdir(path))
        shown = ", ".join(names[:3]) + (", …" if len(names) > 3 else "")
        raise ValueError(f"{where} holds other files ({shown}) and no predictor; give a new or empty directory (or a "
                         "predictor's, to replace it)")
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ValueError(f"{where}: {existing} is a file, so no directory can be made under it; give another path")
    if not writable:
        return
    # a folder made inside an existing directory, else beside the new one, named after it (so a name too long fails
    # now too), as `save` makes them
    into = os.path.isdir(path)
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".staging." if into else f".{os.path.basename(os.path.abspath(path))}.",
                                  dir=existing))
    except OSError as exc:
        if exc.errno == errno.ENAMETOOLONG:
            raise ValueError(f"{where}: the name is too long for the file system ({exc.strerror}); give a shorter "
                             "name") from None
        fix = ("without --out the predictor is replaced there: give --out DIR, a directory you can write to"
               if flag == "--predictor" else "give a directory you can write to")
        raise ValueError(f"{where}: {existing} is not writable ({exc.strerror or exc}); {fix}") from None


class RoutePredictor:
    """A trained route-path predictor. `expert_counts` [L, E]: how often each expert was chosen in the training
    trace (the `frequency` baseline); `info`: free-form training facts saved alongside."""

    def __init__(self, net: RouteNet, expert_counts: np.ndarray | None = None, info: dict[str, Any] | None = None
                 ) -> None:
        self.net = net.eval()
        c = net.config
        self.expert_counts = (np.zeros((c.num_layers, c.num_experts), dtype=np.int64) if expert_counts is None
                              else np.asarray(expert_counts, dtype=np.int64))
        self.info = dict(info or {})

    @property
    def config(self) -> PredictorConfig:
        return self.net.config

    @property
    def device(self) -> torch.device:
        return self.net.head.weight.device

    def to(self, device: str | torch.device) -> RoutePredictor:
        self.net.to(device)
        return self

    def parameters_count(self) -> int:
        return sum(p.numel() for p in self.net.parameters())

    def new_session(self) -> PredictorSession:
        return PredictorSession(self.net)

    # -- files ------------------------------------------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        """Write the predictor directory. The files are written in a folder of their own first and moved in when all
        are complete, so an error while writing leaves no half-written predictor (and an existing one as it was): for
        a new directory that folder is made beside it and renamed to it; into an existing directory (a predictor's,
        replaced) it is made inside it, so that only the directory itself must be writable and the moves stay on one
        file system, and the three files are replaced one by one, config.json last. A file the writer cannot write (a
        full disk) is an OSError naming `path`. A `path` that cannot take a predictor (a file, or a directory of other
        files such as a model's) is refused first, with a ValueError (`check_predictor_dir`)."""
        from safetensors import SafetensorError
        from safetensors.torch import save_file

        check_predictor_dir(path, writable=False)  # writing is tried below, where a failure leaves nothing behind
        path = Path(path)
        staging = None
        try:
            into = path.is_dir()
            if not into:
                path.parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=".staging." if into else f".{path.name}.",
                                            dir=path if into else path.parent))
            state = {k: v.detach().to("cpu").contiguous() for k, v in self.net.state_dict().items()}
            # the next-token head is stored in fp16 (half the bytes; `fit_next_head` rounds it to that precision)
            # and read back into fp32; the rest keeps its own dtype
            state = {k: v.half() if k.startswith(HALF_PREFIX) else v for k, v in state.items()}
            save_file(state, str(staging / WEIGHTS_FILE), metadata={"format": FORMAT})
            umask_permissions(staging / WEIGHTS_FILE)
            umask_permissions(staging, directory=True)
            config = {"format": FORMAT, "model": self.config.to_dict(), "info": self.info}
            (staging / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
            counts = {"expert_counts": self.expert_counts.tolist()}
            (staging / COUNTS_FILE).write_text(json.dumps(counts) + "\n", encoding="utf-8")
            if not into:
                staging.rename(path)
                staging = None  # it is the predictor now
                return
            for name in (WEIGHTS_FILE, COUNTS_FILE, CONFIG_FILE):  # config last: it names the format
                os.replace(staging / name, path / name)
        except (OSError, SafetensorError) as exc:  # SafetensorError: the writer's own, for a file it cannot fill
            detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            raise OSError(f"cannot write {path} ({detail}); give a writable place with enough space") from None
        finally:
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)

    @classmethod
    def load(cls, path: str | Path, device: str | torch.device = "cpu") -> RoutePredictor:
        """Read a predictor directory; errors name the file, the problem and the fix."""
        from safetensors import SafetensorError, safe_open
        from safetensors.torch import load_file

        path = Path(path)
        if not (path / CONFIG_FILE).is_file() or not (path / WEIGHTS_FILE).is_file():
            raise FileNotFoundError(f"{path} is not a route predictor directory (it needs {CONFIG_FILE} and "
                                    f"{WEIGHTS_FILE}; train one with `expertflow predictor train`)")
        retrain = "train the predictor again with `expertflow predictor train`"
        try:
            config = json.loads((path / CONFIG_FILE).read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise ValueError(f"{path / CONFIG_FILE} is not JSON ({exc}); {retrain}") from None
        if not isinstance(config, dict) or config.get("format") != FORMAT:
            found = config.get("format") if isinstance(config, dict) else None
            raise ValueError(f"{path / CONFIG_FILE}: format={found!r}, expected {FORMAT!r}: {path} is not a "
                             f"route predictor directory (is it a model's?); give one written by `expertflow "
                             "predictor train`")
        for key in ("model", "info"):
            if config.get(key) is not None and not isinstance(config[key], dict):
                raise ValueError(f"{path / CONFIG_FILE}: {key!r} is a {type(config[key]).__name__}, not an object; "
                                 f"{retrain}")
        try:
            with torch.device("meta"):  # sizes only: a damaged size (10**12 experts) allocates nothing
                shapes = {k: tuple(v.shape) for k, v in RouteNet(PredictorConfig.from_dict(config["model"]))
                          .state_dict().items()}
        except (KeyError, TypeError, ValueError, RuntimeError, OverflowError) as exc:  # Runtime: sizes overflow
            raise ValueError(f"{path / CONFIG_FILE}: unreadable network settings ({type(exc).__name__}: {exc}); "
                             f"{retrain}") from None

        def damaged(detail: object) -> ValueError:
            text = " ".join(str(detail).split())
            text = text if len(text) <= 160 else text[:159] + "…"
            return ValueError(f"{path / WEIGHTS_FILE} does not hold the weights {CONFIG_FILE} describes ({text}); "
                              f"{retrain}")

        try:  # the stored shapes, from the header: compared before the network is built at config.json's size
            with safe_open(str(path / WEIGHTS_FILE), "pt") as f:
                stored = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        except SafetensorError as exc:
            raise damaged(exc) from None
        if stored != shapes:
            key = next((k for k in shapes if shapes[k] != stored.get(k)), None) or min(set(stored) - set(shapes))
            raise damaged(f"{key}: {list(stored[key]) if key in stored else 'missing'} in the file, "
                          f"{list(shapes[key]) if key in shapes else 'none'} in the settings")
        try:
            net = RouteNet(PredictorConfig.from_dict(config["model"]))
            net.load_state_dict(load_file(str(path / WEIGHTS_FILE)))
        except (SafetensorError, RuntimeError) as exc:
            raise damaged(exc) from None
        try:  # `save` always writes it; without it the frequency baselines would read as measured zeros
            raw = json.loads((path / COUNTS_FILE).read_text(encoding="utf-8"))["expert_counts"]
            counts = np.asarray(raw, dtype=np.float64)  # float first: a stray null, string or huge value is caught
        except FileNotFoundError:
            raise ValueError(f"{path} lacks {COUNTS_FILE} (the training trace's expert counts); {retrain}") from None
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError, OverflowError,
                IsADirectoryError, RecursionError) as exc:
            raise ValueError(f"{path / COUNTS_FILE} is unreadable ({type(exc).__name__}: {exc}); "
                             f"{retrain}") from None
        wanted = (net.config.num_layers, net.config.num_experts)
        if counts.shape != wanted:
            raise ValueError(f"{path / COUNTS_FILE} holds expert counts of shape {counts.shape}, not (layers, "
                             f"experts) {wanted}; {retrain}")
        bad = ~(np.isfinite(counts) & (counts >= 0) & (counts < 2**63) & (counts == np.floor(counts)))
        if bad.any():
            shown = json.dumps(np.asarray(raw, dtype=object)[bad][0])  # as written: null, 1.5, -1, 1e+30
            raise ValueError(f"{path / COUNTS_FILE} holds an expert count that is not a whole number in [0, 2**63) "
                             f"({shown}); {retrain}")
        return cls(net, counts.astype(np.int64), config.get("info")).to(device)

    # -- whole sequences (evaluation) -------------------------------------------------------------------------------
    @property
    def has_next_head(self) -> bool:
        """Whether it also predicts the routes of the tokens after each one (see `fit_next_head`)."""
        return self.net.next_head is not None

    @torch.inference_mode()
    def predict(self, batch: dict[str, torch.Tensor], with_next: bool = False
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced probabilities [B, T, L, E] for a padded batch (see `data.pad_batch`); with `with_next`
        also [B, T, K, L, E], those of the K tokens after each one (K = `config.next_tokens`, from the head's windows;
        needs the next-token head)."""
        keys = ("encoder_ids", "encoder_mask", "decoder_ids", "decoder_mask")
        if not isinstance(batch, dict) or any(k not in batch for k in keys):
            got = f"dict with keys {sorted(batch)}" if isinstance(batch, dict) else type(batch).__name__
            raise TypeError(f"predict takes a padded batch, a dict with {', '.join(keys)} (build it with "
                            "expertflow.predictor.data.pad_batch from the sequences' prompt and token ids); got a "
                            f"{got}. For token ids as they arrive, use a session (RoutePredictor.new_session)")
        ids, mask, dec, dec_mask = (batch[k].to(self.device) for k in keys)
        states = self.net.decode_states(dec, dec_mask, self.net.cross_kv(self.net.encode(ids, mask)), mask)
        probs = torch.sigmoid(self.net.route_logits(states))
        if not with_next:
            return probs
        if not self.has_next_head:
            raise ValueError("this predictor has no next-token head; fit one with `expertflow predictor fit-next`")
        return probs, self.net.next_probs(states)


class PredictorSession:
    """Prediction state of one batch of sequences: prompt encodings and the decoder cache of each row."""

    def __init__(self, net: RouteNet) -> None:
        self._net = net
        self._cross: list[tuple[torch.Tensor, torch.Tensor]] = []  # per decoder layer: [B, H, S, D/H] each
        self._encoder_mask: torch.Tensor | None = None  # [B, S]
        self._past: DecoderCache | None = None  # per decoder layer: [B, H, P, D/H] keys and values
        self._mask: torch.Tensor | None = None  # [B, P]
        self._right_padded = False  # some row has padding after a real token: `decode` would mispredict it
        # [B, K, L, E] after each prefill/decode, when the net has a next-token head: its guess for the routes of the
        # K tokens that will follow each row's last one (those of the next K steps), which are not known yet
        self.next_probs: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return 0 if self._mask is None else int(self._mask.shape[0])

    @property
    def length(self) -> int:
        """P: positions cached per row (padding included)."""
        return 0 if self._mask is None else int(self._mask.shape[1])

    @property
    def right_padded(self) -> bool:
        """Whether some row has padding after a real token (right padding): such a batch can be prefilled, not
        continued with `decode`."""
        return self._right_padded

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Start the batch from its prompts [B, T]; probabilities [B, T, L, E] of every prompt token at every layer.
        Replaces whatever the session held before. Left or right padding gives the same predictions here, but only a
        left-padded batch can go on with `decode` (relative positions are counted in the padded row, so right padding
        would put a gap between a short prompt and its next tokens; `decode` refuses it)."""
        device = self._net.head.weight.device
        ids = input_ids.to(device, torch.long)
        mask = torch.ones_like(ids) if attention_mask is None else attention_mask.to(device, torch.long)
        if ids.dim() != 2 or ids.shape[1] < 1 or mask.shape != ids.shape:
            raise ValueError(f"prefill takes input_ids [B, T] with T >= 1 and attention_mask of the same shape; got "
                             f"{tuple(ids.shape)} and {tuple(mask.shape)}")
        encoded = self._net.encode(ids, mask)
        self._cross, self._encoder_mask = self._net.cross_kv(encoded), mask
        self._past = DecoderCache(len(self._net.decoder))
        states = self._net.decode_states(ids, mask, self._cross, mask, self._past)
        self._mask = mask
        self._right_padded = _has_right_padding(mask)  # host sync, once per prefill
        return self._probs(states, mask)

    @torch.inference_mode()
    def decode(self, next_ids: torch.Tensor) -> torch.Tensor:
        """One incremental step: the tokens [B, T] about to be processed (usually T = 1; more when a model checks
        candidate tokens or continues with new input), all real, after every row's last one -> probabilities
        [B, T, L, E]. `next_probs` is then that of each row's last new token."""
        if self._past is None:
            raise RuntimeError("decode() before prefill(): start the session with the batch's prompts")
        if next_ids.dim() != 2 or next_ids.shape[0] != self.batch_size or next_ids.shape[1] < 1:
            raise ValueError(f"decode takes next_ids [B, T] with B={self.batch_size} and T >= 1; got "
                             f"{tuple(next_ids.shape)}")
        if self._right_padded:
            raise ValueError("decode() after a right-padded prefill (a row has padding after its tokens): positions "
                             "are counted in the padded row, so the new tokens would be predicted as if that padding "
                             "came before them; prefill left-padded prompts (as generate pads them)")
        ids = next_ids.to(self._mask.device, torch.long)
        self._mask = torch.cat([self._mask, torch.ones_like(ids)], dim=1)
        states = self._net.decode_states(ids, self._mask, self._cross, self._encoder_mask, self._past)
        return self._probs(states)

    @torch.inference_mode()
    def crop(self, length: int) -> None:
        """Keep the first `length` positions of every row (padding included, as `length` counts them), as a model's
        KV cache does when it drops candidate tokens it rejected; the next `decode` continues after them."""
        if not 0 <= length <= self.length:
            raise ValueError(f"crop keeps 0 to {self.length} positions (the session's length); got {length}")
        if self._past is None or length == self.length:
            return
        self._mask = self._mask[:, :length]
        self._past.crop(length)
        self.next_probs = None  # belonged to a token that is gone
        if self._right_padded:
            self._right_padded = _has_right_padding(self._mask)

    def _probs(self, states: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Route probabilities of the processed tokens; also sets `next_probs` when the net has a next-token head
        (from each row's last real token: the last column, or with right padding the last one `mask` keeps)."""
        self.next_probs = None
        if self._net.next_head is not None:
            if mask is None:
                last = states[:, -1]
            else:
                at = mask.shape[1] - 1 - mask.flip(1).argmax(dim=1)  # [B]
                last = states[torch.arange(states.shape[0], device=states.device), at]
            self.next_probs = self._net.next_probs(last)
        return torch.sigmoid(self._net.route_logits(states))

    @torch.inference_mode()
    def reorder(self, index: torch.Tensor) -> None:
        """Keep rows `index` (LongTensor of row numbers, any order, repeats allowed) in that order."""
        if self._mask is None:
            return
        index = index.to(self._mask.device, torch.long)
        self.next_probs = None  # belonged to the rows of the last call
        pick = lambda x: x.index_select(0, index)  # noqa: E731
        self._mask, self._encoder_mask = pick(self._mask), pick(self._encoder_mask)
        self._cross = [(pick(k), pick(v)) for k, v in self._cross]
        self._past.select(index)
        if self._right_padded:
            self._right_padded = _has_right_padding(self._mask)

    @classmethod
    def merge(cls, sessions: Sequence[PredictorSession]) -> PredictorSession:
        """One session holding the rows of `sessions` in order. Shorter rows are left-padded (masked); relative
        positions between real tokens do not change, so every row predicts exactly as before."""
        live = [s for s in sessions if s._mask is not None]
        if not live:
            raise ValueError("merge needs at least one session that has been prefilled")
        out = cls(live[0]._net)
        p = max(s.length for s in live)
        prompt = max(s._encoder_mask.shape[1] for s in live)
        out._mask = torch.cat([left_pad(s._mask, p, 1) for s in live])
        out._encoder_mask = torch.cat([left_pad(s._encoder_mask, prompt, 1) for s in live])
        out._past = DecoderCache.concat_left_padded([s._past for s in live])
        out._cross = [tuple(torch.cat([left_pad(s._cross[i][j], prompt, 2) for s in live]) for j in (0, 1))
                      for i in range(len(live[0]._cross))]
        out._right_padded = any(s._right_padded for s in live)
        return out


def _has_right_padding(mask: torch.Tensor) -> bool:
    """Whether some row of `mask` [B, P] (1 = real token) has padding after a real token."""
    return bool((mask[:, :-1] > mask[:, 1:]).any())
