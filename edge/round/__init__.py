"""One speculative generation on the edge. session.py owns a generation's tokens, counters and
round records and runs the round loop (draft, verify, commit); blocks.py, provisional.py,
overlap.py and recovery.py are the parts it consults; generate.py holds the entry points and the
baselines (cloud_only, edge_only); generation.py what a generation is configured with and yields."""
