"""The CPU host's quirks, fenced off: its speed drift, what a device loses after a wait, and how far
calibrations taken at different moments disagree."""
