"""The edge's way to the verifier: the gRPC client, several replicas behind one name
(rendezvous order), and the local verifier child started when no --cloud is given."""
