"""Checkpoints and the state files a run saves and resumes from."""
