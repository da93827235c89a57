"""The schedule as data: per-stage action lists, torch's schedule CSV, bubbles, micro-batches."""
