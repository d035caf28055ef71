"""The route-path predictor network: a small T5-style encoder-decoder over the MoE model's token ids.

Owns: the math. The encoder reads the prompt (bidirectional self-attention); the decoder reads the tokens being
processed (causal self-attention + cross-attention to the encoder); one linear head turns each decoder state into
L x E logits, read as per-layer expert probabilities. An optional second head (`next_hidden` > 0, a small MLP on the
same states) gives the same for the tokens that will *follow* each one, by windows (`next_windows`: the next token,
the one after it, then any of the next two, any of the next four…): during generation they are not known until
their steps come, and the cache engine uses this guess to judge which experts the next steps will need.
Positions enter only through T5's bucketed relative-position bias (shared by all layers of a stack), counted in the
padded row: a teacher-forced pass sees the same distances between real tokens with left or right padding, and so does
incremental decoding after left padding (after right padding, the padding would sit between a row's last prompt token
and its new ones, so continued batches must be left padded). Incremental decoding:
`decode(..., cache=...)` appends the new tokens' self-attention keys/values to a `DecoderCache` (buffers that grow by
doubling, so a step appends in place instead of copying the whole cache); the encoder output is turned into
cross-attention keys/values once by `cross_kv`.

Does not know: traces, training, sessions or files (see `session.py`, `train.py`).

Shape legend: B = sequences, S = encoder (prompt) length, T = decoder tokens in this call, P = decoder tokens cached
before this call, D = d_model, H = heads, L = MoE layers, E = experts per layer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["PredictorConfig", "RouteNet", "DecoderCache", "left_pad"]

_MASKED = -1e9  # finite, so that a fully padded query row gives a uniform (ignored) attention instead of NaN
# the row of an id when the vocabulary has more ids than rows (and of an id past the vocabulary): id * this mod rows.
# A prime, so coprime with the row count: the map is only a permutation of id mod rows, and ids a multiple of rows
# apart always share a row
_HASH_MULTIPLIER = 2654435761
# Attention scores (and biases) held at once, in elements: past it, a call attends a block of queries at a time (a
# long prompt's [B, H, S, S] would take gigabytes: 8,192 tokens, 4 heads, 2 GB at batch 1)
_SCORES_AT_ONCE = 1 << 24
# the farthest token the next-token head may predict: the cache looks a few steps ahead (8 by default), and every
# decode step spreads the windows over this many tokens (`window_token_probs`)
MAX_NEXT_TOKENS = 64


@dataclass(frozen=True)
class PredictorConfig:
    """Sizes of the network and of the MoE model it predicts for.

    vocab_size: the MoE model's vocabulary. Ids are embedded directly when vocab_size <= max_embeddings; a larger
    vocabulary is mapped onto max_embeddings rows by id * 2654435761 mod max_embeddings, a permutation of
    id mod max_embeddings, so most rows are shared by about vocab_size / max_embeddings ids: a bounded file size,
    paid for in shared rows.
    """

    vocab_size: int
    num_layers: int  # L, MoE layers of the predicted model
    num_experts: int  # E
    top_k: int  # experts per token in the predicted model
    d_model: int = 128
    d_ff: int = 512
    heads: int = 4
    encoder_layers: int = 1
    decoder_layers: int = 3
    relative_buckets: int = 32
    relative_max_distance: int = 128
    dropout: float = 0.0
    max_embeddings: int = 16384
    token_features: int = 0  # width of fixed per-token features (the predicted model's own embeddings); 0 = none
    next_hidden: int = 0  # hidden width of the next-token head (routes of the tokens after each one); 0 = none
    # the next-token head's windows of following tokens, each given by its last offset: (1, 2, 4, 8) = t+1, t+2, any
    # of t+3 … t+4, any of t+5 … t+8 (the chance that at least one of them routes to the expert)
    next_windows: tuple[int, ...] = (1,)

    def __post_init__(self) -> None:
        object.__setattr__(self, "next_windows", check_windows(self.next_windows))  # a list from JSON: a tuple
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "next_windows":
                continue
            if f.name == "dropout":
                if not 0.0 <= value < 1.0:
                    raise ValueError(f"dropout={value} must lie in [0, 1)")
            elif f.name not in ("encoder_layers", "token_features", "next_hidden") and value < 1:
                raise ValueError(f"{f.name}={value} must be at least 1")
        for name in ("token_features", "next_hidden"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must not be negative")
        if self.encoder_layers < 0:
            raise ValueError(f"encoder_layers={self.encoder_layers} must not be negative")
        if self.d_model % self.heads:
            raise ValueError(f"d_model={self.d_model} must be divisible by heads={self.heads}")
        # `relative_bucket` gives each distance below `exact` a bucket of its own and log-spaces the rest up to
        # relative_max_distance: the bidirectional encoder over half the buckets per direction (exact = a quarter of
        # them), the causal decoder over all of them (exact = half)
        encoder_exact, decoder_exact = self.relative_buckets // 2 // 2, self.relative_buckets // 2
        if encoder_exact < 1:
            raise ValueError(f"relative_buckets={self.relative_buckets} must be at least 4: the encoder splits them by "
                             "direction, and each direction needs a bucket for distance 0 and one for the rest")
        exact = max(encoder_exact, decoder_exact)
        if self.relative_max_distance <= exact:
            raise ValueError(f"relative_max_distance={self.relative_max_distance} must be above {exact}: "
                             f"relative_buckets={self.relative_buckets} gives each distance below {decoder_exact} a "
                             f"bucket of its own in the decoder (below {encoder_exact} in the encoder) and log-spaces "
                             "the rest up to relative_max_distance; raise it or lower relative_buckets")

    @property
    def embeddings(self) -> int:
        return min(self.vocab_size, self.max_embeddings)

    @property
    def next_tokens(self) -> int:
        """How many following tokens the next-token head covers (the last window's end)."""
        return self.next_windows[-1]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PredictorConfig:
        known = {f.name for f in fields(cls)}
        if "next_offsets" in data and "next_windows" not in data:  # older files: one window per token, t+1 … t+K
            data = {**data, "next_windows": list(range(1, int(data["next_offsets"]) + 1))}
        return cls(**{k: v for k, v in data.items() if k in known})


def check_windows(windows: Sequence[int], training: bool = False) -> tuple[int, ...]:
    """`windows` (windows of following tokens by last offset) as a tuple, or ValueError when they are not increasing
    offsets of at least 1 (and, for a head about to be trained, `training`, at most MAX_NEXT_TOKENS: a saved
    predictor's windows are read as they are)."""
    out = tuple(int(w) for w in windows)
    if not out or out[0] < 1 or any(b <= a for a, b in zip(out, out[1:])):
        raise ValueError(f"next-token windows {','.join(map(str, out)) or '(none)'} must be increasing offsets of at "
                         "least 1, e.g. 1,2,4,8 (t+1, t+2, any of t+3 … t+4, any of t+5 … t+8)")
    if training and out[-1] > MAX_NEXT_TOKENS:
        raise ValueError(f"next-token windows {','.join(map(str, out))} reach {out[-1]} tokens ahead; the head "
                         f"predicts at most {MAX_NEXT_TOKENS} ahead (the cache looks a few steps ahead): give windows "
                         f"ending at most {MAX_NEXT_TOKENS}, e.g. 1,2,4,8")
    return out


def window_token_probs(window_probs: torch.Tensor, windows: tuple[int, ...]) -> torch.Tensor:
    """Per-token chances [..., H, L, E] from per-window ones [..., W, L, E] (`windows` as in
    `PredictorConfig.next_windows`, H = its last): each token of a window of n gets 1 − (1 − p)^(1/n), so that the
    window as a whole is used with chance p when its tokens are taken as independent."""
    if windows[-1] == len(windows):  # one token per window
        return window_probs
    parts, start = [], 0
    for w, end in enumerate(windows):  # a few small ops, no host-device traffic (this runs every decode step)
        n = end - start
        p = window_probs.select(-3, w).unsqueeze(-3)
        if n > 1:
            p = (1.0 - (1.0 - p.clamp(0.0, 1.0)).pow(1.0 / n)).expand(*p.shape[:-3], n, *p.shape[-2:])
        parts.append(p)
        start = end
    return torch.cat(parts, dim=-3)


def relative_bucket(relative: torch.Tensor, bidirectional: bool, buckets: int, max_distance: int) -> torch.Tensor:
    """T5's bucketing of `relative` = key position - query position: exact for small distances, log-spaced beyond."""
    out = torch.zeros_like(relative)
    if bidirectional:
        buckets //= 2
        out = out + (relative > 0).long() * buckets
        distance = relative.abs()
    else:
        distance = (-relative).clamp(min=0)  # the future is masked anyway
    exact = buckets // 2
    scaled = torch.log(distance.float().clamp(min=1) / exact) / math.log(max_distance / exact)
    far = (exact + (scaled * (buckets - exact)).long()).clamp(max=buckets - 1)
    return out + torch.where(distance < exact, distance, far)


class PositionBias(nn.Module):
    """Learned per-head bias of each relative-position bucket. For the decoder (`causal`), keys after the query get
    the masking value instead, so one tensor carries both position and causality."""

    def __init__(self, config: PredictorConfig, causal: bool) -> None:
        super().__init__()
        self.causal = causal
        self.buckets, self.max_distance = config.relative_buckets, config.relative_max_distance
        self.bias = nn.Embedding(config.relative_buckets, config.heads)
        self._table = torch.zeros(1, dtype=torch.long)  # bucket of offset o at index o + reach, |o| <= reach
        self._reach = 0

    def forward(self, query_start: int, queries: int, keys: int) -> torch.Tensor:  # [1, H, T, P+T]
        # a sliding window over the per-offset values, read with unfold (a view) and one flip (the only copy)
        return self._per_offset(query_start, queries, keys).flip(-1).unfold(-1, keys, 1).flip(-1).unsqueeze(0)

    def block(self, query_start: int, queries: int, keys: int) -> torch.Tensor:  # [1, H, T, K], contiguous
        """The same values as `forward`, copied row by row into a contiguous tensor: for a block of a long call's
        queries, where `forward`'s copy of fewer queries than keys comes out keys-first (slow to make and to
        attend with)."""
        # (query i, key j) reads index j + (queries - 1 - i): the rows of a view of overlapping windows, copied in
        # order, then reversed
        return self._per_offset(query_start, queries, keys).unfold(-1, keys, 1).contiguous().flip(1).unsqueeze(0)

    def _per_offset(self, query_start: int, queries: int, keys: int) -> torch.Tensor:  # [H, keys + queries - 1]
        """The bias of each offset o = key - query from lo = -(query_start + queries - 1) to hi = keys - 1 -
        query_start (query i, key j: o = j - (query_start + i)), the masking value after 0 for the decoder."""
        lo, hi = -(query_start + queries - 1), keys - 1 - query_start
        values = self.bias(self._offset_buckets(lo, hi)).T  # [H, hi - lo + 1]
        if self.causal and hi > 0:
            values = torch.cat([values[:, :-hi], values.new_full((values.shape[0], hi), _MASKED)], dim=1)
        return values

    def _offset_buckets(self, lo: int, hi: int) -> torch.Tensor:
        reach = max(-lo, hi)
        device = self.bias.weight.device
        if reach > self._reach or self._table.device != device:
            self._reach = max(reach, 2 * self._reach, 256)
            # a normal tensor even when first built under inference mode (a session, `predict`), which a later
            # training pass could not save for backward
            with torch.inference_mode(False):
                offsets = torch.arange(-self._reach, self._reach + 1, device=device)
                self._table = relative_bucket(offsets, not self.causal, self.buckets, self.max_distance)
        return self._table[lo + self._reach:hi + self._reach + 1]


class RowBias:
    """The bias of queries from `query_start` over the keys of `mask` [B, K] (relative position and causality from
    `position`, if any, and the key mask), made a block of query rows at a time by `Attention`: for calls whose
    scores would pass `_SCORES_AT_ONCE` (`attention_bias`)."""

    def __init__(self, position: PositionBias | None, query_start: int, mask: torch.Tensor) -> None:
        self.position, self.query_start, self.keys = position, query_start, mask.shape[1]
        self.key_mask = _key_mask(mask) if bool((mask == 0).any()) else None  # host sync, once per call

    def rows(self, first: int, count: int) -> torch.Tensor | None:  # [B|1, H|1, count|1, K]
        if self.position is None:
            return self.key_mask
        bias = self.position.block(self.query_start + first, count, self.keys)
        return bias if self.key_mask is None else bias + self.key_mask


def attention_bias(position: PositionBias | None, query_start: int, queries: int, mask: torch.Tensor, heads: int
                   ) -> torch.Tensor | RowBias | None:
    """The attention bias of `queries` queries from `query_start` over the keys of `mask` [B, K], with `position`'s
    relative-position bias if given: whole, or made by blocks of queries where the call's scores [B, heads, queries,
    K] would pass `_SCORES_AT_ONCE`."""
    if mask.shape[0] * heads * queries * mask.shape[1] > _SCORES_AT_ONCE:
        return RowBias(position, query_start, mask)
    return _with_padding(None if position is None else position(query_start, queries, mask.shape[1]), mask)


class DecoderCache:
    """Self-attention keys/values of every decoder layer for B rows, P positions, in buffers with spare capacity.

    `update(layer, k, v)` writes the new positions after the cached ones and returns views of all of them; once every
    layer has been updated for a call, `advance(t)` moves the length on.
    """

    def __init__(self, layers: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * layers  # [B, H, capacity, D/H]
        self.values: list[torch.Tensor | None] = [None] * layers
        self.length = 0

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + k.shape[2]
        buf_k, buf_v = self.keys[layer], self.values[layer]
        if buf_k is None or buf_k.shape[2] < end:
            capacity = max(end, 2 * (0 if buf_k is None else buf_k.shape[2]), 64)
            grown_k, grown_v = k.new_zeros(*k.shape[:2], capacity, k.shape[3]), v.new_zeros(*v.shape[:2], capacity,
                                                                                            v.shape[3])
            if buf_k is not None:
                grown_k[:, :, :self.length], grown_v[:, :, :self.length] = self.view(layer)
            self.keys[layer], self.values[layer] = buf_k, buf_v = grown_k, grown_v
        buf_k[:, :, self.length:end], buf_v[:, :, self.length:end] = k, v
        return buf_k[:, :, :end], buf_v[:, :, :end]

    def advance(self, tokens: int) -> None:
        self.length += tokens

    def view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[layer][:, :, :self.length], self.values[layer][:, :, :self.length]

    def crop(self, length: int) -> None:
        """Keep the first `length` positions (the buffers keep their capacity; later updates overwrite the rest)."""
        self.length = min(self.length, length)

    def select(self, index: torch.Tensor) -> None:
        """Keep rows `index` in that order."""
        for i in range(len(self.keys)):
            if self.keys[i] is not None:
                self.keys[i], self.values[i] = (x.index_select(0, index) for x in self.view(i))

    @classmethod
    def concat_left_padded(cls, caches: list[DecoderCache]) -> DecoderCache:
        """The rows of `caches` in order; shorter ones left-padded with zeros to the longest length."""
        out = cls(len(caches[0].keys))
        out.length = max(c.length for c in caches)
        for i in range(len(out.keys)):
            views = [c.view(i) for c in caches]
            out.keys[i], out.values[i] = (torch.cat([left_pad(v[j], out.length, 2) for v in views]) for j in (0, 1))
        return out


def left_pad(x: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    """`x` with zeros prepended along `dim` up to `length`."""
    missing = length - x.shape[dim]
    return x if missing == 0 else F.pad(x, [0, 0] * (x.dim() - dim - 1) + [missing, 0])


class Attention(nn.Module):
    """Multi-head attention with separate projections, so that cross-attention keys/values can be computed once."""

    def __init__(self, config: PredictorConfig) -> None:
        super().__init__()
        d = config.d_model
        self.heads = config.heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.dropout = config.dropout

    def split(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, D] -> [B, H, T, D/H]
        b, t, d = x.shape
        return x.view(b, t, self.heads, d // self.heads).transpose(1, 2)

    def keys_values(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.split(self.k(x)), self.split(self.v(x))

    def forward(self, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | RowBias | None
                ) -> torch.Tensor:
        q = self.split(self.q(x))  # [B, H, T, D/H]
        p = self.dropout if self.training else 0.0
        if isinstance(bias, RowBias):  # a block of queries at a time, each with its rows of the bias
            rows = max(1, _SCORES_AT_ONCE // (q.shape[0] * q.shape[1] * k.shape[2]))
            out = torch.cat([F.scaled_dot_product_attention(q[:, :, i:i + rows], k, v, dropout_p=p,
                                                            attn_mask=bias.rows(i, min(rows, q.shape[2] - i)))
                             for i in range(0, q.shape[2], rows)], dim=2)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=p)  # [B, H, T, D/H]
        b, h, t, dh = out.shape
        return self.o(out.transpose(1, 2).reshape(b, t, h * dh))


class FeedForward(nn.Module):
    def __init__(self, config: PredictorConfig) -> None:
        super().__init__()
        self.up = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.down = nn.Linear(config.d_ff, config.d_model, bias=False)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.drop(F.gelu(self.up(x))))


class EncoderLayer(nn.Module):
    def __init__(self, config: PredictorConfig) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(config.d_model), nn.RMSNorm(config.d_model)
        self.attn, self.ff = Attention(config), FeedForward(config)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.drop(self.attn(h, *self.attn.keys_values(h), bias))
        return x + self.drop(self.ff(self.norm2(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: PredictorConfig) -> None:
        super().__init__()
        self.norm1, self.norm2, self.norm3 = (nn.RMSNorm(config.d_model) for _ in range(3))
        self.self_attn, self.cross_attn, self.ff = Attention(config), Attention(config), FeedForward(config)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, self_bias: torch.Tensor, cache: DecoderCache | None, index: int,
                cross: tuple[torch.Tensor, torch.Tensor], cross_bias: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        k, v = self.self_attn.keys_values(h)  # [B, H, T, D/H]
        if cache is not None:
            k, v = cache.update(index, k, v)  # [B, H, P+T, D/H]
        x = x + self.drop(self.self_attn(h, k, v, self_bias))
        x = x + self.drop(self.cross_attn(self.norm2(x), *cross, cross_bias))
        return x + self.drop(self.ff(self.norm3(x)))


class RouteNet(nn.Module):
    """Encoder-decoder with a linear L x E head. `forward` is the teacher-forced pass used for training."""

    def __init__(self, config: PredictorConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.embeddings, config.d_model)  # shared by encoder and decoder, as in T5
        if config.token_features:  # fixed features, stored in fp16, seen through a learned projection
            self.register_buffer("features", torch.zeros(config.embeddings, config.token_features,
                                                         dtype=torch.float16))
            self.feature_proj = nn.Linear(config.token_features, config.d_model, bias=False)
        self.encoder = nn.ModuleList(EncoderLayer(config) for _ in range(config.encoder_layers))
        self.decoder = nn.ModuleList(DecoderLayer(config) for _ in range(config.decoder_layers))
        self.encoder_bias, self.decoder_bias = PositionBias(config, False), PositionBias(config, True)
        self.encoder_norm, self.decoder_norm = nn.RMSNorm(config.d_model), nn.RMSNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.num_layers * config.num_experts)
        self.next_head = (nn.Sequential(nn.Linear(config.d_model, config.next_hidden), nn.GELU(),
                                        nn.Linear(config.next_hidden,
                                                  len(config.next_windows) * config.num_layers * config.num_experts))
                          if config.next_hidden else None)
        self.drop = nn.Dropout(config.dropout)
        self.apply(_init)
        if config.token_features:  # the learned table starts at zero: a token never trained on is its features
            nn.init.zeros_(self.embed.weight)
        with torch.no_grad():  # start at the base rate k / E, so early training is not spent unlearning 0.5
            self.head.bias.fill_(math.log(config.top_k / max(config.num_experts - config.top_k, 1)))

    def embedding_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The embedding row of each token id: the id itself, or, for a vocabulary too large to embed (and for ids
        beyond the vocabulary), id * `_HASH_MULTIPLIER` mod the row count."""
        c = self.config
        ids = ids.clamp(min=0)  # padding may carry any id; it is masked out
        hashed = (ids * _HASH_MULTIPLIER) % c.embeddings
        return hashed if c.vocab_size > c.max_embeddings else torch.where(ids < c.embeddings, ids, hashed)

    def embed_ids(self, ids: torch.Tensor) -> torch.Tensor:  # [B, T] -> [B, T, D]
        rows = self.embedding_rows(ids)
        x = self.embed(rows)
        if self.config.token_features:
            x = x + self.feature_proj(self.features[rows].float())
        return self.drop(x)

    def encode(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:  # [B, S] -> [B, S, D]
        x = self.embed_ids(ids)
        s = ids.shape[1]
        bias = attention_bias(self.encoder_bias, 0, s, mask, self.config.heads)  # [B|1, H, S, S], or by blocks
        for layer in self.encoder:
            x = layer(x, bias)
        return self.encoder_norm(x)

    def cross_kv(self, encoded: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per decoder layer, cross-attention keys and values [B, H, S, D/H], contiguous for the many decode steps."""
        return [tuple(x.contiguous() for x in layer.cross_attn.keys_values(encoded)) for layer in self.decoder]

    def decode(self, ids: torch.Tensor, mask: torch.Tensor, cross: list[tuple[torch.Tensor, torch.Tensor]],
               encoder_mask: torch.Tensor, cache: DecoderCache | None = None) -> torch.Tensor:
        """Logits [B, T, L, E] of `ids` [B, T] after the P tokens in `cache` (which gets them appended);
        `mask` [B, P+T] covers cached and new tokens. Without a cache the call sees only `ids`."""
        return self.route_logits(self.decode_states(ids, mask, cross, encoder_mask, cache))

    def route_logits(self, states: torch.Tensor) -> torch.Tensor:  # [B, T, D] -> [B, T, L, E]
        c = self.config
        return self.head(states).view(*states.shape[:-1], c.num_layers, c.num_experts)

    def next_logits(self, states: torch.Tensor) -> torch.Tensor:  # [B, T, D] -> [B, T, W, L, E]
        """Logits of the routes of the W windows of tokens that will follow each decoded one, nearest first (needs
        `next_head`)."""
        c = self.config
        return self.next_head(states).view(*states.shape[:-1], len(c.next_windows), c.num_layers, c.num_experts)

    def next_probs(self, states: torch.Tensor) -> torch.Tensor:  # [B, T, D] -> [B, T, H, L, E]
        """Chance that each of the H following tokens routes to each expert, from the windows' guesses
        (`window_token_probs`)."""
        return window_token_probs(torch.sigmoid(self.next_logits(states)), self.config.next_windows)

    def decode_states(self, ids: torch.Tensor, mask: torch.Tensor, cross: list[tuple[torch.Tensor, torch.Tensor]],
                      encoder_mask: torch.Tensor, cache: DecoderCache | None = None) -> torch.Tensor:
        """The decoder's normalized output states [B, T, D]; same arguments as `decode`."""
        t = ids.shape[1]
        start = 0 if cache is None else cache.length
        assert mask.shape[1] == start + t, "the decoder mask covers the cached and the new tokens"
        if t == 1:  # a decode step: masks of one query row are cheap, and checking for padding would sync
            self_bias = self.decoder_bias(start, t, start + t) + _key_mask(mask)  # [B, H, 1, P+1], causal
            cross_bias = _key_mask(encoder_mask)
        else:  # [1|B, H, T, P+T] and [B, 1, 1, S] (or None), or made by blocks of queries
            self_bias = attention_bias(self.decoder_bias, start, t, mask, self.config.heads)
            cross_bias = attention_bias(None, 0, t, encoder_mask, self.config.heads)
        x = self.embed_ids(ids)
        for i, layer in enumerate(self.decoder):
            x = layer(x, self_bias, cache, i, cross[i], cross_bias)
        if cache is not None:
            cache.advance(t)
        return self.decoder_norm(x)

    def forward(self, encoder_ids: torch.Tensor, encoder_mask: torch.Tensor, decoder_ids: torch.Tensor,
                decoder_mask: torch.Tensor) -> torch.Tensor:  # [B, T, L, E] logits
        cross = self.cross_kv(self.encode(encoder_ids, encoder_mask))
        return self.decode(decoder_ids, decoder_mask, cross, encoder_mask)


def _key_mask(mask: torch.Tensor) -> torch.Tensor:  # [B, K] (1 = real token) -> additive [B, 1, 1, K]
    return ((mask == 0).float() * _MASKED)[:, None, None, :]


def _with_padding(bias: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor | None:
    """`bias` plus the key mask of `mask` [B, K], skipped when nothing is padded."""
    if not bool((mask == 0).any()):  # host sync, once per multi-token call: spares a [B, H, T, K] add
        return bias
    return _key_mask(mask) if bias is None else bias + _key_mask(mask)


def _init(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
