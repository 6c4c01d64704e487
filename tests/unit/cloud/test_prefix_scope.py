"""Reuse scopes: each client of each key has its own, which only the token the verifier signed
for it (and that key) names; a key's clients (every client, without keys) share one only when
the operator says so."""

import pytest

from cloud.prefix_cache import MAX_REUSE_TOKEN, NO_SCOPE, ReuseScopes
from shared.errors import InvalidRequest


@pytest.mark.parametrize("owner", ["", "alice"])
def test_a_client_is_named_only_by_its_signed_token(owner: str) -> None:
    scopes = ReuseScopes("client")
    first = scopes.of(owner, "")
    assert first.name.startswith("client:") and len(first.token) == 32
    assert scopes.of(owner, first.token) == first  # the same client, next session
    other = scopes.of(owner, "")
    assert other.name != first.name and other.token != first.token
    assert scopes.known(owner, "") == NO_SCOPE  # nothing to reuse before the client has a scope


def test_a_token_names_nothing_under_another_key() -> None:
    scopes = ReuseScopes("client")
    alices = scopes.of("alice", "")
    assert scopes.known("bob", alices.token) == NO_SCOPE and scopes.known("", alices.token) == NO_SCOPE
    assert scopes.of("bob", alices.token).name != alices.name


@pytest.mark.parametrize("token", ["x", "A" * 32, "not base64!", "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"])
def test_a_token_this_verifier_did_not_sign_names_a_new_scope(token: str) -> None:
    scopes = ReuseScopes("client")
    assert scopes.known("", token) == NO_SCOPE
    assert scopes.of("", token).token != token


def test_a_forged_token_fails_even_with_a_real_nonce() -> None:
    scopes = ReuseScopes("client")
    real = scopes.of("", "")
    forged = real.token[:-4] + ("AAAA" if not real.token.endswith("AAAA") else "BBBB")
    assert scopes.known("", forged) == NO_SCOPE


def test_another_verifiers_token_names_nothing_here() -> None:
    theirs = ReuseScopes("client").of("", "")
    assert ReuseScopes("client").known("", theirs.token) == NO_SCOPE


def test_shared_mode_is_one_scope_a_key_and_one_for_every_client_without_keys() -> None:
    scopes = ReuseScopes("shared")
    assert scopes.of("", "") == scopes.of("", "whatever") and scopes.of("", "").token == ""
    assert scopes.of("alice", "") == scopes.of("alice", "x") != scopes.of("bob", "")
    assert scopes.of("alice", "") != scopes.of("", "")  # keys still scope their own


def test_reuse_off_has_no_scope_and_no_salt() -> None:
    scopes = ReuseScopes("off")
    assert scopes.of("", "") == scopes.of("alice", "") == NO_SCOPE and NO_SCOPE.salt == ""


def test_salts_hash_the_scope() -> None:
    scope = ReuseScopes("client").of("alice", "")
    assert scope.salt and "alice" not in scope.salt


def test_an_overlong_token_is_refused_without_echoing_it() -> None:
    with pytest.raises(InvalidRequest) as err:
        ReuseScopes("client").of("", "z" * (MAX_REUSE_TOKEN + 1))
    assert "zzzz" not in str(err.value)
