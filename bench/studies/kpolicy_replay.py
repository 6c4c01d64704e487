"""k policies played on real acceptance, without the machine's noise. A study of the edge's k
policies (edge/drafting/kpolicy.py).

In greedy mode a round of k drafts starting at output position p accepts min(k, L(p)), where
L(p) is how many tokens from p on the draft model's own greedy choice matches the target's
output. One teacher-forced pass of the draft over each prompt and the target's output (read
from a `python -m bench` run's outputs) gives L at every position. Each policy is then played
over the same outputs, in the same prompt order, with a configuration's round costs (draft ms
per token, the verify pass's fixed and per-row ms, the network), and fed its rounds as the round
loop feeds it. Rates are expected tokens per second of the decode (after the first token); the
costs are fixed, so two policies differ only in the k they chose.

    python -m bench.studies.kpolicy_replay --run-files results/bench_files --outputs k4.unpinned.rtt0.jsonl \\
        --config "loopback=20,140,3,3" --config "rtt100=20,140,3,104" [--out docs/kpolicy_replay]

A --config is NAME=DRAFT_MS_PER_TOKEN,VERIFY_FIXED_MS,VERIFY_MS_PER_ROW,NETWORK_MS[,DRAFT_FIXED_MS]
(the figures a run's round log gives; `python -m bench` reports them per system; drafting's fixed
part per round, 0 if left out, from the drafting time of rounds of different k).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from bench.cli import settings_parser, study_settings
from bench.environment import provenance, write_result
from edge.drafting.feedback import RoundFeedback
from edge.drafting.kpolicy import CostK, FixedK, KPolicy
from edge.drafting.round_costs import RoundCosts
from shared.cli import run_cli
from shared.errors import ConfigError

FIXED_KS = (2, 3, 4, 5, 6, 8)


class ReplaySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECDEC_KPOLICY_REPLAY_")

    run_files: Path = Field(description="a `python -m bench` run's files folder (prompts.jsonl and the outputs)")
    outputs: str = Field(description="the outputs file in it whose tokens are the target's (any greedy system's)")
    draft_gguf: Path | None = Field(None, description="the draft's GGUF (default: the packaged Qwen 0.5B)")
    draft_window: int = Field(512, ge=1, description="prompt tokens the draft reads, as edge-agent's --draft-window")
    config: list[str] = Field(
        description="NAME=DRAFT_MS,VERIFY_FIXED_MS,VERIFY_MS_PER_ROW,NETWORK_MS[,DRAFT_FIXED_MS] (repeatable)"
    )
    out: Path = Field(Path("docs/kpolicy_replay"), description="folder for the JSON result and report.md")

    help_groups: ClassVar[dict[str, tuple[str, ...]]] = {
        "the run replayed": ("run_files", "outputs", "draft_gguf", "draft_window"),
        "the costs": ("config",),
        "results": ("out",),
    }


@dataclass(frozen=True)
class RoundCost:
    draft_ms: float  # per token
    verify_fixed_ms: float
    verify_per_row_ms: float
    net_ms: float
    draft_fixed_ms: float = 0.0  # per round that drafts: taking in the tokens the cloud committed

    def verify_ms(self, k: int) -> float:
        return self.verify_fixed_ms + self.verify_per_row_ms * (k + 1)

    def drafting_ms(self, k: int) -> float:
        return self.draft_fixed_ms + k * self.draft_ms if k > 0 else 0.0


def match_runs(draft_choices: Sequence[int], output: Sequence[int]) -> list[int]:
    """L(p): how many tokens from p on the draft's greedy choice (given the target's prefix)
    equals the target's token."""
    runs = [0] * (len(output) + 1)
    for p in range(len(output) - 1, -1, -1):
        runs[p] = runs[p + 1] + 1 if draft_choices[p] == output[p] else 0
    return runs[: len(output)]


@dataclass
class ReplayClock:
    """The seconds the replayed rounds took, for a RoundCosts that forgets by time."""

    seconds: float = 0.0

    def __call__(self) -> float:
        return self.seconds


@dataclass
class Played:
    ks: list[list[int]] = field(default_factory=list)  # per generation, the k of each round
    ms: float = 0.0
    tokens: int = 0


def replay(
    policy_for: Callable[[], KPolicy],
    outputs: Sequence[Sequence[int]],
    cost_at: Callable[[int], RoundCost],
    clock: ReplayClock | None = None,
    max_rounds: int | None = None,
) -> Played:
    """Each output in turn as one generation (`policy_for` is called per generation, as
    edge-agent does), the n-th round of the whole replay at `cost_at(n)`'s costs; `clock` moves
    by each round's time; a generation stops after `max_rounds` rounds if given."""
    played = Played()
    for runs in outputs:
        policy, p, ks = policy_for(), 1, list[int]()  # the first token comes with the prefill
        while p < len(runs) and (max_rounds is None or len(ks) < max_rounds):
            cost = cost_at(sum(map(len, played.ks)) + len(ks))
            k = min(policy.next_k(), len(runs) - p - 1)  # one token of what is left goes to the bonus
            accepted = min(k, runs[p])
            verify = cost.verify_ms(k)
            drafting = cost.drafting_ms(k)
            round_ms = drafting + verify + cost.net_ms
            played.ms, played.tokens, p = played.ms + round_ms, played.tokens + accepted + 1, p + accepted + 1
            if clock is not None:
                clock.seconds += round_ms / 1000.0
            ks.append(k)
            if k:
                policy.update(RoundFeedback(k, accepted, 0.0, drafting, verify + cost.net_ms, verify))
        played.ks.append(ks)
    return played


