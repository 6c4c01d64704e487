"""Tools around the product, not run by the edge or the verifier in serving: fetching and
converting the models (model_store), a fault-injecting proxy for tests and benchmarks
(netproxy), the protobuf code generator (protogen), and scripts for measurements."""
