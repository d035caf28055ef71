"""Build the shipped prompt sets from the shared text data, and read that data as training documents.

Owns: the readers for every file under ``shared/data/text``, the stable document ids, the train/test split rule
(``split_of``), the seeded choice of which records become prompts, and the JSONL files in
``expertflow/assets/prompts/``. ``train_tiny_moe.py`` imports ``training_documents`` and ``split_of`` from here so
that a prompt in the test split is also held out of the tiny model's training text.

Does not know about tokenizers or models. Only sources whose licence allows redistribution feed the prompt files
(see the repository's NOTICE); the training documents may also use the others, since only our weights are shipped.

Usage: python benchmarks/assets/build_prompts.py [--data ../shared/data/text] [--out expertflow/assets/prompts]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
DEFAULT_DATA = REPO.parent / "shared" / "data" / "text"
DEFAULT_OUT = REPO / "expertflow" / "assets" / "prompts"
TASKS = ("chat", "translation", "summarization", "math", "code")
SEED = 0
TEST_MODULUS = 5  # a record is "test" when sha256(id) mod 5 == 0, i.e. about 20 %


@dataclass(frozen=True)
class Record:
    """One source example: ``prompt`` is what a user would send, ``answer`` the reference text if there is one."""

    id: str
    task: str
    prompt: str
    answer: str = ""


def split_of(record_id: str) -> str:
    """Return "test" or "train" for a record id; stable across runs, machines and Python versions."""
    digest = hashlib.sha256(record_id.encode("utf-8")).digest()
    return "test" if int.from_bytes(digest[:8], "big") % TEST_MODULUS == 0 else "train"


def _jsonl(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


def _turn_text(turn: str | dict) -> str:
    return turn["content"] if isinstance(turn, dict) else turn


# ---- readers: one per source, each yields Records with ids of the form "<source>-<key>" ----


def arena_hard(data: Path) -> Iterator[Record]:
    for row in _jsonl(data / "chat" / "arena_hard_v0.1_question.jsonl"):
        yield Record(f"arena-hard-{row['question_id']}", "chat", _turn_text(row["turns"][0]))


def fastchat_bench(data: Path, name: str) -> Iterator[Record]:
    """``name`` is "mt_bench" or "vicuna_bench"; the prompt is the first turn, later turns become the answer."""
    for row in _jsonl(data / "chat" / f"{name}_question.jsonl"):
        turns = [_turn_text(t) for t in row["turns"]]
        yield Record(f"{name.replace('_', '-')}-{row['question_id']}", "chat", turns[0], "\n\n".join(turns[1:]))


def spec_bench(data: Path, categories: tuple[str, ...] | None = None) -> Iterator[Record]:
    task_of = {"translation": "translation", "summarization": "summarization", "math_reasoning": "math"}
    for row in _jsonl(data / "mixed" / "spec_bench_question.jsonl"):
        if categories is not None and row["category"] not in categories:
            continue
        references = [r if isinstance(r, str) else ", ".join(map(str, r)) for r in row.get("reference") or []]
        reference = "\n\n".join(r for r in references if r)
        task = task_of.get(row["category"], "chat")
        yield Record(f"spec-bench-{row['question_id']}", task, row["turns"][0], reference)


_LANGUAGE = {"en": "English", "fi": "Finnish", "de": "German", "ro": "Romanian"}


def newstest(data: Path, pair: str, src: str, tgt: str) -> Iterator[Record]:
    """Line-aligned WMT16 newstest; ``pair`` is the file prefix (e.g. "en-fi"), ``src``/``tgt`` the direction."""
    sources = _lines(data / "translation" / f"{pair}_newstest2016.{src}")
    targets = _lines(data / "translation" / f"{pair}_newstest2016.{tgt}")
    assert len(sources) == len(targets), f"{pair}: {len(sources)} vs {len(targets)} lines"
    instruction = f"Translate {_LANGUAGE[src]} to {_LANGUAGE[tgt]}: "
    for i, (s, t) in enumerate(zip(sources, targets)):
        if s.strip():
            yield Record(f"newstest2016-{src}{tgt}-{i:04d}", "translation", instruction + s.strip(), t.strip())


def xsum(data: Path) -> Iterator[Record]:
    for i, row in enumerate(_jsonl(data / "summarization" / "xsum_0shot_h2o.jsonl")):
        yield Record(f"xsum-{i:04d}", "summarization", row["article"].strip(), row["summary_gt"].strip())


def gsm8k(data: Path) -> Iterator[Record]:
    for i, row in enumerate(_jsonl(data / "math" / "gsm8k_test.jsonl")):
        yield Record(f"gsm8k-{i:04d}", "math", row["question"], row["answer"])


def qwen_math(data: Path, name: str) -> Iterator[Record]:
    """``name`` is "aime24" or "amc23"; the answer is the worked solution where given, else the final answer."""
    for row in _jsonl(data / "math" / f"{name}_test.jsonl"):
        answer = row.get("solution") or str(row["answer"])
        yield Record(f"{name}-{row['id']}", "math", row["problem"], answer)


def humaneval(data: Path) -> Iterator[Record]:
    for row in _jsonl(data / "code" / "HumanEval.jsonl"):
        number = row["task_id"].split("/")[-1]
        yield Record(f"humaneval-{int(number):03d}", "code", row["prompt"], row["canonical_solution"])


def tinyshakespeare(data: Path) -> Iterator[Record]:
    """The corpus cut at blank lines (one speech per record); no prompt task, so ``task`` is "text"."""
    text = (data / "corpus" / "tinyshakespeare_input.txt").read_text(encoding="utf-8")
    for i, block in enumerate(b for b in text.split("\n\n") if b.strip()):
        yield Record(f"tinyshakespeare-{i:05d}", "text", block.strip())


# ---- prompt sets: which sources feed which task, and how many records each contributes ----

# (reader, how many to take: None = all). Only redistributable sources appear here.
PROMPT_SOURCES = {
    "chat": [
        (lambda d: fastchat_bench(d, "mt_bench"), None),
        (lambda d: fastchat_bench(d, "vicuna_bench"), None),
        (arena_hard, 140),
    ],
    "translation": [
        (lambda d: spec_bench(d, ("translation",)), None),
        (lambda d: newstest(d, "en-fi", "en", "fi"), 220),
    ],
    "summarization": [(lambda d: spec_bench(d, ("summarization",)), None)],
    "math": [
        (lambda d: qwen_math(d, "aime24"), None),
        (lambda d: qwen_math(d, "amc23"), None),
        (gsm8k, 230),
    ],
    "code": [(humaneval, None)],
}


def select_prompts(data: Path, task: str, seed: int = SEED) -> list[Record]:
    """The records of one task: all of a small source, a seeded sample (kept in source order) of a large one."""
    chosen: list[Record] = []
    for reader, limit in PROMPT_SOURCES[task]:
        records = list(reader(data))
        if limit is not None and limit < len(records):
            rng = random.Random(f"{seed}-{records[0].id}")
            keep = set(rng.sample(range(len(records)), limit))
            records = [r for i, r in enumerate(records) if i in keep]
        chosen.extend(r for r in records if r.prompt.strip())
    return chosen


def write_prompt_sets(data: Path, out: Path, seed: int = SEED) -> dict[str, dict[str, int]]:
    """Write ``<task>.jsonl`` for every task; return counts per task and split."""
    out.mkdir(parents=True, exist_ok=True)
    counts: dict[str, dict[str, int]] = {}
    for task in TASKS:
        records = select_prompts(data, task, seed)
        counts[task] = {"train": 0, "test": 0}
        with (out / f"{task}.jsonl").open("w", encoding="utf-8") as f:
            for r in records:
                split = split_of(r.id)
                counts[task][split] += 1
                row = {"id": r.id, "task": task, "prompt": r.prompt, "split": split}
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return counts


# ---- training documents: every source, formatted as prompt followed by answer ----


def all_records(data: Path) -> Iterator[Record]:
    """Every record of every source; earlier sources win when the same prompt text appears twice."""
    readers = [
        tinyshakespeare,
        lambda d: fastchat_bench(d, "mt_bench"),
        lambda d: fastchat_bench(d, "vicuna_bench"),
        arena_hard,
        gsm8k,
        lambda d: qwen_math(d, "aime24"),
        lambda d: qwen_math(d, "amc23"),
        humaneval,
        lambda d: newstest(d, "en-fi", "en", "fi"),
        lambda d: newstest(d, "de-en", "de", "en"),
        lambda d: newstest(d, "en-ro", "en", "ro"),
        xsum,
        spec_bench,  # repeats mt_bench and some gsm8k questions; the duplicates are dropped below
    ]
    seen: set[str] = set()
    for reader in readers:
        for record in reader(data):
            key = " ".join(record.prompt.split())
            if key in seen:
                continue
            seen.add(key)
            yield record


def training_documents(data: Path, split: str) -> Iterator[tuple[str, str]]:
    """(id, text) for every record in ``split``; text is the prompt, a newline, then the answer if any."""
    for record in all_records(data):
        if split_of(record.id) != split:
            continue
        if record.task == "code":
            text = record.prompt + record.answer  # the solution continues the function body
        else:
            text = record.prompt + ("\n" + record.answer if record.answer else "")
        yield record.id, text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="the shared/data/text folder")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args()
    if not args.data.is_dir():
        raise SystemExit(f"--data {args.data} is not a folder; point it at shared/data/text")
    counts = write_prompt_sets(args.data, args.out, args.seed)
    print(json.dumps({"out": str(args.out), "counts": counts}))


if __name__ == "__main__":
    main()
