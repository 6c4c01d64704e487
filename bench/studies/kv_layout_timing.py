"""Per-round time of one batched verify pass, packed KV against slot KV (cloud/engine/kv_slots.py).

    python -m bench.studies.kv_layout_timing --model tiny|small|MODEL_DIR [--sessions 1,4,8,16]
        [--contexts 1024,4096] [--block 5] [--rounds 20] [--slot-tokens N] [--device auto]
        [--dtype float32] [--output kv_layout.json]

Every session holds `context` positions of KV; a round feeds each a block of `block` tokens
(k drafts + 1) in one pass, then crops it back (a round whose drafts were all rejected), so
every round sees the same context. Packed concatenates all caches and copies the new KV back
each pass; slots write only the new KV and attend over each slot's filled positions in place
(cloud/engine/kv_slots.py). `--slot-tokens` (the verifier's --kv-slot-tokens; default context +
block) sets slots longer than the contexts in them, as a verifier sized for long sessions has.
The KV is one real prefill copied to every session:
the values do not change the time. `small` is a random Llama of about 0.1B parameters; a
model folder runs a real model (on a quiet machine or a GPU: the numbers are timings).
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict
from transformers import DynamicCache, PreTrainedModel

from bench.cli import settings_parser
from bench.tiny_models import random_llama, tiny_target
from cloud.engine.kv_slots import SlotKV, SlotPool, forward_slots
from cloud.engine.transformers import KVCache, crop, forward_packed
from shared import lm
from shared.cli import run_cli, settings_from_args

log = logging.getLogger("kv-layout-timing")


def small_model(dtype: torch.dtype, device: torch.device) -> PreTrainedModel:
    """A random Llama with a Qwen-like KV shape (2 KV heads of 64) and about 0.1B parameters."""
    model = random_llama(0, vocab=32000, hidden=768, mlp=2048, layers=12, heads=12, kv_heads=2, positions=32768)
    return model.to(dtype=dtype, device=device)  # type: ignore[call-arg]  # transformers stub types .to oddly


def _model(name: str, dtype: torch.dtype, device: torch.device) -> PreTrainedModel:
    if name == "tiny":
        return tiny_target().to(dtype=dtype, device=device)  # type: ignore[call-arg]  # transformers stub types .to oddly
    if name == "small":
        return small_model(dtype, device)
    return lm.load_model(name, str(dtype).removeprefix("torch."), str(device))


def _prompt(model: PreTrainedModel, length: int) -> list[int]:
    vocab = lm.logits_width(model)
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(length)).tolist()


def packed_sessions(model: PreTrainedModel, sessions: int, context: int) -> list[DynamicCache]:
    first = lm.new_cache(model)
    lm.forward(model, first, _prompt(model, context), keep=1)
    return [first] + [copy.deepcopy(first) for _ in range(sessions - 1)]


@torch.inference_mode()
def slot_sessions(model: PreTrainedModel, sessions: int, context: int, slot_tokens: int) -> list[SlotKV]:
    pool = SlotPool(model, sessions, slot_tokens)
    kvs = [pool.acquire() for _ in range(sessions)]
    forward_slots(model, kvs[:1], [_prompt(model, context)], [1])
    for kv in kvs[1:]:
        for layer in (*pool.keys, *pool.values):  # the first slot's KV, copied: only the time matters
            layer[:, :, kv.base : kv.base + context] = layer[:, :, :context]
        kv.length = context
    return kvs


LAYOUTS = ("packed", "slots", "slots-packed")  # slots-packed: slots fed in one packed row, over the gaps


def time_rounds(model: PreTrainedModel, caches: Sequence[KVCache], block: int, rounds: int, layout: str) -> list[float]:
    """ms per pass: every session feeds `block` tokens, then is cropped back to where it was."""
    lengths = [c.get_seq_length() for c in caches]
    blocks = [_prompt(model, block)] * len(caches)
    keeps = [block] * len(caches)
    times = []
    for _ in range(rounds + 1):  # the first pass warms up (allocator, kernels) and is dropped
        start = time.perf_counter()
        if layout == "slots-packed":
            forward_slots(model, [c for c in caches if isinstance(c, SlotKV)], blocks, keeps, shape="packed")
        else:
            forward_packed(model, caches, blocks, keeps)  # logits come to the CPU: the pass is done
        for cache, length in zip(caches, lengths, strict=True):
            crop(cache, length)
        times.append((time.perf_counter() - start) * 1000.0)
    return times[1:]


def measure(
    model: PreTrainedModel, layout: str, sessions: int, context: int, block: int, rounds: int, slot_tokens: int = 0
) -> dict[str, Any]:
    slot_tokens = max(slot_tokens, context + block)
    caches: Sequence[KVCache] = (
        packed_sessions(model, sessions, context) if layout == "packed" else slot_sessions(model, sessions, context, slot_tokens)
    )
    times = time_rounds(model, caches, block, rounds, layout)
    return {
        "layout": layout,
        "sessions": sessions,
        "context": context,
        "block": block,
        "rounds": rounds,
        "slot_tokens": slot_tokens if layout != "packed" else None,
        "ms_p50": round(statistics.median(times), 3),
        "ms_min": round(min(times), 3),
        "ms_p90": round(sorted(times)[int(0.9 * (len(times) - 1))], 3),
    }


def markdown(rows: list[dict[str, Any]]) -> str:
    layouts = [layout for layout in LAYOUTS if any(r["layout"] == layout for r in rows)]
    lines = [
        "| sessions | context | " + " | ".join(f"{layout} ms p50" for layout in layouts) + " | packed / slots |",
        "|---|---|" + "---|" * (len(layouts) + 1),
    ]
    ms = {(r["sessions"], r["context"], r["layout"]): r["ms_p50"] for r in rows}
    for sessions, context in sorted({(r["sessions"], r["context"]) for r in rows}):
        cells = [str(ms.get((sessions, context, layout), "–")) for layout in layouts]
        packed, slots = ms.get((sessions, context, "packed")), ms.get((sessions, context, "slots"))
        ratio = f"{packed / slots:.2f}" if packed and slots else "–"
        lines.append(f"| {sessions} | {context} | " + " | ".join(cells) + f" | {ratio} |")
    return "\n".join(lines) + "\n"


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


class KvLayoutSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECDEC_KV_LAYOUT_")

    model: str = Field("tiny", description="tiny, small (random) or a local model folder")
    device: str = Field("auto", description="auto | cpu | cuda")
    dtype: str = Field("float32", description="float32 | bfloat16 | float16")
    sessions: str = Field("1,4,8,16", pattern=r"^\d+(,\d+)*$", description="sessions per batched pass, comma-separated")
    contexts: str = Field("1024,4096", pattern=r"^\d+(,\d+)*$", description="KV positions per session, comma-separated")
    block: int = Field(5, ge=1, description="tokens fed per session per round (k + 1)")
    rounds: int = Field(20, ge=1, description="timed rounds per row")
    slot_tokens: int = Field(0, ge=0, description="slots: positions per slot (0: context + block)")
    layouts: str = Field(",".join(LAYOUTS), description="packed, slots (as the verifier feeds them), slots-packed (one row)")
    output: str = Field("kv_layout.json", description="JSON file for the rows and the table")

    help_groups: ClassVar[dict[str, tuple[str, ...]]] = {
        "the model": ("model", "device", "dtype"),
        "the measurement": ("sessions", "contexts", "block", "rounds", "slot_tokens", "layouts"),
        "output": ("output",),
    }


def parser() -> argparse.ArgumentParser:
    return settings_parser("python -m bench.studies.kv_layout_timing", __doc__, KvLayoutSettings)


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    return run_cli("python -m bench.studies.kv_layout_timing", lambda: timing(settings_from_args(KvLayoutSettings, args)))


def timing(args: KvLayoutSettings) -> int:
    device, dtype = lm.resolve_device(args.device), lm.resolve_dtype(args.dtype)
    model = _model(args.model, dtype, device)
    rows = []
    for context in _ints(args.contexts):
        for sessions in _ints(args.sessions):
            for layout in args.layouts.split(","):
                rows.append(measure(model, layout, sessions, context, args.block, args.rounds, args.slot_tokens))
                log.info("%s", rows[-1])
    table = markdown(rows)
    Path(args.output).write_text(
        json.dumps({"model": args.model, "device": str(device), "dtype": args.dtype, "rows": rows, "table": table}, indent=1)
        + "\n"
    )
    sys.stdout.write(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
