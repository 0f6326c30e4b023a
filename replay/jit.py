"""How the replay model's compiled loops are built (numba, cached on disk after the first run).

``LOOP`` is for the loops that walk a whole trace and allocate their working arrays once.
``HELPER`` is for the small functions they call per instance or per read: these allocate
nothing, so they are built without reference counting (``_nrt=False``, as numba builds its own
string helpers); otherwise every call pays an atomic increment and decrement per array argument.
``STAGE`` is for the stages of one instance the loop calls (the weight jobs, the read plan, the
reader pool, the prefetcher and its admission, serving one read): numba inlines them into the
loop, so a call does not pass the hundreds of machine words its grouped arguments flatten to
(numba passes a named tuple of arrays field by field). An inlined stage is typed inside its
caller, where a None argument's branches are not pruned: code that reads an optional argument
(``if x is None``) goes in a ``HELPER`` that takes it. The replay benchmark models about
1.4-1.5x the requests/s with them inlined (docs/BENCHMARKS.md); the first build takes about a
second longer.
``error_model="numpy"`` drops division-by-zero checks: every divisor is a validated size or rate.

The first run on a machine compiles them (10-75 s, depending on the machine and its load);
later runs load the cached build in well under a second. :func:`compile_notice` says so while it
happens and shows progress, so a first run is never a silent wait.
"""

from __future__ import annotations

import contextlib
import sys

from numba.core import event
from tqdm import tqdm

LOOP = dict(cache=True, error_model="numpy")
HELPER = dict(LOOP, _nrt=False)
STAGE = dict(HELPER, inline="always")


class _CompileProgress(event.Listener):
    """Counts numba compilations; the first one prints the notice and opens a progress bar."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.bar = None

    def on_start(self, ev) -> None:
        if not self.enabled:
            return
        if self.bar is None:
            print("relayout: compiling the replay model (first run on this machine; cached for later runs)",
                  file=sys.stderr, flush=True)
            self.bar = tqdm(desc="compile", unit=" functions", file=sys.stderr, disable=None)
        self.bar.update(1)

    def on_end(self, ev) -> None:
        pass

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@contextlib.contextmanager
def compile_notice(enabled: bool = True):
    """While inside, any compilation of the model says so on stderr and shows progress.

    Loading the cached build compiles nothing, so then nothing is printed.
    """
    listener = _CompileProgress(enabled)
    event.register("numba:compile", listener)
    try:
        yield
    finally:
        event.unregister("numba:compile", listener)
        listener.close()
