"""How the default k policy rides out a disturbance: a CPU hog on the verifier's core, and an RTT
that steps up and back down, each in one edge process that keeps its figures across prompts.

    python -m bench.studies.kpolicy_disturbance --prompts bench/data/spec_bench_heldout_12.jsonl \\
        --max-new-tokens 64 --out docs/kpolicy_disturbance

Two-machine emulation (the bench's pinned placement): cloud-verifier on core 0, edge-agent on
core 1, one thread each; the edge reaches the verifier through a loopback proxy whose added RTT
this process changes while the run goes on. Each scenario is one edge-agent process (--mode
speculative, the default k policy) over the same prompts in the same order, split in thirds:

- quiet: +5 ms throughout (the reference at that RTT);
- hog: a busy loop shares the verifier's core while the first third runs;
- rtt-step: +5 ms, then +80 ms over the second third, then +5 ms again;
- quiet-80: +80 ms throughout (the reference at that RTT).

A phase begins once the edge has written the last output of the phase before (this process
looks three times a second), so it holds from about the next prompt's first round. The report
gives, per scenario, tokens/s and mean k per phase; after the hog, tokens/s over the later
prompts against the quiet run's over the same prompts (all of them, and those that start 30
rounds or more after the hog ended); after each RTT step, the rounds k takes to settle within 1
of the k the reference run drafts over the same prompts; and a plot of k
over rounds. Writes kpolicy_disturbance.json, report.md and k_over_rounds.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, ClassVar, Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict
from tqdm import tqdm

from bench.cli import settings_parser, study_settings
from bench.config import BenchFlags, files_beside
from bench.environment import machine_line, provenance, write_result
from bench.processes import PINNED
from bench.resolve import prompts_of, settings_from
from bench.runner import WARMUP, BenchRunner, Run
from bench.summarize import load_jsonl
from bench.systems import System, resolve_systems
from shared.cli import run_cli
from shared.errors import ConfigError
from shared.hardware import choose_dtype
from tools.netproxy import FaultProxy

# The hog recovery is judged on the prompts that start this many rounds after the hog ended.
RECOVERY_ROUNDS = 30
# k has settled once every later prompt's median k is within this of the reference run's on
# that prompt (k follows each text's acceptance, so it is compared prompt by prompt).
SETTLE_BAND = 1.0


class DisturbanceSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECDEC_KPOLICY_DISTURBANCE_")

    prompts: Path = Field(Path("bench/data/spec_bench_heldout_12.jsonl"), description="JSONL of prompts, run in order")
    max_new_tokens: int = Field(64, ge=1, description="per prompt")
    temperature: float = Field(0.0, ge=0, description="0 = greedy")
    quiet_rtt_ms: float = Field(5.0, ge=0, description="the added RTT of the quiet phases")
    step_rtt_ms: float = Field(80.0, ge=0, description="the added RTT the step goes to")
    engine: Literal["transformers", "vllm"] = Field("transformers", description="the verifier's engine")
    verifier_python: Path | None = Field(None, description="the interpreter cloud-verifier runs under (default: this one)")
    draft_model: Path | None = Field(None, description="draft model folder (default: the packaged Qwen 0.5B)")
    target_model: Path | None = Field(None, description="target model folder (default: the packaged Qwen 1.5B)")
    quick: bool = Field(False, description="tiny random models and few tokens: checks the harness, measures nothing")
    summarize_only: bool = Field(
        False, description="measure nothing: summarize the runs a previous call left in OUT/kpolicy_disturbance_files"
    )
    out: Path = Field(Path("docs/kpolicy_disturbance"), description="folder for the JSON result, report.md and the plot")

    help_groups: ClassVar[dict[str, tuple[str, ...]]] = {
        "what to run": ("prompts", "max_new_tokens", "temperature", "engine", "verifier_python", "draft_model", "target_model"),
        "the disturbances": ("quiet_rtt_ms", "step_rtt_ms"),
        "results": ("quick", "summarize_only", "out"),
    }


@dataclass(frozen=True)
class Phase:
    rtt_ms: float
    hog: bool = False


@dataclass(frozen=True)
class Scenario:
    name: str
    phases: tuple[Phase, Phase, Phase]  # the conditions over each third of the prompts


def scenarios(quiet_ms: float, step_ms: float) -> list[Scenario]:
    quiet, far = Phase(quiet_ms), Phase(step_ms)
    return [
        Scenario("quiet", (quiet, quiet, quiet)),
        Scenario("hog", (Phase(quiet_ms, hog=True), quiet, quiet)),
        Scenario("rtt-step", (quiet, far, quiet)),
        Scenario("quiet-80", (far, far, far)),
    ]


def phase_bounds(prompts: int) -> tuple[int, int]:
    """Prompts done when the second and third phases begin."""
    return prompts // 3, 2 * prompts // 3


class SteppedLink:
    """A fault proxy on its own event loop thread, so its added RTT can change while a child
    edge-agent talks through it."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self._proxy = FaultProxy(host, int(port))
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="stepped-link", daemon=True)

    def __enter__(self) -> SteppedLink:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._proxy.start(), self._loop).result(timeout=10)
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        asyncio.run_coroutine_threadsafe(self._proxy.close(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    @property
    def address(self) -> str:
        return self._proxy.address

    def set_rtt(self, rtt_ms: float) -> None:
        self._loop.call_soon_threadsafe(setattr, self._proxy.conditions, "rtt_ms", rtt_ms)


class Disturbance:
    """The one owner of a run's conditions: the link's RTT and the busy loop on the verifier's
    cores, set for the phase the run has reached."""

    def __init__(self, scenario: Scenario, link: SteppedLink, verifier_cores: str, prompts: int) -> None:
        self.scenario, self.link, self.cores = scenario, link, verifier_cores
        self.bounds = phase_bounds(prompts)
        self._phase = -1
        self._hog: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Disturbance:
        self.progress(0)
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        self._stop_hog()

    def progress(self, done: int) -> None:
        """`done` prompts are answered: enter the phase that follows them."""
        phase = sum(done >= bound for bound in self.bounds)
        if phase == self._phase:
            return
        self._phase = phase
        conditions = self.scenario.phases[phase]
        self.link.set_rtt(conditions.rtt_ms)
        if conditions.hog and self._hog is None:
            busy_loop = [sys.executable, "-c", "while True: pass"]
            self._hog = subprocess.Popen(["taskset", "-c", self.cores, *busy_loop])
        elif not conditions.hog:
            self._stop_hog()

    def _stop_hog(self) -> None:
        if self._hog is not None:
            self._hog.kill()
            self._hog.wait()
            self._hog = None


# ---- analysis (pure: tested without a model) --------------------------------------------------


def prompt_rate(records: Sequence[dict[str, Any]], ids: Sequence[str]) -> float:
    """Tokens per second over these prompts: their tokens over their wall time."""
    wanted = set(ids)
    chosen = [r for r in records if r["id"] in wanted]
    seconds = sum(r["elapsed_s"] for r in chosen)
    return sum(len(r["token_ids"]) for r in chosen) / seconds if seconds else 0.0


def ks_of(rounds: Sequence[dict[str, Any]], ids: Sequence[str]) -> list[int]:
    """The k of every round of these prompts, in run order."""
    wanted = set(ids)
    return [int(r["k"]) for r in rounds if r["id"] in wanted]


def rounds_until(rounds: Sequence[dict[str, Any]], ids: Sequence[str], count: int) -> list[str]:
    """Of `ids` (in run order), those that start after `count` of their rounds have run."""
    seen, later = 0, []
    for prompt_id in ids:
        if seen >= count:
            later.append(prompt_id)
        seen += sum(1 for r in rounds if r["id"] == prompt_id)
    return later


def prompt_medians(rounds: Sequence[dict[str, Any]], ids: Sequence[str]) -> list[float | None]:
    """Each prompt's median k (None: no round)."""
    return [float(statistics.median(ks)) if (ks := ks_of(rounds, [p])) else None for p in ids]


def settled_from(rounds: Sequence[dict[str, Any]], reference: Sequence[dict[str, Any]], ids: Sequence[str]) -> int | None:
    """The rounds of `ids` (the prompts after a step, in run order) before the first prompt from
    which every later one drafts as the reference run does on it (median k within SETTLE_BAND);
    None if the last prompt does not."""
    seen, settled = 0, None
    for prompt, mine, theirs in zip(ids, prompt_medians(rounds, ids), prompt_medians(reference, ids), strict=True):
        matches = mine is not None and theirs is not None and abs(mine - theirs) <= SETTLE_BAND
        if not matches:
            settled = None
        elif settled is None:
            settled = seen
        seen += len(ks_of(rounds, [prompt]))
    return settled


def summarize(runs: dict[str, Run], ids: list[str], scenario_list: list[Scenario]) -> dict[str, Any]:
    """Per scenario and phase: tokens/s and k; the hog's recovery; the RTT step's settling."""
    first, second = phase_bounds(len(ids))
    thirds = [ids[:first], ids[first:second], ids[second:]]
    reference = {scenario.phases[0].rtt_ms: scenario.name for scenario in scenario_list if scenario.name.startswith("quiet")}
    out: dict[str, Any] = {"scenarios": {}}
    for scenario in scenario_list:
        run = runs[scenario.name]
        out["scenarios"][scenario.name] = {
            "phases": [
                {
                    "rtt_ms": phase.rtt_ms,
                    "hog": phase.hog,
                    "prompts": part,
                    "tokens_per_s": round(prompt_rate(run.records, part), 3),
                    "mean_k": round(statistics.fmean(ks), 3) if (ks := ks_of(run.rounds, part)) else None,
                    "rounds": len(ks),
                }
                for phase, part in zip(scenario.phases, thirds, strict=True)
            ]
        }
    quiet, hog = runs["quiet"], runs["hog"]
    after = ids[first:]
    later = rounds_until(hog.rounds, after, RECOVERY_ROUNDS)
    out["hog_recovery"] = {
        "after_prompts": after,
        "tokens_per_s_after": round(prompt_rate(hog.records, after), 3),
        "quiet_tokens_per_s_after": round(prompt_rate(quiet.records, after), 3),
        "ratio_after": _ratio(prompt_rate(hog.records, after), prompt_rate(quiet.records, after)),
        "prompts_from_round_30": later,
        "ratio_from_round_30": _ratio(prompt_rate(hog.records, later), prompt_rate(quiet.records, later)),
        "ratio_during": _ratio(prompt_rate(hog.records, thirds[0]), prompt_rate(quiet.records, thirds[0])),
        # each later prompt's tokens/s over the quiet run's: a fresh process's on the same text
        "ratio_by_prompt_after": [_ratio(prompt_rate(hog.records, [p]), prompt_rate(quiet.records, [p])) for p in after],
    }
    step = runs["rtt-step"]
    out["rtt_step"] = [
        _settling(step, runs[reference[scenario_list[2].phases[index].rtt_ms]], part, label)
        for index, part, label in ((1, thirds[1], "up"), (2, thirds[2], "down"))
    ]
    return out


def _settling(run: Run, reference: Run, part: list[str], label: str) -> dict[str, Any]:
    ks = ks_of(run.rounds, part)
    return {
        "step": label,
        "prompts": part,
        "median_k_by_prompt": prompt_medians(run.rounds, part),
        "reference_median_k_by_prompt": prompt_medians(reference.rounds, part),
        "rounds": len(ks),
        "settled_from_round": settled_from(run.rounds, reference.rounds, part),
        "ratio": _ratio(prompt_rate(run.records, part), prompt_rate(reference.records, part)),
    }


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


# ---- the run -----------------------------------------------------------------------------------


def bench_flags(s: DisturbanceSettings) -> BenchFlags:
    """The bench run these scenarios share: one wire system, pinned, at the quiet RTT."""
    return BenchFlags(
        output=s.out / "kpolicy_disturbance.json",  # its children's files go to OUT/kpolicy_disturbance_files
        quick=s.quick,
        systems="speculative",
        prompts=s.prompts if not s.quick else None,
        rtt_ms=f"{s.quiet_rtt_ms:g}",
        max_new_tokens=s.max_new_tokens if not s.quick else None,
        temperature=s.temperature,
        placement="pinned",
        engine=s.engine,
        verifier_python=s.verifier_python,
        draft_model=s.draft_model,
        target_model=s.target_model,
    )


@dataclass
class Measured:
    runs: dict[str, Run]  # by scenario name
    prompt_ids: list[str]  # in run order
    scenarios: list[Scenario]
    dtype: str


def run_scenarios(s: DisturbanceSettings) -> Measured:
    flags = bench_flags(s)
    settings = settings_from(flags)
    prompts = prompts_of(flags)
    chosen = scenarios(s.quiet_rtt_ms, s.step_rtt_ms)
    system: System = resolve_systems(["speculative"], [], [s.quiet_rtt_ms])[0]
    runs: dict[str, Run] = {}
    with tqdm(total=len(prompts) * len(chosen), unit="prompt") as bar:
        runner = BenchRunner(settings, prompts, bar)
        with runner.verifier(PINNED) as (pid, address), SteppedLink(address) as link:
            for scenario in chosen:
                bar.set_description(scenario.name)
                with Disturbance(scenario, link, PINNED.cloud_cores or "0", len(prompts)) as disturbance:
                    runs[scenario.name] = runner.run_edge(
                        system, PINNED, s.quiet_rtt_ms, link.address, pid, on_progress=disturbance.progress, name=scenario.name
                    )
    return Measured(runs, [p.id for p in prompts], chosen, settings.dtype)


def load_scenarios(s: DisturbanceSettings) -> Measured:
    """The runs a previous call left in its files folder, as run_scenarios returned them."""
    flags = bench_flags(s)
    files = files_beside(flags.output)
    prompts = prompts_of(flags)
    chosen = scenarios(s.quiet_rtt_ms, s.step_rtt_ms)
    system = resolve_systems(["speculative"], [], [s.quiet_rtt_ms])[0]
    runs = {}
    for scenario in chosen:
        records = [r for r in load_jsonl(files / f"{scenario.name}.jsonl") if r["id"] != WARMUP.id]
        rounds = [r for r in load_jsonl(files / f"{scenario.name}.rounds.jsonl") if r["id"] != WARMUP.id]
        runs[scenario.name] = Run(system, PINNED, s.quiet_rtt_ms, records, rounds, 0, 0.0)
    dtype = "float32" if s.quick else choose_dtype("auto", "cpu").name
    return Measured(runs, [p.id for p in prompts], chosen, dtype)


def plot(runs: dict[str, Run], ids: list[str], scenario_list: list[Scenario], path: Path) -> None:
    """k over rounds per scenario, the disturbed phases shaded, and on each prompt the median k
    of the run that had that phase's conditions throughout (dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first, second = phase_bounds(len(ids))
    thirds = [ids[:first], ids[first:second], ids[second:]]
    steady = {s.phases[0].rtt_ms: runs[s.name] for s in scenario_list if s.name.startswith("quiet")}
    fig, axes = plt.subplots(len(scenario_list), 1, figsize=(9, 2.2 * len(scenario_list)), sharey=True)
    for ax, scenario in zip(axes, scenario_list, strict=True):
        rounds = runs[scenario.name].rounds
        ax.plot(range(len(rounds)), [r["k"] for r in rounds], drawstyle="steps-post", linewidth=0.9, label="k")
        start = 0
        for phase, part in zip(scenario.phases, thirds, strict=True):
            count = len(ks_of(rounds, part))
            if phase.hog or phase.rtt_ms != scenario_list[0].phases[0].rtt_ms:
                label = "CPU hog on the verifier" if phase.hog else f"+{phase.rtt_ms:g} ms RTT"
                ax.axvspan(start, start + count, alpha=0.15, color="tab:red")
                ax.text(start + 1, 0.5, label, fontsize=8, color="tab:red")
            start = _reference_steps(ax, rounds, steady[phase.rtt_ms].rounds, part, start)
        ax.set_title(scenario.name, fontsize=9, loc="left")
        ax.set_ylabel("k")
    axes[0].legend(["k", "steady run's median k on the prompt"], fontsize=7, loc="upper left")
    axes[-1].set_xlabel("round (one edge process over every prompt)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _reference_steps(ax: Any, rounds: list[dict[str, Any]], reference: list[dict[str, Any]], part: list[str], start: int) -> int:
    """Draw the reference's median k over each prompt's rounds from `start`; the round after."""
    for prompt, median in zip(part, prompt_medians(reference, part), strict=True):
        count = len(ks_of(rounds, [prompt]))
        if median is not None and count:
            ax.plot([start, start + count], [median, median], linestyle="--", color="tab:gray", linewidth=0.8)
        start += count
    return start


def report(result: dict[str, Any]) -> str:
    m = result["provenance"]["machine"]
    s, summary = result["settings"], result["summary"]
    lines = [
        "# The default k policy under a disturbance",
        "",
        f"Measured on {machine_line(m)}; verifier on core 0 and edge-agent on core 1, one thread each; "
        f"{s['engine']} engine, {result['dtype']}; temperature {s['temperature']:g}; {_workload(result)}, in thirds; "
        "one edge process per scenario.",
        "",
        f"Command: `{result['provenance']['command']}`",
        "",
        "## Per phase",
        "",
        "| scenario | phase 1 | phase 2 | phase 3 |",
        "|---|---|---|---|",
    ]
    for name, data in summary["scenarios"].items():
        cells = [
            f"{'hog, ' if p['hog'] else ''}+{p['rtt_ms']:g} ms: {p['tokens_per_s']:.2f} tok/s, mean k {p['mean_k']}, "
            f"{p['rounds']} rounds"
            for p in data["phases"]
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    hog = summary["hog_recovery"]
    lines += [
        "",
        "## After the CPU hog",
        "",
        f"During the hog: {_x(hog['ratio_during'])} the quiet run's tokens/s over the same prompts. After it, over the "
        f"later prompts: {hog['tokens_per_s_after']:.2f} against {hog['quiet_tokens_per_s_after']:.2f} tok/s "
        f"(**{_x(hog['ratio_after'])}**); over those that start {RECOVERY_ROUNDS} rounds or more after it ended "
        f"({len(hog['prompts_from_round_30'])} prompts): **{_x(hog['ratio_from_round_30'])}** (goal ≥ 0.95x). Prompt by "
        f"prompt after it, against the quiet process on the same text: {_ks(hog['ratio_by_prompt_after'])}.",
        "",
        "## After the RTT steps",
        "",
        "| step | median k by prompt | the reference's | rounds | k settled from round | tok/s against the reference |",
        "|---|---|---|---|---|---|",
    ]
    for step in summary["rtt_step"]:
        settled = step["settled_from_round"]
        lines.append(
            f"| {step['step']} | {_ks(step['median_k_by_prompt'])} | {_ks(step['reference_median_k_by_prompt'])} | "
            f"{step['rounds']} | {settled if settled is not None else 'never'} | {_x(step['ratio'])} |"
        )
    lines += [
        "",
        "Reference: the run at that RTT throughout, on the same prompts. Settled: from the prompt that starts at "
        f"that round on, every prompt's median k is within {SETTLE_BAND:g} of the reference's on it (goal: by "
        "round 20; k follows each text's acceptance, so it is compared prompt by prompt).",
        "",
        "![k over rounds](k_over_rounds.png)",
        "",
    ]
    return "\n".join(lines)


def run(s: DisturbanceSettings, command: str) -> int:
    measured = load_scenarios(s) if s.summarize_only else run_scenarios(s)
    summary = summarize(measured.runs, measured.prompt_ids, measured.scenarios)
    s.out.mkdir(parents=True, exist_ok=True)
    plot(measured.runs, measured.prompt_ids, measured.scenarios, s.out / "k_over_rounds.png")
    result = {
        "provenance": _measured_provenance(s) if s.summarize_only else provenance(command),
        "settings": s.model_dump(mode="json"),
        "dtype": measured.dtype,
        "prompt_ids": measured.prompt_ids,
        "summary": summary,
        "rounds": {name: _round_ks(run) for name, run in measured.runs.items()},
    }
    write_result(s.out, "kpolicy_disturbance", result, report(result))
    return 0


def _measured_provenance(s: DisturbanceSettings) -> dict[str, Any]:
    """The measuring call's machine, versions, date and command, from the result it wrote."""
    earlier = s.out / "kpolicy_disturbance.json"
    if not earlier.exists():
        raise ConfigError(f"--summarize-only: no {earlier} from the call that measured")
    return dict(json.loads(earlier.read_text())["provenance"])


def _workload(result: dict[str, Any]) -> str:
    s, count = result["settings"], len(result["prompt_ids"])
    if s["quick"]:
        return f"{count} tiny prompts on tiny random models (--quick: the harness checked, nothing measured)"
    return f"{count} prompts (`{s['prompts']}`), {s['max_new_tokens']} new tokens each"


def _x(ratio: float | None) -> str:
    return "–" if ratio is None else f"{ratio}x"


def _ks(medians: list[float | None]) -> str:
    return ", ".join("–" if m is None else f"{m:g}" for m in medians)


def _round_ks(run: Run) -> list[dict[str, Any]]:
    return [{"id": r["id"], "k": r["k"], "accepted_len": r["accepted_len"]} for r in run.rounds]


def parser() -> argparse.ArgumentParser:
    return settings_parser("python -m bench.studies.kpolicy_disturbance", __doc__, DisturbanceSettings)


def main(argv: list[str] | None = None) -> int:
    settings, command = study_settings("bench.studies.kpolicy_disturbance", __doc__, DisturbanceSettings, argv)
    return run_cli("kpolicy_disturbance", lambda: run(settings, command))


if __name__ == "__main__":
    sys.exit(main())
