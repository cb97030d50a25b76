"""Errors a user can fix.

:class:`UsageError` is raised for bad input (config, flags, data files, run
directories, checkpoints). The command line prints its message as one line and
exits with code 2, without a traceback; every message says what to change.

:class:`TrainingStopped` ends a run on purpose (non-finite values with
``train.on_nonfinite = "stop"``, ranks that disagree or diverge): one line naming
the rank and step, exit code 1.
"""


class UsageError(Exception):
    """Bad input from the user; the message names the problem and the fix."""


class DataError(UsageError):
    """A data file is missing, empty, unreadable or fails its checksum."""


class TrainingStopped(Exception):
    """The run was stopped by a check; the message names the rank(s), the step and the cause.
    ``every_rank``: every rank reached the same decision (a collective check), so rank 0 alone says it."""

    def __init__(self, message: str, every_rank: bool = False) -> None:
        super().__init__(message)
        self.every_rank = every_rank
