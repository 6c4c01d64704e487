"""The benchmark's Hugging Face runner samples as edge-agent does: with the run's temperature
and top-p."""

from __future__ import annotations

from bench.hf_runner import HfRunnerSettings, generation_config

FILES = {"target": "t", "draft": "d", "prompts": "p.jsonl", "output": "o.jsonl", "log_rounds": "r.jsonl", "meta": "m.json"}


def test_the_hf_runner_samples_with_the_benchmark_s_top_p() -> None:
    sampled = generation_config(HfRunnerSettings(system="target-only", temperature=0.7, top_p=0.95, **FILES), [2])
    assert sampled.do_sample and (sampled.temperature, sampled.top_p) == (0.7, 0.95)
    greedy = generation_config(HfRunnerSettings(system="target-only", temperature=0.0, top_p=0.95, **FILES), [2])
    assert not greedy.do_sample and greedy.top_p is None  # greedy: nothing to cut
