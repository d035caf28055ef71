"""Adapter for every family whose experts class uses transformers' experts interface (`use_experts_implementation`):
mixtral, qwen2_moe, qwen3_moe, deepseek_v2/v3, olmoe, phimoe, granitemoe, gpt_oss and any other such model.

Owns: recognising such experts modules, taking their 3-D expert parameters (`gate_up_proj [E, 2I, H]`, `down_proj
[E, H, I]`, optional biases; transposed in GPT-OSS) out and back, and computing an experts forward from slot views.
Does not know: caching or transfers.

The compute follows transformers' own paths operation for operation, so fp32 results are bit-identical to the
unwrapped model: for `grouped_mm` / `batched_mm` each (token, k) pair's output is computed per expert (for
`batched_mm` one matrix-vector product per row, as there), weighted and written to its row, then the K rows of a
token are summed in top-k order; for `eager` the per-expert outputs are added with `index_add_` in ascending expert
id order, each expert's rows k-major as transformers' loop takes them. Waves (too few slots) only change when rows are
computed. Exceptions, where a row can differ in the last
bit (README, *Exactness* and *Supported models*): a custom gate that makes a contiguous buffer before an elementwise
function (`glm5_next`'s clamp, then SiLU) sees its rows laid out per expert here and for all experts at once there,
and vectorised CPU kernels compute a buffer's tail on another path; GPT-OSS's gate does the same, its buffers grouped
or ordered otherwise here (eager too), with an intermediate size that is not a multiple of 32 (the released models'
2880 is); and with a hidden or intermediate size that is not a multiple of 4, an expert's weights sit at other
16-byte alignments in a slot than in the model, and kernels take other paths by alignment.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from expertflow.adapters.base import Adapter, MoELayer, release_parameter, restore_parameter
from expertflow.store import ExpertLayout

__all__ = ["Experts3DAdapter", "is_experts3d"]

_FLAGS = ("has_gate", "has_bias", "is_transposed", "is_concatenated", "num_experts")


def is_experts3d(module: nn.Module) -> bool:
    """True for an experts module decorated with transformers' `use_experts_implementation`."""
    if not all(hasattr(module, flag) for flag in _FLAGS):
        return False
    down = module._parameters.get("down_proj")
    return isinstance(down, torch.Tensor) and down.dim() == 3 and down.shape[0] == module.num_experts


def _expert_param_names(module: nn.Module) -> list[str]:
    return [n for n, p in module._parameters.items()
            if p is not None and p.dim() >= 2 - (1 if n.endswith("_bias") else 0) and p.shape[0] == module.num_experts]


