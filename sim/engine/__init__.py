"""The SimPy step: one replica's pipeline, the replicas' all-reduce, placement and memory."""
