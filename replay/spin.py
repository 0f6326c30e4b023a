"""Waiting on the clock without the interpreter lock: the harness's emulated compute.

The measuring harness (:mod:`replay.measure`) emulates the runtime's matmuls by waiting, and
spins through the last stretch of each wait, as a sleep on a virtual machine overshoots by
30-90 us. A spin in Python takes the interpreter lock between its clock reads, and the
harness's reader threads need that lock between their preads: a coalesced run's scale jobs,
queued behind its one weight read, run while the compute thread emulates the run's first
matmuls. A three-pread job submitted during 47 us of emulated compute finished 39 us after
submission beside a Python spin and 34 us beside this one (8 us beside a blocked thread: most
of the rest is waking a thread on another CPU; ``docs/BENCHMARKS.md``, "The harness's own
waits"). :func:`spin_until` spins in compiled code with the lock released.

It reads ``CLOCK_MONOTONIC`` through the C library, the clock of ``time.perf_counter_ns`` on
Linux; where that is not so (or there is no C library to call, or its ``timespec`` is not two
64-bit fields), :func:`spin_until` spins in Python as before.
"""

from __future__ import annotations

import ctypes
import sys
import time

import numpy as np
from numba import njit

CLOCK_MONOTONIC = 1
"""Linux's clock id for ``CLOCK_MONOTONIC``."""


def _clock_gettime():
    """The C library's ``clock_gettime``, when it is the clock ``time.perf_counter_ns`` reads; else None."""
    if not sys.platform.startswith("linux") or ctypes.sizeof(ctypes.c_long) != 8 or \
            time.get_clock_info("perf_counter").implementation != "clock_gettime(CLOCK_MONOTONIC)":
        return None
    try:
        fn = ctypes.CDLL(None).clock_gettime
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


_CLOCK = _clock_gettime()

if _CLOCK is not None:
    _clock = _CLOCK

    @njit(nogil=True)
    def _spin(deadline_ns, ts):
        while True:
            _clock(CLOCK_MONOTONIC, ts.ctypes)
            if ts[0] * 1_000_000_000 + ts[1] >= deadline_ns:
                return


_TIMESPEC = np.zeros(2, dtype=np.int64)      # struct timespec: seconds, nanoseconds (64-bit Linux)


def spin_until(deadline_ns: int) -> None:
    """Return once ``time.perf_counter_ns()`` has reached ``deadline_ns`` (ns), holding the
    interpreter lock only to enter and leave. Called from one thread at a time (the compute
    thread); the first call compiles (about 0.3 s: ctypes calls keep numba from caching it), so
    call it once before anything is timed."""
    if _CLOCK is None:
        while time.perf_counter_ns() < deadline_ns:
            time.sleep(0)
        return
    _spin(deadline_ns, _TIMESPEC)
