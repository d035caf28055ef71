"""Could a guess made during the step fix the next-token head? How much the `expertflow` policy would gain if it
learned the true routes of each sequence's next token part way through the step, and how well the model's own
hidden states at each layer foretell those routes.

The next-token head (`expertflow predictor fit-next`) guesses the routes of the token after each sequence's last one
before the step starts, from the predictor's states; the policy uses that guess to choose what to keep for the next
step (`benchmarks/head_recall_needed.py` measures how good it would have to be). The model itself works out the next
token during the step: could a guess read from its hidden states part way through do better? Two parts:

* **Late truth** (timed simulation; same trace, predictor, compute model, ratio, targets and profiles (`default`,
  `waves`, `tuned`) as `benchmarks/perfect_predictions.py`, whose `true next token` and `true next tokens` sources are
  the truth known from the start): for each layer m, the head's guess for the next token (`truth_for` "next token";
  its guesses for the tokens after that are kept) or for all its K tokens ("all tokens") is replaced by their true
  routes as soon as layer m's router has chosen (`at_layer` m). This is the most a guess that arrives at layer m can
  give. Row `at_layer` null is the shipped head unaltered, -1 the truth from the start of the step.
* **The model's states** (built-in model only): the hidden state that enters each layer m (and the final one, after
  the last layer and the norm), at every token of the held-out recording, read in two ways: a probe, a small MLP fitted
  on the same model's states and the next token's routes over the training prompts (seeded, 12 epochs), scored by the
  top-k recall of the routes of the next token on decode tokens (`expertflow.predictor.metrics.next_token_recall`, the
  head's figure; one fixed probe, so its recall is what such a probe reads, not all the state holds); and the model's
  own output head applied to that state ("logit lens"), scored by how often its first choice (and its top five) is the
  next token. Both beside the shipped head's recall on the same tokens. With `--temperature` both recordings sample.

Prints one JSON object per (configuration, truth, layer, profile) and per state of the model, then a summary
object; progress bars on stderr. `--max-new-tokens` sizes the held-out recording only: the probes' training recording
is always that of the predictor's data (the training prompts, 64 new tokens each), which with the passes over both
recordings takes most of a run's time.

Usage: python benchmarks/late_next_guess.py [--predictor DIR] [--ratio 8] [--fractions 0.5] [--batches 1,16]
                                           [--compute-from JSONL] [--plot PNG]
       (or: --from-results JSONL --plot PNG, to redraw)
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch
from torch import nn

from expertflow import sim
from expertflow.policy.expertflow import ExpertFlowPolicy
from expertflow.predictor.metrics import next_token_recall
from ece_frontier import targets
from ece_sim import add_plot_arguments, add_source_arguments, parse_or_redraw, prepare, source_config, timing_fields
from perfect_predictions import PROFILES, baseline_config, by_profile, check_head, policy_rows

BENCHMARK = "late_next_guess"
SHOWN = PROFILES  # default, waves and tuned, as in perfect_predictions.py
PLOTTED = ("part",)
PROBE_EPOCHS = 12


class LateTruth(ExpertFlowPolicy):
    """`expertflow` whose guesses for the first tokens after each sequence's last one become their true routes once
    layer `at` has routed (`truth`: step -> the true routes [R, J, L, E] of the next J tokens of that step's rows).
    Not registered: this benchmark builds it."""

    name = "expertflow-late-truth"

    def __init__(self, *args, truth: dict[int, np.ndarray], at: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.truth, self.at = truth, at

    def on_route(self, step: int, layer: int, routes) -> None:
        super().on_route(step, layer, routes)
        if layer == self.at and self.next_demand is not None and step in self.truth:
            after = np.clip(np.asarray(self.truth[step], dtype=np.float64), 0.0, 1.0)
            self.next_demand = self.next_demand.copy()
            self.next_demand[:after.shape[1]] = 1.0 - np.prod(1.0 - after, axis=0)  # chance any row's token needs it
            self._wait = None  # the expected next uses change with it


def late_rows(trace, probs, batch: int, fraction: float, timing: sim.Timing) -> list[dict]:
    """One configuration: the head unaltered, then for the next token alone and for all the head's tokens the true
    routes from the start of the step and from each layer on."""
    predicted, head = sim.prediction_pair(probs)
    _, true_next = sim.true_predictions(trace, next_tokens=np.asarray(head).shape[1])
    first_true = np.array(head, dtype=np.float32, copy=True)
    first_true[:, 0] = true_next[:, 0]
    base = baseline_config(trace, batch, fraction, timing, BENCHMARK)
    rows = policy_rows(trace, base, {"head": (predicted, head)}, timing, SHOWN,
                       extra=dict(part="late truth", truth_for=None, at_layer=None))
    for truth_for, known, tokens in (("next token", first_true, 1), ("all tokens", true_next, len(head[0]))):
        rows += policy_rows(trace, base, {f"{truth_for} true from the start": (predicted, known)}, timing, SHOWN,
                            extra=dict(part="late truth", truth_for=truth_for, at_layer=-1))
        steps = sim.step_predictions(base["replay"], predicted, known)
        truth = {step: pair[1][:, :tokens] for step, pair in steps.items()}
        for layer in range(trace.num_layers):
            def build(capacity: int, options: dict, layer=layer, truth=truth) -> LateTruth:
                return LateTruth(capacity, trace.num_layers, trace.num_experts, truth=truth, at=layer, **options)

            rows += policy_rows(trace, base, {f"{truth_for} true from layer {layer}": (predicted, head)}, timing,
                                SHOWN, extra=dict(part="late truth", truth_for=truth_for, at_layer=layer),
                                build=build)
    return rows


def sequence_orders(trace) -> list[np.ndarray]:
    """Each sequence's row indices in position order."""
    order = np.lexsort((trace.positions, trace.seq_ids))
    cuts = np.flatnonzero(np.diff(trace.seq_ids[order])) + 1
    return np.split(order, cuts)


def hidden_states(model, trace, desc: str = "states"):
    """([N, L + 1, D] float32, mismatches): per row of `trace`, the state entering each layer and the final (normed)
    one, from one teacher-forced pass per sequence, and how many (token, layer) routes that pass chose otherwise than
    the recording (it ran padded batches, so a near tie can fall the other way; more than 0.1% is refused). A progress
    bar `desc` on stderr."""
    from tqdm import tqdm

    width = model.config.hidden_size
    out = torch.zeros(trace.num_tokens, trace.num_layers + 1, width)
    same = 0
    for rows in tqdm(sequence_orders(trace), desc=desc, unit="sequence", leave=False):
        ids = torch.as_tensor(trace.token_ids[rows], dtype=torch.long)[None]
        with torch.no_grad():
            result = model(input_ids=ids, output_hidden_states=True, output_router_logits=True)
        chosen = np.stack([r.view(len(rows), -1).topk(trace.top_k, -1).indices.numpy() for r in result.router_logits],
                          axis=1)
        same += int((np.sort(chosen, -1) == np.sort(trace.experts[rows], -1)).all(-1).sum())
        out[rows] = torch.stack(result.hidden_states, dim=2)[0]
    cells = trace.num_tokens * trace.num_layers
    if same < 0.999 * cells:
        raise RuntimeError(f"the replayed passes chose the recorded routes in only {same / cells:.2%} of (token, "
                           "layer) cells; their states are not those the recording saw")
    return out, cells - same


def next_targets(trace) -> tuple[np.ndarray, np.ndarray]:
    """(rows, their next token's row) over every row that has a next token in its sequence."""
    firsts, seconds = [], []
    for rows in sequence_orders(trace):
        firsts.append(rows[:-1])
        seconds.append(rows[1:])
    return np.concatenate(firsts), np.concatenate(seconds)


def fit_probe(states, trace, seed: int = 0) -> nn.Module:
    """A small MLP (LayerNorm → Linear 512 → GELU → Linear L * E) from a state [N, D] to the logits of the next
    token's routes [N, L * E], fitted on `trace` (BCE, AdamW, `PROBE_EPOCHS` epochs)."""
    from expertflow.predictor.metrics import route_sets

    torch.manual_seed(seed)
    rows, following = next_targets(trace)
    y = torch.as_tensor(route_sets(trace.experts[following], trace.num_experts).reshape(len(rows), -1),
                        dtype=torch.float32)
    x = states[rows]
    net = nn.Sequential(nn.LayerNorm(x.shape[1]), nn.Linear(x.shape[1], 512), nn.GELU(), nn.Linear(512, y.shape[1]))
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3, weight_decay=0.01)
    for _ in range(PROBE_EPOCHS):
        for batch in torch.randperm(len(x)).split(512):
            loss = nn.functional.binary_cross_entropy_with_logits(net(x[batch]), y[batch])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return net.eval()


