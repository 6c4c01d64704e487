"""--api-keys-file: names, plain and sha256 entries, comments, and errors that name the line
without echoing it."""

import hashlib
from pathlib import Path

import pytest

from shared.api_keys import ApiKeys
from shared.errors import ConfigError, Unauthenticated

ALICE_KEY, BOB_KEY, ANON_KEY = "alice-secret-1", "bob-secret-2", "anonymous-secret-3"
ANON_HASH = hashlib.sha256(ANON_KEY.encode()).hexdigest()

FILE = f"""
# the edges of this lab
alice  {ALICE_KEY}
bob sha256:{hashlib.sha256(BOB_KEY.encode()).hexdigest().upper()}   # rotated monthly
   sha256:{ANON_HASH}
alice  alice-next-key
"""


def _bearer(key: str) -> str:
    return f"Bearer {key}"


def test_names_plain_and_hashed_entries() -> None:
    keys = ApiKeys.parse(FILE)
    assert keys.enabled and len(keys.entries) == 4
    assert keys.principal(_bearer(ALICE_KEY)) == "alice"
    assert keys.principal(_bearer("alice-next-key")) == "alice"  # two keys, one caller: rotation
    assert keys.principal(_bearer(BOB_KEY)) == "bob"  # hex digits in either case
    assert keys.principal(f"bearer   {ANON_KEY} ") == f"key-{ANON_HASH[:8]}"  # the default name
    unnamed = ApiKeys.parse(ALICE_KEY)
    assert unnamed.principal(_bearer(ALICE_KEY)) == f"key-{hashlib.sha256(ALICE_KEY.encode()).hexdigest()[:8]}"


@pytest.mark.parametrize(
    "authorization",
    [None, "", "Bearer", "Bearer  ", ALICE_KEY, f"Basic {ALICE_KEY}", _bearer(ALICE_KEY + "x"), _bearer(f"sha256:{ANON_HASH}")],
)
def test_missing_or_wrong_keys_are_refused_without_echoing_them(authorization: str | None) -> None:
    with pytest.raises(Unauthenticated) as err:
        ApiKeys.parse(FILE).principal(authorization)
    assert err.value.status == "UNAUTHENTICATED"
    assert ALICE_KEY not in str(err.value) and ANON_HASH not in str(err.value)


def test_without_keys_everyone_is_the_empty_principal() -> None:
    assert not ApiKeys().enabled
    assert ApiKeys().principal(None) == ApiKeys().principal("Bearer anything") == ""


@pytest.mark.parametrize(
    ("text", "line", "reason"),
    [
        (f"alice {ALICE_KEY}\nbob sha256:abc123\n", 2, "64 hex digits"),
        (f"# header\n\nalice {ALICE_KEY} extra-field\n", 3, "found 3 fields"),
        (f"al|ce {ALICE_KEY}\n", 1, "a name is"),
        (f"sha256:{'g' * 64}\n", 1, "64 hex digits"),
    ],
)
def test_a_malformed_line_is_named_not_echoed(text: str, line: int, reason: str) -> None:
    with pytest.raises(ConfigError) as err:
        ApiKeys.parse(text, "keys.txt")
    message = str(err.value)
    assert message.startswith(f"keys.txt line {line}: ") and reason in message
    assert ALICE_KEY not in message and "abc123" not in message and "g" * 64 not in message


def test_a_file_without_keys_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "keys.txt"
    path.write_text("# nobody yet\n\n")
    with pytest.raises(ConfigError, match="no keys"):
        ApiKeys.load(path)
    with pytest.raises(ConfigError, match="missing.txt"):
        ApiKeys.load(tmp_path / "missing.txt")
    path.write_text(f"carol {ALICE_KEY}\n")
    assert ApiKeys.load(path).principal(_bearer(ALICE_KEY)) == "carol"
