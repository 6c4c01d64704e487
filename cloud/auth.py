"""API keys of the verifier (--api-keys-file). The file's format and the key check live in
shared/api_keys.py, shared with the edge's served endpoint (--serve-api-keys-file)."""

from shared.api_keys import ApiKeys, Caller

__all__ = ["ApiKeys", "Caller"]
