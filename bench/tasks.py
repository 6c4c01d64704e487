"""Spec-Bench prompts: the 13 category labels grouped into Spec-Bench's six tasks, and a
deterministic per-task selection; random prompts, and how the studies' sessions sample."""

from __future__ import annotations

import json
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

import numpy as np

from edge.prompts import Prompt
from shared.protocol import AcceptMode, SamplingParams, SessionConfig

# The eight MT-bench labels form Spec-Bench's multi-turn conversation task; the other five
# labels are tasks of their own (bench/data/README.md).
MT_BENCH_LABELS = frozenset({"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"})
TASKS = ("multi-turn conversation", "translation", "summarization", "qa", "math_reasoning", "rag")
OTHER_TASK = "other"  # a user prompt file's label that is none of Spec-Bench's


def spec_bench_path() -> Path:
    return Path(str(resources.files("bench") / "data" / "spec_bench" / "question.jsonl"))


def task_of(category: str) -> str:
    if category in MT_BENCH_LABELS:
        return "multi-turn conversation"
    return category if category in TASKS else OTHER_TASK


def select_per_task(prompts: Sequence[Prompt], per_task: int) -> list[Prompt]:
    """`per_task` prompts of each task, in task order: the shortest (by characters; ties by
    file order), taken round-robin over the task's labels in the order they first appear, so
    multi-turn conversation gets writing, roleplay, reasoning, ... rather than three math
    questions. Short prompts keep the CPU prefill of a run bounded (a 650-token RAG prompt
    costs ~100 s in bf16 on 2 cores) while every task is still represented."""
    chosen: list[Prompt] = []
    for task in (*TASKS, OTHER_TASK):
        by_label: dict[str, list[tuple[int, int, Prompt]]] = {}
        for index, prompt in enumerate(prompts):
            if task_of(prompt.category) == task:
                by_label.setdefault(prompt.category, []).append((len(prompt.text), index, prompt))
        queues = [sorted(members, key=lambda m: (m[0], m[1])) for members in by_label.values()]
        picked: list[Prompt] = []
        depth = 0
        while len(picked) < per_task and any(depth < len(q) for q in queues):
            picked += [q[depth][2] for q in queues if depth < len(q)][: per_task - len(picked)]
            depth += 1
        chosen += picked
    return chosen


def write_prompts(prompts: Sequence[Prompt], path: Path) -> None:
    """The {"id", "prompt", "category"} JSONL that edge-agent and the in-process runner read."""
    lines = (json.dumps({"id": p.id, "prompt": p.text, "category": p.category}) for p in prompts)
    path.write_text("".join(line + "\n" for line in lines))


def random_token_ids(rng: np.random.Generator, vocab: int, size: int) -> list[int]:
    """`size` random ids of a `vocab`-wide vocabulary for the studies' prompts and drafts: past
    the special tokens a real vocabulary starts with, within its first 30,000 ids."""
    return rng.integers(min(100, vocab // 2), min(vocab, 30_000), size=size).tolist()  # type: ignore[no-any-return]


def session_config(vocab: int, temperature: float, top_p: float) -> SessionConfig:
    """A session sampling as an edge-agent at that temperature and top-p opens it: greedy at
    temperature 0, else the sparse mode (the edge's default)."""
    mode = AcceptMode.SPARSE if temperature > 0 else AcceptMode.GREEDY
    return SessionConfig(SamplingParams(temperature, top_p=top_p), accept_mode=mode, vocab_size=vocab)


def sampling_label(temperature: float, top_p: float) -> str:
    """How a report names a run's sampling."""
    return f"temperature {temperature}, top-p {top_p}" if temperature > 0 else "greedy"
