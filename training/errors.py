"""Errors that end a run with one clear line (train.py prints them without a traceback)."""


class ConfigError(Exception):
    """A setting that cannot work: the message names it and what would be valid."""


class CheckpointError(Exception):
    """A checkpoint that cannot be resumed: the message names the file and why."""


class TrainingError(Exception):
    """Training cannot go on (a non-finite step under trainer.nonfinite=stop, a broken model)."""
