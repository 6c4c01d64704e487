"""Command-line plumbing shared by the console scripts: flags generated from a
pydantic-settings class (so every flag is also an environment variable), and errors
reported as one readable line."""

from __future__ import annotations

import argparse
import sys
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import ValidationError
from pydantic_settings import BaseSettings

from shared.errors import SpecDecError

S = TypeVar("S", bound=BaseSettings)


def _unwrapped(annotation: Any) -> Any:
    """X of `X | None`."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return _unwrapped(next(a for a in typing.get_args(annotation) if a is not type(None)))
    return annotation


def _flag_type(annotation: Any) -> Any:
    """What argparse converts a flag's text to (pydantic converts the rest, paths included)."""
    annotation = _unwrapped(annotation)
    return annotation if annotation in (int, float, str) else str


def _groups(parser: argparse.ArgumentParser, settings_cls: type[BaseSettings]) -> dict[str, Any]:
    """Each field's argument group, from the class's optional `help_groups` (title -> fields)."""
    groups: dict[str, tuple[str, ...]] = getattr(settings_cls, "help_groups", {})
    where: dict[str, Any] = {}
    for title, names in groups.items():
        group = parser.add_argument_group(title)
        where.update(dict.fromkeys(names, group))
    return where


def add_settings_flags(parser: argparse.ArgumentParser, settings_cls: type[BaseSettings]) -> None:
    """One --flag per field; unset flags fall through to the environment, then the default."""
    prefix = str(settings_cls.model_config.get("env_prefix", ""))
    groups = _groups(parser, settings_cls)
    for name, field in settings_cls.model_fields.items():
        target = groups.get(name, parser)
        flag = "--" + name.replace("_", "-")
        env = (prefix + name).upper()
        default = "required" if field.is_required() else f"default {field.get_default(call_default_factory=True)!r}"
        help_text = f"{field.description or ''} [env {env}; {default}]"
        kwargs: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS, "help": help_text}
        if _unwrapped(field.annotation) is bool:  # bool | None: unset is None (the field's own default)
            target.add_argument(flag, action=argparse.BooleanOptionalAction, **kwargs)
            continue
        if typing.get_origin(field.annotation) is list:  # repeatable: each use adds one item
            target.add_argument(flag, action="append", type=_flag_type(typing.get_args(field.annotation)[0]), **kwargs)
            continue
        kind = _unwrapped(field.annotation)
        choices = typing.get_args(kind) if typing.get_origin(kind) is typing.Literal else None
        target.add_argument(flag, type=_flag_type(field.annotation), choices=choices, **kwargs)


def settings_from_args(settings_cls: type[S], args: argparse.Namespace) -> S:
    given = {k: v for k, v in vars(args).items() if k in settings_cls.model_fields}
    return settings_cls(**given)


def _one_line(err: ValidationError) -> str:
    first = err.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "settings"
    return f"{where}: {first['msg']}"


def run_cli(prog: str, main: Callable[[], int]) -> int:
    """Run main(); turn expected failures into one line on stderr and exit status 1."""
    try:
        return main()
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)  # noqa: T201
        return 130
    except ValidationError as err:
        print(f"{prog}: error: {_one_line(err)}", file=sys.stderr)  # noqa: T201
    except (SpecDecError, OSError, ValueError) as err:
        print(f"{prog}: error: {err}", file=sys.stderr)  # noqa: T201
    return 1
