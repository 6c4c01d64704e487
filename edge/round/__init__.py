"""One speculative generation on the edge: the round loop (draft, verify, commit), the
baselines (cloud_only, edge_only) and what a generation is configured with and yields."""
