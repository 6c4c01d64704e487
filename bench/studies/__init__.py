"""One-off studies, each behind one table of docs/results.md: prefill stall, two API keys,
prefix isolation across clients, serve overhead and KV layout timing (`python -m
bench.studies.NAME --help`)."""
