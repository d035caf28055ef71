"""The shipped tiny MoE and prompt sets: they load from the installed package, generate, and parse.

Quality and routing figures are measured by benchmarks/assets/eval_tiny_moe.py, not here.
"""

from __future__ import annotations

import pytest
import torch

from expertflow.models import TASKS, load_prompts, tiny_moe, tiny_moe_path


@pytest.fixture(scope="module")
def model():
    # One thread: the model is too small to gain from more, and on a busy machine extra threads wait on each other
    # (a 16-token generation takes ~0.1 s on one thread, over 1 s on two when the other core is busy).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield tiny_moe(dtype=torch.float32)
    torch.set_num_threads(threads)


def test_loads_in_fp32_from_its_directory(model):
    assert model.name_or_path == str(tiny_moe_path())
    assert next(model.parameters()).dtype == torch.float32
    assert model.config.num_local_experts == 32
    assert model.config.num_experts_per_tok == 4


def test_loads_in_fp32_and_eval_mode_by_default():
    """Without a dtype `tiny_moe()` is float32, though its weights are stored in bf16 (which from_pretrained would
    keep); the module fixture above asks for float32 explicitly."""
    model = tiny_moe()
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert not model.training


def test_tokenizer_loads_from_model_directory(model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model.name_or_path)
    ids = tokenizer("Translate English to Finnish: The boy was found.").input_ids
    assert ids[0] == tokenizer.bos_token_id == model.config.bos_token_id
    assert tokenizer.eos_token_id == model.config.eos_token_id
    assert max(ids) < model.config.vocab_size
    assert tokenizer.decode(ids, skip_special_tokens=True) == "Translate English to Finnish: The boy was found."
    # a decoder-only model: a batch pads on the left, so a shorter prompt continues as it does alone
    assert tokenizer.padding_side == "left"
    prompts = ["These", "Translate English to Finnish: The boy"]
    batch = model.generate(**tokenizer(prompts, return_tensors="pt", padding=True), max_new_tokens=6, do_sample=False)
    alone = model.generate(**tokenizer(prompts[:1], return_tensors="pt"), max_new_tokens=6, do_sample=False)
    assert batch[0, -6:].tolist() == alone[0, -6:].tolist()


def test_short_greedy_generation(model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model.name_or_path)
    inputs = tokenizer("ROMEO:\nWhat light", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    prompt_len = inputs.input_ids.shape[1]
    assert out.shape[1] > prompt_len
    assert torch.equal(out[0, :prompt_len], inputs.input_ids[0])


@pytest.mark.parametrize("task", TASKS)
def test_weights_are_trained_on_text(model, task):
    """Held-out prompts read far more likely in order than with their tokens shuffled (about 4 against 7-10 nats per
    token): the shipped weights are the trained ones, not a random or damaged file."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model.name_or_path)
    ids = tokenizer(load_prompts(task, "test")[0]["prompt"][:400], return_tensors="pt").input_ids
    order = torch.randperm(ids.shape[1] - 1, generator=torch.Generator().manual_seed(0)) + 1
    shuffled = torch.cat([ids[:, :1], ids[:, order]], dim=1)
    with torch.no_grad():
        loss, shuffled_loss = (model(input_ids=x, labels=x).loss.item() for x in (ids, shuffled))
    assert loss < 5.0 and loss < 0.7 * shuffled_loss, (loss, shuffled_loss)


def test_router_logits_per_layer(model):
    ids = torch.tensor([[1, 100, 200, 300, 400]])
    with torch.no_grad():
        out = model(input_ids=ids, output_router_logits=True)
    assert len(out.router_logits) == model.config.num_hidden_layers
    assert out.router_logits[0].shape == (5, model.config.num_local_experts)  # [T, E]


def test_prompt_sets_have_five_tasks_and_both_splits():
    rows = load_prompts()
    assert {r["task"] for r in rows} == set(TASKS)
    assert len({r["id"] for r in rows}) == len(rows)
    for task in TASKS:
        train, test = load_prompts(task, "train"), load_prompts(task, "test")
        assert train and test, task
        assert len(train) + len(test) == len(load_prompts(task))
        for row in train + test:
            assert row["task"] == task
            assert isinstance(row["prompt"], str) and row["prompt"].strip()


def test_load_prompts_rejects_unknown_names():
    with pytest.raises(ValueError, match="task="):
        load_prompts("poetry")
    with pytest.raises(ValueError, match="split="):
        load_prompts("chat", "validation")
