"""Mixtures of experts: their configs read, their layers priced (routed and shared experts, latent attention,
multi-token prediction), and the workload with its total and active parameters."""