def logit_lens(model, states: torch.Tensor, final: bool) -> torch.Tensor:
    """The model's output logits read from hidden states [N, D]: its final norm then its output head (the final
    state, `final`, is already normed)."""
    return model.lm_head(states if final else model.model.norm(states))


def state_rows(model, tokenizer, test, head, temperature: float | None = None) -> list[dict]:
    """The model's states read by a probe and by the model's own output head, layer by layer, beside the shipped head
    (`head`: its guesses on `test`; `temperature`: how the training prompts are recorded, as `test` was)."""
    from tqdm import tqdm

    from expertflow.models import load_prompts
    from expertflow.predictor.metrics import next_token_recall
    from expertflow.recorder import record
    from expertflow.trace import DECODE

    prompts = [r["prompt"] for r in load_prompts(split="train")]
    train = record(model, prompts, tokenizer, batch_size=16, max_new_tokens=64, max_prompt_tokens=128,
                   model_name="tiny-moe", temperature=temperature)  # as the predictor's data was; progress on stderr
    train_states, train_off = hidden_states(model, train, "training states")
    test_states, test_off = hidden_states(model, test, "held-out states")
    test_head = np.asarray(head)[:, 0]
    shipped = next_token_recall(test, test_head)
    rows, following = next_targets(test)
    decode = test.phase[following] == DECODE
    rows, nxt = rows[decode], torch.as_tensor(test.token_ids[following][decode], dtype=torch.long)
    out = []
    for m in tqdm(range(test.num_layers + 1), desc="probes", leave=False):
        probe = fit_probe(train_states[:, m], train)
        with torch.no_grad():
            scores = probe(test_states[:, m]).view(test.num_tokens, test.num_layers, test.num_experts).numpy()
            top = logit_lens(model, test_states[rows, m], final=m == test.num_layers).topk(5, -1).indices
        recall = next_token_recall(test, scores)
        row = {"benchmark": BENCHMARK, "part": "model states", "state": "final" if m == test.num_layers else m,
               "probe_recall_one_ahead": round(recall["next_token_head"], 4),
               "shipped_head_recall_one_ahead": round(shipped["next_token_head"], 4),
               "current_routes_recall_one_ahead": round(shipped["current_routes"], 4),
               "logit_lens_top1": round(float((top[:, 0] == nxt).float().mean()), 4),
               "logit_lens_top5": round(float((top == nxt[:, None]).any(-1).float().mean()), 4),
               "decode_tokens": recall["tokens"], "train_pairs": int(len(next_targets(train)[0])),
               "replay_route_mismatches": {"train": train_off, "test": test_off},
               "replay_route_cells": {"train": train.num_tokens * train.num_layers,
                                      "test": test.num_tokens * test.num_layers}}
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def plot(rows: list[dict], path: str) -> None:
    """One panel per profile: hit-rate gain against the layer at which the true routes arrive, a colour per
    configuration, solid for the next token alone and dashed for all the head's tokens, dotted for the head unaltered;
    a last panel: the probe's recall and the logit lens's accuracy per state, with the shipped head's recall."""
    from matplotlib.figure import Figure  # no pyplot: renders with Agg, no display needed

    late = [r for r in rows if r.get("part") == "late truth"]
    profiles = [p for p in PROFILES if any(r["profile"] == p for r in late)]
    panels = len(profiles) + 1
    columns = min(2, panels)
    fig = Figure(figsize=(5.6 * columns, 4.2 * ((panels + columns - 1) // columns)), layout="constrained")
    axes = fig.subplots((panels + columns - 1) // columns, columns, squeeze=False).ravel()
    configs = sorted({(r["batch"], r["cache_fraction"]) for r in late})
    for ax, profile in zip(axes, profiles):
        for i, (batch, fraction) in enumerate(configs):
            mine = [r for r in late if (r["batch"], r["cache_fraction"], r["profile"]) == (batch, fraction, profile)]
            for truth_for, style in (("next token", "o-"), ("all tokens", "s--")):
                gain = {r["at_layer"]: r["hit_rate_gain"] for r in mine if r["truth_for"] == truth_for}
                ax.plot(sorted(gain), [gain[m] for m in sorted(gain)], style, color=f"C{i}", markersize=4,
                        label=f"batch {batch}, {fraction:.0%} cached, {truth_for}")
            for r in (r for r in mine if r["at_layer"] is None):
                ax.axhline(r["hit_rate_gain"], color=f"C{i}", linestyle=":", linewidth=1)
        ax.axhline(0.15, color="tab:green", linewidth=1, label="target +0.15")
        ax.plot([], [], ":", color="gray", label="shipped head, unaltered")
        ax.set_xlabel("layer whose routing brings the true routes (-1: start of the step)")
        ax.set_ylabel("hit rate - best baseline's")
        ax.set_title(f"late truth, {profile} profile", fontsize=10)
        ax.legend(fontsize=7)
    right = axes[len(profiles)]
    states = [r for r in rows if r.get("part") == "model states"]
    if states:
        names = [str(r["state"]) for r in states]
        right.plot(names, [r["probe_recall_one_ahead"] for r in states], "o-", label="probe: top-k recall of the "
                   "next token's routes")
        right.plot(names, [r["logit_lens_top1"] for r in states], "s--", label="logit lens: next token first")
        right.plot(names, [r["logit_lens_top5"] for r in states], "^--", label="logit lens: in top 5")
        right.axhline(states[0]["shipped_head_recall_one_ahead"], color="black", linestyle=":",
                      label="shipped head's recall")
        right.set_ylim(0, 1.02)
        right.legend(fontsize=8)
    right.set_xlabel("state entering layer (final: after the last layer)")
    right.set_title("what the model's own states tell of the next token (decode tokens)", fontsize=10)
    for ax in axes[panels:]:
        ax.set_visible(False)
    fig.savefig(path, dpi=120)


def _no_trace(text: str) -> None:
    """argparse type of the unlisted --trace: always refused, naming why."""
    raise argparse.ArgumentTypeError("the second part reads the built-in model's hidden states at the recorded "
                                     "tokens, so this benchmark records them itself; drop --trace")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_source_arguments(parser, trace=False)  # the held-out prompts are always recorded
    parser.add_argument("--trace", type=_no_trace, help=argparse.SUPPRESS)  # refused with the reason, not unknown
    parser.set_defaults(fractions="0.5")  # the configurations where the head limits the hit-rate gain
    add_plot_arguments(parser, "the gain by layer and the readings of the model's states")
    args = parse_or_redraw(parser, plot, BENCHMARK, PLOTTED)
    if args is None:
        return
    check_head(parser, args)
    trace, probs, timing = prepare(args, parser)
    if next_token_recall(trace, np.asarray(sim.prediction_pair(probs)[1])[:, 0])["tokens"] == 0:
        parser.error("the recording holds no decode token with a following token in its sequence, so there is no "
                     "recall to measure; record more new tokens per prompt (--max-new-tokens 2 or more)")
    rows = []
    for batch in args.batches:
        for fraction in args.fractions:
            rows += late_rows(trace, probs, batch, fraction, timing)
    from transformers import AutoTokenizer

    from expertflow.models import tiny_moe

    model = tiny_moe(dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model.name_or_path)
    rows += state_rows(model, tokenizer, trace, sim.prediction_pair(probs)[1], args.temperature)
    if args.plot:
        plot(rows, args.plot)
    summary = {}
    for label, batch, fraction, mine in by_profile(rows, args.batches, args.fractions, SHOWN):
        summary[label] = {
            "targets": targets(batch, fraction),
            "head_gain": next(r["hit_rate_gain"] for r in mine if r["at_layer"] is None),
            **{f"{truth_for}: gain_by_layer": {str(r["at_layer"]): r["hit_rate_gain"] for r in mine
                                               if r["truth_for"] == truth_for}
               for truth_for in ("next token", "all tokens")},
            "meeting_all": [f"{r['truth_for']} from layer {r['at_layer']}" for r in mine if r["all_targets_met"]]}
    states = [r for r in rows if r.get("part") == "model states"]
    summary["probe_recall_by_state"] = {str(r["state"]): r["probe_recall_one_ahead"] for r in states}
    summary["logit_lens_top1_by_state"] = {str(r["state"]): r["logit_lens_top1"] for r in states}
    summary["shipped_head_recall_one_ahead"] = states[0]["shipped_head_recall_one_ahead"] if states else None
    print(json.dumps({"benchmark": f"{BENCHMARK}_summary", "config": source_config(args, profiles=SHOWN),
                      "tokens": trace.num_tokens, "timing": timing_fields(timing), "summary": summary}))


if __name__ == "__main__":
    main()
