"""The ``relayout`` command line: :func:`main` runs one command and turns every way it can end
into an exit status and at most one line on stderr. Every user error is that one line and exit
status 2 (see :class:`containers.errors.InputError`). The parser is :mod:`relayout.cli.parser`;
the commands are in the ``commands_*`` modules, one per command group.
"""

from __future__ import annotations

import os
import sys
import threading

from containers.atomic import describe_os_error
from containers.errors import InputError

from .parser import build_parser

DEBUG_VARIABLE = "RELAYOUT_DEBUG"


def _interrupted(signum, frame):
    """SIGTERM ends a command the way Ctrl-C does (one line, exit 130)."""
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    """Run one command.

    Python warnings raised while a command runs are printed as one ``relayout: warning:`` line
    each when it succeeds, and not beside its error line when it fails.

    Parameters
    ----------
    argv : list of str, optional
        The command's words after ``relayout`` (default: ``sys.argv[1:]``).

    Returns
    -------
    int
        The exit status: 0 done (``replay --strict`` and ``replay --container --out``: 3 the gate
        failed, 4 too little evidence), 2 a problem with the input (one line on stderr), 1 an
        internal error (one line asking for a bug report; the traceback with ``RELAYOUT_DEBUG=1``),
        130 interrupted (Ctrl-C or SIGTERM).
    """
    import signal
    import warnings

    from relayout import AS_COMMAND
    from relayout import quiet_interrupts

    command = "relayout"
    previous = signal.getsignal(signal.SIGTERM)
    if previous == signal.SIG_DFL:
        try:
            signal.signal(signal.SIGTERM, _interrupted)
        except ValueError:                  # not the main thread: signals stay as they are
            previous = None
    try:
        if AS_COMMAND and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
            signal.signal(signal.SIGINT, signal.default_int_handler)   # Ctrl-C from here on: KeyboardInterrupt, cleaned up
        with warnings.catch_warnings(record=True) as caught:
            args = build_parser().parse_args(argv)
            command = f"relayout {args.command}" + (f" {args.what}" if getattr(args, "what", None) else "")
            status = args.func(args)
        for line in dict.fromkeys(str(w.message).splitlines()[0] for w in caught if str(w.message)):
            print(f"relayout: warning: {line[:300]}", file=sys.stderr)
        return status
    except InputError as exc:
        print(f"relayout: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{command}: interrupted (anything half-written is kept aside, never under its final name)", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 1
    except OSError as exc:
        if os.environ.get(DEBUG_VARIABLE) == "1":
            raise
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"relayout: error: {where}{describe_os_error(exc)}", file=sys.stderr)
        return 2
    except Exception as exc:
        if os.environ.get(DEBUG_VARIABLE) == "1":
            raise
        print(f"{command}: internal error ({type(exc).__name__}: {str(exc)[:200]}); this is a bug, please report it "
              f"with the output of {DEBUG_VARIABLE}=1 {command} ...", file=sys.stderr)
        return 1
    finally:
        if previous == signal.SIG_DFL:
            signal.signal(signal.SIGTERM, previous)
        if AS_COMMAND and threading.current_thread() is threading.main_thread():
            quiet_interrupts()          # a Ctrl-C while the interpreter exits: one line, no traceback
