"""edge-agent --metrics-port: the exposition served over HTTP moves by what the rounds did."""

import asyncio
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from edge.drafting.kpolicy import FixedK
from edge.metrics import EdgeMetrics, MeteredObserver
from edge.round.generate import TimeoutPolicy, speculative_generate
from edge.transport.client import VerifierClient
from tests.harness import gen_config, make_drafter, random_prompt, running_verifier
from tools.netproxy import FaultProxy, LinkConditions


def _scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {sample.name: sample.value for family in text_string_to_metric_families(text) for sample in family.samples}


def test_edge_metrics_count_rounds_and_provisional_tokens(target_model, draft_model) -> None:
    metrics = EdgeMetrics()
    port = metrics.serve(0)

    async def run() -> None:
        async with running_verifier(target_model) as (direct, _):
            proxy = FaultProxy("127.0.0.1", int(direct.target.rsplit(":", 1)[1]), LinkConditions(rtt_ms=300))
            await proxy.start()
            client = VerifierClient(proxy.address, verify_timeout_s=10)
            try:
                cfg = gen_config(max_new_tokens=16, timeouts=TimeoutPolicy(soft_deadline_s=0.05))
                result = await speculative_generate(
                    random_prompt(9), make_drafter(draft_model), client, FixedK(4), cfg, MeteredObserver(metrics, None)
                )
            finally:
                await client.close()
                await proxy.close()
        scraped = _scrape(port)
        assert scraped["specdec_edge_rounds_total"] == result.rounds > 0
        assert scraped["specdec_edge_draft_tokens_total"] == result.draft_tokens
        assert scraped["specdec_edge_accepted_tokens_total"] == result.accepted_tokens
        assert scraped["specdec_edge_committed_tokens_total"] == len(result.token_ids) == 16
        assert scraped["specdec_edge_provisional_tokens_total"] == result.provisional_tokens > 0
        assert scraped["specdec_edge_retracted_tokens_total"] == result.retracted_tokens
        assert scraped["specdec_edge_rtt_seconds_count"] == result.rounds
        assert scraped["specdec_edge_rtt_seconds_sum"] >= 0.3 * result.rounds  # every call crossed the slow link

    asyncio.run(run())


def test_edge_metrics_count_tokens_by_mode_and_the_switches(target_model, draft_model) -> None:
    from dataclasses import replace

    from edge.round.mode_switch import SwitchRules

    metrics = EdgeMetrics()
    port = metrics.serve(0)
    # Speculation always measures "slower": the modes alternate, and every switch is counted.
    rules = SwitchRules(min_rounds=1, window=1, keep_ratio=1e9, backoff_tokens=2, max_backoff_tokens=2)

    async def run() -> None:
        async with running_verifier(target_model) as (client, _):
            cfg = replace(gen_config(max_new_tokens=24), mode_switch=rules)
            result = await speculative_generate(random_prompt(9), make_drafter(draft_model), client, FixedK(2), cfg)
        metrics.record_generation(result)
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name.endswith("_total")
        }
        for mode, tokens in result.tokens_by_mode.items():
            assert samples[("specdec_edge_tokens_by_mode_total", (("mode", mode),))] == tokens > 0
        switches = [(s["to"], s["why"]) for s in result.mode_switches]
        assert {"start", "drafter_ready", "slower", "probe_speculation"} <= {why for _, why in switches}
        for to, why in set(switches):
            assert samples[("specdec_edge_mode_switches_total", (("to", to), ("why", why)))] == switches.count((to, why))

    asyncio.run(run())
