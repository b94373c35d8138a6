"""Loop pieces: config schema, optimizer and schedule, checkpoints, logging, the loop."""
