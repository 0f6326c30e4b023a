"""relayout: co-activation layouts for MoE expert containers streamed from NVMe."""

import os
import sys

import _signal          # the C module: ``signal`` imports ``enum``, which takes long enough to be interrupted


def _interrupted(signum, frame) -> None:
    """Ctrl-C while the command line starts (imports) or after its command ended: nothing is being
    written, so the process ends at once, with one line and status 130."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    os.write(2, b"relayout: interrupted\n")
    os._exit(130)


def quiet_interrupts() -> None:
    """Make Ctrl-C end the process with one line and status 130 (no traceback), outside a command's work."""
    if _signal.getsignal(_signal.SIGINT) is not _signal.SIG_IGN:
        _signal.signal(_signal.SIGINT, _interrupted)


def _started_as_command() -> bool:
    """This process is the ``relayout`` command (console script or ``python -m relayout``), not a library user."""
    argv = list(getattr(sys, "orig_argv", sys.argv))
    if sys.argv and os.path.basename(sys.argv[0]) == "relayout":
        return True
    return any(a == "-m" and b == "relayout" for a, b in zip(argv, argv[1:]))


AS_COMMAND = _started_as_command()
"""This process runs the command line (then it, not a host program, owns Ctrl-C)."""
if AS_COMMAND:
    quiet_interrupts()

from containers import __version__  # noqa: E402  (after the handler: this import is interruptible)

__all__ = ["AS_COMMAND", "__version__", "quiet_interrupts"]