class Experts3DAdapter(Adapter):
    name = "experts-interface"

    def find_layers(self, model: nn.Module) -> list[MoELayer]:
        layers = []
        for name, module in model.named_modules():
            if not is_experts3d(module):
                continue
            names = _expert_param_names(module)
            layout = ExpertLayout.from_tensors(
                [(n, tuple(module._parameters[n].shape[1:]), module._parameters[n].dtype) for n in names])
            layers.append(MoELayer(len(layers), name, module, int(module.num_experts), layout, _layer_id(name)))
        return layers

    def expert_tensors(self, layer: MoELayer, expert: int) -> dict[str, torch.Tensor]:
        return {spec.name: layer.module._parameters[spec.name][expert] for spec in layer.layout.tensors}

    def expert_names(self, layer: MoELayer) -> list[str]:
        return [spec.name for spec in layer.layout.tensors]

    def remove_experts(self, layer: MoELayer) -> None:
        params = layer.module._parameters
        layer.removed = [(n, params[n]) for n in params if n in set(self.expert_names(layer))]
        layer.order = list(params)  # type: ignore[attr-defined]
        for n, param in layer.removed:
            del params[n]
            release_parameter(param)

    def restore_experts(self, layer: MoELayer, tensors: dict[str, torch.Tensor]) -> None:
        params = layer.module._parameters
        kept = dict(layer.removed)
        for n, param in kept.items():
            restore_parameter(param, tensors[n])
        merged = {n: kept.get(n, params.get(n)) for n in layer.order}  # type: ignore[attr-defined]
        params.clear()
        params.update(merged)
        layer.removed = []

    def expert_state(self, layer: MoELayer, store) -> dict[str, torch.Tensor]:
        return {spec.name: store.stacked_view(layer.index, spec.name) for spec in layer.layout.tensors}

    def make_forward(self, layer: MoELayer, run: Callable) -> Callable:
        def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, *a, **k):
            return run(layer, hidden_states, top_k_index, top_k_weights)

        forward.__expertflow__ = True  # type: ignore[attr-defined]
        return forward

    @staticmethod
    def compute(module: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                waves, plan) -> torch.Tensor:
        """Experts forward over slot views. `plan` = (order, starts, counts): the (token, k) rows sorted by expert,
        and each expert's first row and row count in that order; `waves` yields lists of (expert, views)
        (`Adapter.compute`)."""
        implementation = getattr(module.config, "_experts_implementation", None)
        if implementation == "grouped_mm" and torch.is_autocast_enabled(hidden.device.type):
            # transformers' grouped_mm is not autocast-enabled: under autocast its experts still compute in the
            # weights' dtype, and so do these
            with torch.autocast(hidden.device.type, enabled=False):
                return Experts3DAdapter.compute(module, hidden, top_k_index, top_k_weights, waves, plan)
        # T = tokens, K = top-k, H = hidden
        num_tokens, top_k = top_k_index.shape  # [T, K]
        order, starts, counts = plan
        # Gathered once per layer in expert order, then sliced per expert (one launch per layer, not per expert);
        # under eager each expert's rows are reordered as transformers takes them, a small sort per expert.
        sorted_tokens = order // top_k
        sorted_weights = top_k_weights.reshape(-1)[order, None]  # [T*K, 1]
        eager = implementation == "eager"
        batched = num_tokens * top_k if implementation == "batched_mm" else 0  # the batch transformers multiplies
        # In the product's dtype, as transformers keeps it until the K rows of a token are summed: fp32 router weights
        # times bf16 rows stay fp32, and under autocast bf16 rows times bf16 weights stay bf16 (rounding each row
        # to another dtype first would change the sums). Made with the first product, whose dtype that is.
        pair_out = None
        done: dict[int, torch.Tensor] = {}
        for wave in waves:
            for expert, views in wave:
                start, end = starts[expert], starts[expert] + counts[expert]
                rows = order[start:end]
                if eager:  # transformers' loop takes an expert's rows k-major (every token's first choice, then the
                    # second …): a row's place in the buffer can change its last bits (float64's blocking, rows of a
                    # size that is not a multiple of 4), so the rows go in that order here too
                    rows = rows[torch.argsort((rows % top_k) * num_tokens + rows // top_k)]
                    tokens, weights = rows // top_k, top_k_weights.reshape(-1)[rows, None]
                else:
                    tokens, weights = sorted_tokens[start:end], sorted_weights[start:end]
                out = _expert_ffn(module, hidden[tokens], views, batched, eager) * weights
                if pair_out is None:
                    pair_out = out.new_zeros(num_tokens * top_k, hidden.shape[-1])
                pair_out[rows] = out if out.dtype == pair_out.dtype else out.to(pair_out.dtype)
                done[expert] = rows
        if pair_out is None:  # no rows
            pair_out = torch.zeros(num_tokens * top_k, hidden.shape[-1], device=hidden.device,
                                   dtype=torch.promote_types(hidden.dtype, top_k_weights.dtype))
        if not eager:
            return pair_out.view(num_tokens, top_k, -1).sum(dim=1).to(hidden.dtype)  # [T, H]
        final = torch.zeros_like(hidden)
        for expert in sorted(done):
            rows = done[expert]
            final.index_add_(0, rows // top_k, pair_out[rows].to(final.dtype))
        return final


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool,
            batched: int = 0, eager: bool = False) -> torch.Tensor:
    """x: [n, in]. `batched` > 0: as transformers' `batched_mm` over that many (token, k) rows computes it, one
    matrix-vector product per row (a matrix product over the n rows rounds differently). The bias is added in place
    as transformers' `batched_mm` and `grouped_mm` add it, or under `eager` out of place as its loops do (under
    autocast a low-precision product plus a float32 bias is then float32). Under autocast to another half precision
    than the weights', a cast to theirs first would round the input twice."""
    if x.dtype != weight.dtype and not ((batched or eager) and torch.is_autocast_enabled(x.device.type)):
        x = x.to(weight.dtype)  # as grouped_mm casts its input; batched_mm and eager leave it to autocast
    if not batched:
        out = x @ weight if transposed else F.linear(x, weight)
    elif transposed:
        out = torch.bmm(x.unsqueeze(1), weight.expand(x.shape[0], *weight.shape)).squeeze(1)  # no copy: a view
    else:
        # A batch of one takes another kernel than a larger one: give a lone row a twin when transformers' batch
        # had more than one row.
        rows = x if x.shape[0] > 1 or batched == 1 else x.expand(2, -1)
        out = torch.bmm(weight.expand(rows.shape[0], *weight.shape), rows.unsqueeze(-1)).squeeze(-1)[: x.shape[0]]
    if bias is not None:
        out = out + bias if eager else out.add_(bias)
    return out


def _expert_ffn(module: nn.Module, x: torch.Tensor, views: dict[str, torch.Tensor], batched: int,
                eager: bool = False) -> torch.Tensor:
    """One expert on its tokens: up (gate) projection, gating/activation, down projection. x: [n, H]."""
    t = module.is_transposed
    if module.has_gate:
        h = _linear(x, views["gate_up_proj"], views.get("gate_up_proj_bias"), t, batched, eager)
        h = module._apply_gate(h)
    else:
        h = _linear(x, views["up_proj"], views.get("up_proj_bias"), t, batched, eager)
        h = module.act_fn(h)
    out = _linear(h, views["down_proj"], views.get("down_proj_bias"), t, batched, eager)
    if getattr(module, "has_post_expert_norm", False):
        out = module.post_expert_norm(out)
    return out


def _layer_id(name: str) -> int:
    digits = [int(part) for part in name.split(".") if part.isdigit()]
    return digits[0] if digits else -1
