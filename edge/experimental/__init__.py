"""Lossy and research extras, reached only when their flags are on: committing easy blocks
without the cloud (--local-commit, local_commit.py), making a timed-out token final
(--accept-unverified, accept_unverified.py) and MC-dropout gating signals (--mc-passes,
mc_dropout.py). Each decides; the round loop commits and counts every token they make final."""
