"""The exceptions every user-facing failure raises.

:class:`CheckpointError` is the base (and the error for bad input); the
subclasses let callers tell three cases apart without matching message
text. The CLI turns any of them into a one-line message and exit code 2;
anything else is a bug and keeps its traceback.
"""


class CheckpointError(Exception):
    """Bad input, or an output that cannot be written safely."""


class OutputExists(CheckpointError):
    """The output (or its manifest) exists, and ``overwrite`` was not given."""


class InputChanged(CheckpointError):
    """An input changed or was replaced while it was read: nothing was written."""


class NotSupported(CheckpointError):
    """The command does not apply to this family of checkpoint (the message names the family)."""
