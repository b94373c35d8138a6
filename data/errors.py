"""The one exception type of the data pipeline."""


class DataError(Exception):
    """One-line user-facing message naming the file or the setting and what would be valid."""
