"""Progress bars that stay readable in a terminal and in a log.

On a terminal, :func:`progress_bar` is an ordinary tqdm bar on stderr. When stderr is not a
terminal (a pipe, a log file, CI), the same bar writes whole lines instead, at most one every
:data:`LOG_INTERVAL_S` seconds and none for work that ends sooner, so a long command run under
``nohup`` or ``tee`` still shows it is alive without filling the log with carriage returns.
"""

from __future__ import annotations

import sys
import threading

from tqdm import tqdm

LOG_INTERVAL_S = 10.0
"""Seconds between progress lines when stderr is not a terminal, and before the first one."""


class _Lines:
    """A text stream that turns tqdm's carriage-return updates into whole lines (each once)."""

    def __init__(self, stream):
        self.stream = stream
        self.last = ""

    def write(self, text: str) -> None:
        line = text.replace("\r", "").strip()
        if line and line != self.last:
            self.last = line
            self.stream.write(line + "\n")

    def flush(self) -> None:
        self.stream.flush()


def is_terminal(stream=None) -> bool:
    stream = sys.stderr if stream is None else stream
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def progress_bar(iterable=None, *, enabled: bool = True, **kwargs) -> tqdm:
    """A tqdm bar on stderr: drawn in place on a terminal, whole lines every
    :data:`LOG_INTERVAL_S` seconds elsewhere; ``enabled=False`` shows nothing.

    Parameters
    ----------
    iterable : iterable, optional
        What to iterate over, as for ``tqdm``.
    enabled : bool
        ``False`` gives a bar that prints nothing (the caller asked for no progress).
    **kwargs
        Passed to ``tqdm`` (``total``, ``desc``, ``unit``, ``unit_scale``, ``leave``, ...).
    """
    if not enabled:
        return tqdm(iterable, disable=True, **kwargs)
    if is_terminal():
        return tqdm(iterable, file=sys.stderr, **kwargs)
    return tqdm(iterable, file=_Lines(sys.stderr), delay=LOG_INTERVAL_S, mininterval=LOG_INTERVAL_S,
                ascii=True, ncols=100, **kwargs)


class Heartbeat:
    """Refreshes a bar every ``interval`` seconds from a daemon thread, so a step with no updates
    for a long time (a compile) still shows its elapsed time; :meth:`stop` ends it."""

    def __init__(self, bar: tqdm, interval: float):
        self.bar = bar
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(interval,), daemon=True)
        self.thread.start()

    def _run(self, interval: float) -> None:
        while not self.done.wait(interval):
            self.bar.refresh()

    def stop(self) -> None:
        self.done.set()
        self.thread.join()


__all__ = ["Heartbeat", "LOG_INTERVAL_S", "is_terminal", "progress_bar"]
