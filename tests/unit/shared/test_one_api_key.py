"""A single key given as a flag's value (edge-agent serve --serve-api-key): the whole value is
the key (spaces, `#` and a `sha256:` start included), named as that key's bare hash line in a
keys file is."""

import hashlib

import pytest

from shared.api_keys import ApiKeys
from shared.errors import Unauthenticated


@pytest.mark.parametrize("key", ["plain", "two words", "a#b", "sha256:" + "0" * 64])
def test_the_whole_value_is_the_key(key: str) -> None:
    digest = hashlib.sha256(key.encode()).hexdigest()
    in_a_file = ApiKeys.parse(f"sha256:{digest}")
    assert ApiKeys.one(key).principal(f"Bearer {key}") == in_a_file.principal(f"Bearer {key}") == f"key-{digest[:8]}"
    for wrong in (None, "Bearer", f"Bearer {key}x", f"Basic {key}"):
        with pytest.raises(Unauthenticated):
            ApiKeys.one(key).caller(wrong)
