"""Point-to-point sends between stages and the host's shared-memory routes."""
