"""The errors a user sees as one line (`error: ...`, exit status 2) and the one a failed rank raises (exit 1).

Each domain defines its own error class beside its code; this is the one list the entry points and the rank
processes agree on.
"""

from __future__ import annotations

from models.config import ConfigError
from moe.checkpoint.files import CheckpointError
from moe.parallel.placement import PlacementError


class RankFailure(RuntimeError):
    """A rank died or raised; the message names the rank and the cause, `detail` holds its traceback."""

    def __init__(self, message: str, detail: str = "") -> None:
        super().__init__(message)
        self.detail = detail


USER_ERRORS: tuple[type[Exception], ...] = (CheckpointError, PlacementError, ConfigError, ValueError,
                                            FileNotFoundError)


def first_line(e: BaseException) -> str:
    """An error's message as one line (its first; "" for none), as a rank reports it."""
    return str(e).splitlines()[0] if str(e) else ""


__all__ = ["CheckpointError", "ConfigError", "PlacementError", "RankFailure", "USER_ERRORS", "first_line"]
