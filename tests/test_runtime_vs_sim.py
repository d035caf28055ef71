"""The live runtime and the simulator count the same hits and loads on the same routing (same semantics)."""

from __future__ import annotations

import pytest
import torch

from expertflow import sim
from expertflow import models
from expertflow.recorder import record
from families import record_wrapped

PROMPTS = ["The quick brown fox", "def add(a, b):\n    return", "Translate English to Finnish: good morning"]


@pytest.fixture(scope="module")
def tiny():
    model = models.tiny_moe(dtype=torch.float32)
    from transformers import AutoTokenizer

    return model.eval(), AutoTokenizer.from_pretrained(model.name_or_path)


@pytest.mark.parametrize("policy, slots", [("lru", 48), ("lru", 7), ("lru-layer", 60), ("lfu", 30)])
def test_live_demand_policy_equals_simulator(tiny, policy, slots):
    model, tokenizer = tiny
    trace, live = record_wrapped(model, PROMPTS, tokenizer, dict(cache_slots=slots, policy=policy, device="cpu"),
                                 batch_size=1, max_new_tokens=8)
    simulated = sim.simulate(trace, policy, slots)
    assert (live.needs, live.hits, live.loads, live.waves) == (simulated.needs, simulated.hits, simulated.loads,
                                                               simulated.waves)
    assert live.needs > 100
    assert live.waves > 0 or slots > 7  # 7 slots: every prefill request is split


def test_a_batch_counts_alike_without_padding_and_counts_padding_live(tiny):
    """At batch > 1 the counts agree when no row is padding; with prompts of different lengths the model computes
    the padding rows, which the live counters see and a recorded trace (real tokens only) does not."""
    model, tokenizer = tiny
    same_length = ["The quick brown fox", "The quick brown cat", "A quick brown fox"]
    assert len({len(tokenizer(p)["input_ids"]) for p in same_length}) == 1
    for prompts, padded in ((same_length, False), (PROMPTS, True)):
        trace, live = record_wrapped(model, prompts, tokenizer, dict(cache_slots=48, policy="lru", device="cpu"),
                                     batch_size=3, max_new_tokens=6)
        simulated = sim.simulate(trace, "lru", 48)
        if padded:
            assert live.needs > simulated.needs
        else:
            assert (live.needs, live.hits, live.loads) == (simulated.needs, simulated.hits, simulated.loads)


@pytest.mark.parametrize("policy", ["lookahead", "prev-step"])
def test_live_prefetch_policy_matches_simulator_needs(tiny, policy):
    model, tokenizer = tiny
    trace, live = record_wrapped(model, PROMPTS[:2], tokenizer, dict(cache_slots=64, policy=policy, device="cpu"),
                                 batch_size=1, max_new_tokens=6)
    simulated = sim.simulate(trace, policy, 64)
    # Live prefetches complete asynchronously, so a prefetched expert may still be in flight when needed (a miss
    # in the live run, a hit in counting mode): hits can only be lower live; the requests are the same.
    assert live.needs == simulated.needs
    assert live.hits <= simulated.hits
    assert live.prefetches > 0


def test_recording_can_sample_reproducibly(tiny):
    import numpy as np

    model, tokenizer = tiny
    greedy = record(model, PROMPTS, tokenizer, batch_size=3, max_new_tokens=8, progress=False)
    first, again = (record(model, PROMPTS, tokenizer, batch_size=3, max_new_tokens=8, progress=False,
                           temperature=1.5, seed=3) for _ in range(2))
    np.testing.assert_array_equal(first.token_ids, again.token_ids)  # same seed, same tokens
    assert "sampled temperature=1.5" in first.source and "sampled" not in greedy.source
    assert not np.array_equal(first.token_ids, greedy.token_ids)  # temperature 1.5 strays from greedy
    with pytest.raises(ValueError, match="temperature"):
        record(model, PROMPTS, tokenizer, temperature=0.0, progress=False)


def test_sampling_settings_may_be_numpy_numbers_and_a_top_p_that_is_not_one_is_named():
    import numpy as np

    from expertflow.recorder import check_sampling

    check_sampling(np.float32(0.7), np.float64(0.9), np.int64(3))  # record() took them before the checks
    with pytest.raises(ValueError, match=r"top_p='0\.9' must be in \(0, 1\]"):
        check_sampling(1.0, "0.9", 0)


@pytest.mark.parametrize("settings, message", [
    (dict(temperature=1e-40), r"temperature=1e-40 must be a finite number of at least 1e-06"),
    (dict(temperature=float("inf")), r"temperature=inf must be a finite number"),
    (dict(temperature=1.0, seed=1.5), r"seed=1.5 must be an integer"),  # sampled as seed 1, recorded as 1.5
    (dict(temperature=1.0, seed=-1), r"seed=-1 must be in \[0, 2\*\*64\)"),
    (dict(top_p=0.5), r"top_p=0.5 applies to sampling: give a temperature too"),
    (dict(seed=2), r"seed=2 applies to sampling"),
])
def test_recording_refuses_sampling_settings_that_would_fail_or_record_another_seed(tiny, settings, message):
    model, tokenizer = tiny
    with pytest.raises(ValueError, match=message):
        record(model, PROMPTS, tokenizer, progress=False, **settings)


