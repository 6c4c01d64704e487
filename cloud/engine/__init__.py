"""The verifier's model step: a forward pass over several sessions' new tokens, each after its
own KV, and the KV itself (transformers.py runs it on a transformers model)."""
