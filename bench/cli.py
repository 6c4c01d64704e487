"""The --help of the harness's and the repository tools' commands, from their settings classes
as edge-agent's and cloud-verifier's: each flag under its group, the module's docstring as
written (its example commands keep their line breaks)."""

from __future__ import annotations

import argparse

from pydantic_settings import BaseSettings

from shared.cli import add_settings_flags


def settings_parser(prog: str, doc: str | None, settings_cls: type[BaseSettings]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_settings_flags(parser, settings_cls)
    return parser
