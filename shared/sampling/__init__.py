"""The logits processors and samplers, in two implementations that are tested equal:
edge_numpy.py runs on the edge (numpy only, so a llama.cpp or n-gram edge never imports torch),
verifier_torch.py runs in the verifier (torch, batched rows). tests/unit/shared/test_sampling_parity.py
holds them to the same results."""
