"""The CPU host's quirks, fenced off: its speed drift, what a device loses after a wait and the warm-up
fitted for it, and how far calibrations taken at different moments disagree."""
