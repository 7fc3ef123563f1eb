"""One exception type for every user-facing failure.

The CLI turns a :class:`CheckpointError` into a one-line message and exit
code 2; anything else is a bug and keeps its traceback.
"""


class CheckpointError(Exception):
    """Bad input, or an output that cannot be written safely."""
