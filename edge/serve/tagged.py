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


def _kind_of(untyped: str | None) -> Any:
    def kind(value: Any) -> str | None:
        if isinstance(value, str):
            return "<str>"
        found = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
        if found is None and untyped is not None:
            found = untyped
        return f"<{found}>" if isinstance(found, str) else None

    return kind


def tagged(members: dict[str, Any], expected: str, untyped: str | None = None) -> Any:
    """A union of `members` by their `type` ("str" for a plain string); `expected` says what
    the field takes, for a value of no member's type; `untyped`: the member a value without a
    `type` is (a Responses message item may leave it out)."""
    options = tuple(Annotated[member, Tag(f"<{kind}>")] for kind, member in members.items())
    found = Discriminator(_kind_of(untyped), custom_error_type="invalid_type", custom_error_message=expected)
    return Annotated[Union[options], found]  # noqa: UP007 (a Union of a tuple)
