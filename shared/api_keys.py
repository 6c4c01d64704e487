"""A file of API keys (the verifier's --api-keys-file): who may call a server, and under which
name.

One entry per line; blank lines and `#` comments are ignored:

    alice  sha256:2c26b46b68ffc68ff99b453c1d30413413422d706483bfa0f98a5e886266e7ae
    bob    a-plain-key
    ops    sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08  operator
    sha256:fcde2b2edba56bf408601fb721fe9b5c338d10ee429ea04fae5511b68fbf8fb9

An entry is a key or `sha256:<hex>` of one, optionally after a name; the name stands for the
key in logs, metrics and limits (default `key-` and the first 8 hex digits of its sha256). Two
entries may share a name: one caller with an old and a new key while it rotates them. A named
entry may end with the word `operator`: on the verifier, that key's HTTP views (/v1/sessions,
/v1/stats, the live page) show every key's sessions; every other key sees only its own.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass
from pathlib import Path

from shared.errors import ConfigError, Unauthenticated

_HASHED = re.compile(r"sha256:([0-9a-fA-F]{64})")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")  # safe in a log line or a metric label
_COMMENT = re.compile(r"(^|\s)#.*$")


@dataclass(frozen=True)
class _Entry:
    name: str
    digest: bytes  # sha256 of the key: plain keys are hashed on load and not kept
    operator: bool = False  # sees every key's sessions in the HTTP views


@dataclass(frozen=True)
class Caller:
    """Who an HTTP request or a call comes from: the key's name, and whether it sees every key's
    sessions (an operator key, or any caller when no keys are configured)."""

    name: str
    sees_all: bool

    def sees(self, owner: str) -> bool:
        return self.sees_all or owner == self.name


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _default_name(digest: bytes) -> str:
    return f"key-{digest.hex()[:8]}"


def _entry(fields: list[str], where: str) -> _Entry:
    """fields: [key], [name, key] or [name, key, "operator"]. Errors name the line, never its
    text (it may hold a key)."""
    operator = len(fields) == 3 and fields[2] == "operator"
    if len(fields) > 2 and not operator:
        raise ConfigError(f"{where}: expected a key, 'NAME KEY' or 'NAME KEY operator', found {len(fields)} fields")
    fields = fields[:2]
    secret = fields[-1]
    if secret.lower().startswith("sha256:"):
        if not (match := _HASHED.fullmatch(secret)):
            raise ConfigError(f"{where}: a sha256: entry needs exactly 64 hex digits")
        digest = bytes.fromhex(match.group(1))
    else:
        digest = _digest(secret)
    name = fields[0] if len(fields) == 2 else _default_name(digest)
    if not _NAME.fullmatch(name):
        raise ConfigError(f"{where}: a name is up to 64 letters, digits and . _ @ - (starting with a letter or digit)")
    return _Entry(name, digest, operator)


@dataclass(frozen=True)
class ApiKeys:
    """The accepted keys; with none configured everyone is let in, as the empty principal."""

    entries: tuple[_Entry, ...] = ()

    @property
    def enabled(self) -> bool:
        return bool(self.entries)

    @classmethod
    def parse(cls, text: str, source: str = "--api-keys-file") -> ApiKeys:
        entries = []
        for number, line in enumerate(text.splitlines(), start=1):
            fields = _COMMENT.sub("", line).split()
            if fields:
                entries.append(_entry(fields, f"{source} line {number}"))
        if not entries:  # an empty file must not quietly open the verifier to everyone
            raise ConfigError(f"{source}: no keys in it")
        return cls(tuple(entries))

    @classmethod
    def one(cls, key: str) -> ApiKeys:
        """A single key given as it is (a flag's value, not a file's line: spaces, `#` and a
        `sha256:` start are part of the key), named as a bare key in the file is."""
        digest = _digest(key)
        return cls((_Entry(_default_name(digest), digest),))

    @classmethod
    def load(cls, path: str | Path, flag: str = "--api-keys-file") -> ApiKeys:
        """The keys in the file at `path`; errors start with `flag` (the option that named it)."""
        try:
            text = Path(path).read_text()
        except (OSError, UnicodeDecodeError) as err:
            raise ConfigError(f"{flag} {path}: {getattr(err, 'strerror', None) or err}") from None
        return cls.parse(text, f"{flag} {path}")

    def principal(self, authorization: str | None) -> str:
        """The name of the key in an `authorization: Bearer KEY` value ("" when no keys are
        configured); Unauthenticated when it is missing or unknown. The scheme is matched in any
        case (`Bearer`, `bearer`), as HTTP's schemes are."""
        return self.caller(authorization).name

    def caller(self, authorization: str | None) -> Caller:
        """Who sends `authorization`: its key's name and whether it sees every key's sessions."""
        if not self.entries:
            return Caller("", sees_all=True)
        scheme, _, key = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise Unauthenticated("no API key: send the header 'authorization: Bearer <key>'")
        presented = _digest(key.strip())
        found: _Entry | None = None
        for entry in self.entries:  # every entry is compared, in constant time each
            if hmac.compare_digest(presented, entry.digest) and found is None:
                found = entry
        if found is None:
            raise Unauthenticated("the API key is not accepted")
        return Caller(found.name, found.operator)
