"""Drafting on the edge: the draft model's runtimes (llama.cpp, transformers), the model,
n-gram and hybrid drafters, the gating signals and the k policies (how many tokens a round drafts)."""
