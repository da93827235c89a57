"""One rank's pipeline: a stage's actions, the schedule's loop, data, memory and the report."""
