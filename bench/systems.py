"""The systems a benchmark compares, and how each one runs."""

from __future__ import annotations

import dataclasses
import shlex
from dataclasses import dataclass
from enum import Enum

from shared.errors import ConfigError


class Kind(Enum):
    IN_PROCESS = "in-process"  # bench.hf_runner: transformers generate, no network
    EDGE_LOCAL = "edge-local"  # edge-agent without a verifier (edge_only): no network
    WIRE = "wire"  # edge-agent talking to the verifier through the proxy: run at every RTT


@dataclass(frozen=True)
class System:
    name: str
    kind: Kind
    edge_flags: tuple[str, ...] = ()
    only_rtts_ms: tuple[float, ...] | None = None  # a wire system run at these RTTs only (name@0/50)

    @property
    def crosses_wire(self) -> bool:
        return self.kind is Kind.WIRE

    def runs_at(self, rtt_ms: float) -> bool:
        return self.only_rtts_ms is None or rtt_ms in self.only_rtts_ms


TARGET_ONLY = "target-only"
HF_ASSISTED = "hf-assisted"
CLOUD_ONLY = "cloud_only"

SPECULATIVE = ("--mode", "speculative")  # speculation throughout (edge-agent's default is auto)

BUILT_IN: dict[str, System] = {
    s.name: s
    for s in (
        System(TARGET_ONLY, Kind.IN_PROCESS),
        System(HF_ASSISTED, Kind.IN_PROCESS),
        System("edge_only", Kind.EDGE_LOCAL, ("--mode", "edge_only")),
        System(CLOUD_ONLY, Kind.WIRE, ("--mode", "cloud_only")),
        # the target first, speculation whenever it measures faster (edge-agent's default)
        System("auto", Kind.WIRE, ("--mode", "auto")),
        System("speculative", Kind.WIRE, SPECULATIVE),  # the edge's default drafter: llama.cpp on the draft GGUF
        System("speculative-transformers", Kind.WIRE, (*SPECULATIVE, "--draft-runtime", "transformers")),
        # n-gram drafting, NAPD (filler 1) and NASD (the target's top-8 fed back), and the hybrid
        System("ngram", Kind.WIRE, (*SPECULATIVE, "--drafter", "ngram", "--filler-top-k", "1")),
        System("ngram8", Kind.WIRE, (*SPECULATIVE, "--drafter", "ngram", "--filler-top-k", "8")),
        System("hybrid", Kind.WIRE, (*SPECULATIVE, "--drafter", "hybrid")),
        # draft the next block while Verify is in flight
        System("overlap", Kind.WIRE, (*SPECULATIVE, "--overlap")),
    )
}
DEFAULT_SYSTEMS = (TARGET_ONLY, HF_ASSISTED, "edge_only", CLOUD_ONLY, "speculative", "auto")


def parse_variant(spec: str, rtts_ms: list[float]) -> System:
    """NAME=edge-agent flags (NAME@0=... at RTT 0 only); a variant with --mode edge_only needs no verifier."""
    label, sep, flags = spec.partition("=")
    name = label.partition("@")[0].strip()
    if not sep or not name:
        raise ConfigError(f"--variant {spec!r}: expected NAME=edge-agent flags")
    if name in BUILT_IN:
        raise ConfigError(f"--variant {name}: that name is a built-in system")
    args = tuple(shlex.split(flags))
    edge_only = (
        any(a == "edge_only" and i > 0 and args[i - 1] == "--mode" for i, a in enumerate(args)) or "--mode=edge_only" in args
    )
    system = System(name, Kind.EDGE_LOCAL if edge_only else Kind.WIRE, args)
    return _restrict_rtts("--variant", label.strip(), system, rtts_ms)


def _built_in(spec: str, rtts_ms: list[float]) -> System:
    name = spec.partition("@")[0]
    if name not in BUILT_IN:
        raise ConfigError(f"--systems: unknown {name} (known: {', '.join(BUILT_IN)}; others via --variant NAME=flags)")
    return _restrict_rtts("--systems", spec, BUILT_IN[name], rtts_ms)


def _restrict_rtts(flag: str, spec: str, system: System, rtts_ms: list[float]) -> System:
    """`name` or `name@r1/r2`: a wire system optionally at some RTTs only (so a run can add
    rows at RTT 0 without paying for them at every RTT)."""
    name, sep, rtts = spec.partition("@")
    if not sep:
        return system
    if not system.crosses_wire:
        raise ConfigError(f"{flag} {spec}: {name} does not cross the network, it has no RTT")
    try:
        only = tuple(float(r) for r in rtts.split("/"))
    except ValueError:
        raise ConfigError(f"{flag} {spec}: expected {name}@RTT[/RTT...] in ms") from None
    missing = [r for r in only if r not in rtts_ms]
    if missing:
        raise ConfigError(f"{flag} {spec}: RTT {missing[0]:g} ms is not in --rtt-ms")
    return dataclasses.replace(system, only_rtts_ms=only)


def resolve_systems(names: list[str], variants: list[str], rtts_ms: list[float]) -> list[System]:
    """The systems to run, in the order given, then the variants."""
    chosen = [_built_in(n, rtts_ms) for n in dict.fromkeys(names)] + [parse_variant(v, rtts_ms) for v in variants]
    seen: set[str] = set()
    for system in chosen:
        if system.name in seen:
            raise ConfigError(f"system {system.name} given twice")
        seen.add(system.name)
    return chosen
