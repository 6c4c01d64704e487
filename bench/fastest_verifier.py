"""Which verifier flags served target-only streams fastest in a run of tools/gpu_parity.sh,
of those an asynchronous-parity run allows: the flags tools/gpu_measure.sh then runs the
capacity search with.

The candidates are the verifier as it starts by default (`cloud_only`, no flags) and each
labelled variant ("LABEL SWITCH_S FLAGS...;...", the format of gpu_parity.sh's VARIANTS).
They are ranked by tok/s at the middle stream count of the run (24 of 1,24,64). A candidate
that schedules asynchronously (the default does; `--no-vllm-async-scheduling` does not) is one
only where the parity study found the asynchronous engine's tokens equal to the synchronous
one's; a missing or unfinished study allows none, and then the synchronous flag is printed if no
synchronous variant was measured. With no parity result the default's flags (none) are printed,
or the synchronous flag where asynchronous scheduling is not allowed.

    python -m bench.fastest_verifier --parity PARITY.json [--async-parity ASYNC.json] [--variants V]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from bench.cli import settings_parser
from shared.cli import run_cli, settings_from_args

DEFAULT = "cloud_only"  # tools/gpu_parity.sh's label for the verifier as it starts by default
SYNC_FLAG = "--no-vllm-async-scheduling"


class FastestVerifierSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECDEC_FASTEST_VERIFIER_")

    parity: Path = Field(description="tools/gpu_parity.sh's stream_parity.json")
    async_parity: Path | None = Field(None, description="bench.studies.vllm_async_parity's JSON result")
    variants: str = Field("", description="gpu_parity.sh's VARIANTS of that run")

    help_groups: ClassVar[dict[str, tuple[str, ...]]] = {"the runs": ("parity", "async_parity", "variants")}


def candidates(variants: str) -> dict[str, str]:
    """Label -> cloud-verifier flags, the default first."""
    flags = {DEFAULT: ""}
    for variant in filter(None, (v.strip() for v in variants.split(";"))):
        label, *rest = variant.split(maxsplit=2)  # LABEL, SWITCH_S, FLAGS
        flags[label] = rest[1] if len(rest) > 1 else ""
    return flags


def asynchronous_is_exact(study: dict[str, Any] | None) -> bool:
    compared = (study or {}).get("asynchronous_against_synchronous")
    return bool(compared and compared.get("all_equal"))


def fastest(parity: dict[str, Any] | None, flags: dict[str, str], async_exact: bool) -> str:
    """The flags of the allowed candidate with the most tok/s at the run's middle stream count."""
    allowed = {label: f for label, f in flags.items() if async_exact or SYNC_FLAG in f.split()}
    fallback = flags[DEFAULT] if async_exact else SYNC_FLAG
    rows = sorted((parity or {}).get("rows", []), key=lambda row: row["streams"])
    if not rows:
        return fallback
    row = rows[len(rows) // 2]
    measured = {label: row[label]["tok_s"] for label in allowed if label in row}
    if not measured:
        return fallback
    return allowed[max(measured, key=lambda label: measured[label])]


def _read(path: Path | None) -> dict[str, Any] | None:
    if path is None or not path.is_file():
        return None
    loaded: dict[str, Any] = json.loads(path.read_text())
    return loaded


def main(argv: list[str] | None = None) -> int:
    prog = "python -m bench.fastest_verifier"
    args = settings_parser(prog, __doc__, FastestVerifierSettings).parse_args(argv)
    return run_cli(prog, lambda: _print_choice(settings_from_args(FastestVerifierSettings, args)))


def _print_choice(args: FastestVerifierSettings) -> int:
    flags = candidates(args.variants)
    print(fastest(_read(args.parity), flags, asynchronous_is_exact(_read(args.async_parity))))  # noqa: T201
    return 0


if __name__ == "__main__":
    sys.exit(main())
