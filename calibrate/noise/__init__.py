"""The CPU host's quirks, fenced off: its speed drift and what a device loses after a wait."""
