"""Data and tensor parallelism: replicas and their all-reduce, tensor-parallel styles, sharing."""
