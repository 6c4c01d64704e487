"""Repository tools, run from a checkout and not installed: a fault-injecting proxy for tests
and benchmarks (`python -m tools.netproxy`), the protobuf code generator (`python -m
tools.protogen`), and the scripts of the measurements."""