def test_recording_ends_a_sequence_on_any_stop_id_and_gives_back_the_callers_settings(tiny):
    """generate stops a row on any id of the generation config's eos_token_id (a list for several families): no
    token after it is recorded. The tokenizer's padding side and pad token and torch's generator are left as found."""
    model, tokenizer = tiny
    prompts = ["Translate German to English: \u201e Das ver\u00e4ndert die Zukunft meiner Familie \u201c , meinte der "
               "Mann .", "Compose an engaging travel blog post about a recent trip to Hawaii.", "The quick brown fox"]
    eos = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = [eos, 16]  # "." ends the first prompt's translation early
    side, pad = tokenizer.padding_side, tokenizer.pad_token
    tokenizer.padding_side = "right"
    torch.manual_seed(5)
    before = torch.random.get_rng_state()
    try:
        trace = record(model, prompts, tokenizer, batch_size=3, max_new_tokens=16, progress=False)
        sampled = record(model, prompts[:1], tokenizer, batch_size=1, max_new_tokens=2, progress=False,
                         temperature=1.0)
        assert (tokenizer.padding_side, tokenizer.pad_token) == ("right", pad)
    finally:
        model.generation_config.eos_token_id, tokenizer.padding_side = eos, side
    ended = 0
    for seq in range(len(prompts)):
        decoded = trace.token_ids[(trace.seq_ids == seq) & (trace.phase == 1)].tolist()
        stops = [i for i, token in enumerate(decoded) if token in (eos, 16)]
        assert stops in ([], [len(decoded) - 1]), (seq, decoded)  # a stop id can only be the last token fed
        ended += bool(stops)
    assert ended >= 1 and sampled.num_tokens > 0
    assert torch.equal(torch.random.get_rng_state(), before)
    for kwargs, message in (({"prompts": []}, "no prompts to record"),
                            ({"prompts": prompts, "batch_size": 0}, "batch_size=0 must be a positive integer"),
                            ({"prompts": prompts, "max_new_tokens": 2.5}, "max_new_tokens=2.5 must be a positive"),
                            ({"prompts": prompts, "max_new_tokens": True}, "max_new_tokens=True must be a positive"),
                            ({"prompts": prompts, "max_prompt_tokens": 0}, "max_prompt_tokens=0 must be a positive"),
                            ({"prompts": prompts, "max_prompt_tokens": -1}, "max_prompt_tokens=-1 must be a pos")):
        with pytest.raises(ValueError, match=message):
            record(model, tokenizer=tokenizer, progress=False, **kwargs)


def test_a_generate_that_makes_more_forwards_than_new_tokens_is_refused_by_name():
    """Forwards are mapped to tokens one per new token (the last is never fed): one more (a generate that calls the
    model again within a step) is refused, where it read past the generated ids or recorded a token never fed."""
    from expertflow.recorder import _assemble

    ids, mask = torch.tensor([[3, 4]]), torch.ones(1, 2, dtype=torch.long)
    out = torch.tensor([[3, 4, 5, 6]])  # two new tokens: two forwards (the prompt, then token 5)
    step = lambda rows: (torch.zeros(rows, 2, dtype=torch.int32), torch.zeros(rows, 2))  # noqa: E731
    part = _assemble({0: step(2), 1: step(1)}, ids, mask, out, frozenset(), seq_offset=0, step_offset=0)
    assert part["token_ids"].tolist() == [3, 4, 5]
    with pytest.raises(ValueError, match="generate made 3 forwards for 2 new tokens per sequence"):
        _assemble({0: step(2), 1: step(1), 2: step(1)}, ids, mask, out, frozenset(), seq_offset=0, step_offset=0)


def test_live_cache_promotes_every_needed_prefetch_when_the_request_starts():
    """As in the simulator: a request that needs two queued prefetches raises both to high priority before waiting
    for the first, so the copy thread cannot start an unneeded prefetch between them."""
    from expertflow.cache import ExpertCache
    from expertflow.counters import Stats
    from expertflow.policy import make_policy
    from expertflow.store import ExpertLayout, ExpertStore
    from expertflow.transfer import LOW, CpuTransferEngine, Gate

    class Recording(CpuTransferEngine):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[tuple[str, object]] = []

        def promote(self, ticket):
            self.calls.append(("promote", ticket.tag))
            super().promote(ticket)

        def wait(self, ticket):
            self.calls.append(("wait", ticket.tag))
            return super().wait(ticket)

    layout = ExpertLayout.from_tensors([("w", (8,), torch.uint8)])
    store = ExpertStore(layout.nbytes)
    for _ in range(2):
        store.add_layer(layout, [{"w": torch.full((8,), e, dtype=torch.uint8)} for e in range(4)])
    engine = Recording()
    try:
        cache = ExpertCache(store, 8, make_policy("lru", 8, 2, 4), torch.device("cpu"), engine, Stats())
        gate = Gate()  # a held copy at the head of the prefetch queue keeps the prefetches behind it queued
        engine.submit(torch.zeros(8, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8), LOW, gate=gate)
        assert cache.prefetch([(1, 1), (1, 2)]) == 2
        waves = list(cache.request(0, 1, [1, 2]))
        engine.open_gate(gate)
    finally:
        engine.close()
    needed = [call for call in engine.calls if call[1] in {(1, 1), (1, 2)}]
    assert needed[:2] == [("promote", (1, 1)), ("promote", (1, 2))], needed
    assert [e for wave in waves for e, _ in wave] == [1, 2]
