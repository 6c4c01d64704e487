"""Request fields that take one of several shapes told apart by their `type` (tool_choice,
response_format, a Responses input item), as pydantic unions whose errors name the field as
OpenAI does: `tool_choice.function.name`, not the union member pydantic tried.

Each member is tagged "<type>"; openai_api's parameter names skip the tags.
"""

from __future__ import annotations

from typing import Annotated, Any, Union

from pydantic import Discriminator, Tag


def is_tag(part: str) -> bool:
    return part.startswith("<") and part.endswith(">")


def _kind(value: Any) -> str | None:
    if isinstance(value, str):
        return "<str>"
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return f"<{kind}>" if isinstance(kind, str) else None


def tagged(members: dict[str, Any], expected: str) -> Any:
    """A union of `members` by their `type` ("str" for a plain string); `expected` says what
    the field takes, for a value of no member's type."""
    options = tuple(Annotated[member, Tag(f"<{kind}>")] for kind, member in members.items())
    return Annotated[Union[options], Discriminator(_kind, custom_error_type="invalid_type", custom_error_message=expected)]  # noqa: UP007 (a Union of a tuple)
