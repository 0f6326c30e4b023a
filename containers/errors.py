"""The one exception type for bad input.

Every problem a user can cause (a malformed header, a truncated file, a plan for another
container, a full disk) is raised as :class:`InputError` with a one-line message that names the
file and the problem. The CLI prints it and exits with status 2; it never shows a traceback.
"""

from __future__ import annotations

import os


class InputError(Exception):
    """A problem with the user's input, reported in one line."""

    def __init__(self, where: str | os.PathLike | None, problem: str):
        self.where = None if where is None else str(where)
        self.problem = problem
        super().__init__(f"{self.where}: {problem}" if self.where else problem)
