"""What is trained: analytic, torch and named models, precision, optimizers, tensor parallelism."""
