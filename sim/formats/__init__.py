"""The data formats every part shares: the plan file, the timeline and the costs file."""
