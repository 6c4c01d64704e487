"""Check the edge's tokenizer against transformers' AutoTokenizer on a model folder and a
prompt file: prompt ids with and without the chat template, and decoded text.

    python tools/check_tokenizer.py MODEL_FOLDER PROMPTS.jsonl

Prints one JSON line with the counts; exits 1 on any difference."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from transformers import AutoTokenizer

from edge.prompts import encode_prompt, read_prompts
from edge.tokenizer import EdgeTokenizer


def main(folder: str, prompts_file: str) -> int:
    ours, theirs = EdgeTokenizer(folder), AutoTokenizer.from_pretrained(folder)
    prompts = read_prompts(Path(prompts_file))
    counts = {"prompts": len(prompts), "chat_ids_equal": 0, "plain_ids_equal": 0, "decoded_equal": 0, "tokens": 0}
    for prompt in prompts:
        rendered = theirs.apply_chat_template(
            [{"role": "user", "content": prompt.text}], tokenize=False, add_generation_prompt=True
        )
        want = theirs(rendered, add_special_tokens=False).input_ids
        got = encode_prompt(ours, prompt.text, chat=True)
        counts["chat_ids_equal"] += got == want
        counts["plain_ids_equal"] += encode_prompt(ours, prompt.text, chat=False) == theirs(prompt.text).input_ids
        counts["decoded_equal"] += ours.decode(got, skip_special_tokens=True) == theirs.decode(want, skip_special_tokens=True)
        counts["tokens"] += len(want)
    sys.stdout.write(json.dumps({**counts, "stop_ids": sorted(ours.stop_token_ids)}) + "\n")
    equal = [counts[key] for key in ("chat_ids_equal", "plain_ids_equal", "decoded_equal")]
    return 0 if all(n == len(prompts) for n in equal) else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
