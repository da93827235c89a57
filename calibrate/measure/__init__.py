"""Measuring torch models and this machine: layer profiles, links, collectives, executor runs."""
