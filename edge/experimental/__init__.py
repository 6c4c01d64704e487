"""Lossy and research extras, reached only when their flags are on: committing easy blocks
without the cloud (--local-commit). Every token they make final is counted and reported."""