def play(
    policy_for: Callable[[], KPolicy], outputs: Sequence[Sequence[int]], cost: RoundCost, clock: ReplayClock | None = None
) -> dict[str, float]:
    """One policy over every output in turn at fixed costs: expected decode tokens per second and
    the mean k it drafted."""
    played = replay(policy_for, outputs, lambda _: cost, clock)
    ks = [k for generation in played.ks for k in generation]
    return {"tokens_per_s": 1000.0 * played.tokens / played.ms, "mean_k": sum(ks) / len(ks)}


def compare(outputs: Sequence[Sequence[int]], cost: RoundCost) -> dict[str, dict[str, float]]:
    rows = {f"k{k}": play(partial(FixedK, k), outputs, cost) for k in FIXED_KS}
    clock = ReplayClock()
    costs = RoundCosts(clock=clock)  # one edge process: shared by its generations
    rows["cost (default)"] = play(lambda: CostK(costs=costs), outputs, cost, clock)
    return rows


def _parse_config(spec: str) -> tuple[str, RoundCost]:
    name, _, numbers = spec.partition("=")
    try:
        values = [float(x) for x in numbers.split(",")]
    except ValueError:
        values = []
    if not name or len(values) not in (4, 5):
        raise ConfigError(
            f"--config {spec[:80]!r}: expected NAME=DRAFT_MS,VERIFY_FIXED_MS,VERIFY_MS_PER_ROW,NETWORK_MS[,DRAFT_FIXED_MS]"
        )
    return name, RoundCost(*values)


def draft_match_runs(s: ReplaySettings) -> list[list[int]]:
    """L for every prompt of the run, in its order: one teacher-forced draft pass each."""
    import numpy as np
    from llama_cpp import Llama

    from edge.prompts import encode_prompt
    from edge.tokenizer import EdgeTokenizer
    from shared.models import DRAFT_MODEL
    from shared.models.store import model_folder

    folder = Path(model_folder(None, DRAFT_MODEL))
    gguf = s.draft_gguf or next(folder.glob("*.gguf"))
    tokenizer = EdgeTokenizer(folder)
    prompts = [json.loads(line) for line in (s.run_files / "prompts.jsonl").read_text().splitlines() if line.strip()]
    outputs = {r["id"]: r["token_ids"] for r in map(json.loads, (s.run_files / s.outputs).read_text().splitlines()) if r}
    llm = Llama(str(gguf), n_ctx=4096, logits_all=True, verbose=False)
    runs = []
    for prompt in prompts:
        ids, output = encode_prompt(tokenizer, prompt["prompt"], True)[-s.draft_window :], outputs[prompt["id"]]
        llm.reset()
        llm.eval(ids + output)
        choices = np.asarray(llm.scores[len(ids) - 1 : len(ids) - 1 + len(output)]).argmax(-1).tolist()
        runs.append(match_runs(choices, output))
    return runs


def report(result: dict[str, Any]) -> str:
    lines = ["# k policies on replayed acceptance", "", f"`{result['provenance']['command']}`", ""]
    lines += ["| costs | " + " | ".join(next(iter(result["configs"].values()))["rates"]) + " | cost / best fixed |"]
    lines += ["|---" * (len(next(iter(result["configs"].values()))["rates"]) + 2) + "|"]
    for name, config in result["configs"].items():
        rates = config["rates"]
        best = max(v["tokens_per_s"] for n, v in rates.items() if n.startswith("k"))
        cells = [f"{v['tokens_per_s']:.2f} (k {v['mean_k']:.1f})" for v in rates.values()]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {rates['cost (default)']['tokens_per_s'] / best:.3f} |")
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    return settings_parser("python -m bench.studies.kpolicy_replay", __doc__, ReplaySettings)


def main(argv: list[str] | None = None) -> int:
    s, command = study_settings("bench.studies.kpolicy_replay", __doc__, ReplaySettings, argv)
    configs = dict(map(_parse_config, s.config))
    outputs = draft_match_runs(s)
    result: dict[str, Any] = {"provenance": provenance(command), "prompts": len(outputs), "configs": {}}
    for name, cost in configs.items():
        result["configs"][name] = {"costs": vars(cost), "rates": compare(outputs, cost)}
    write_result(s.out, "kpolicy_replay", result, report(result))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli("python -m bench.studies.kpolicy_replay", main))
