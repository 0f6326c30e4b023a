"""How the replay model's compiled loops are built (numba, cached on disk after the first run).

``LOOP`` is for the loops that walk a whole trace and allocate their working arrays once;
``HELPER`` for the small functions they call per instance or per read, built without reference
counting (``_nrt=False``: they allocate nothing, so a call pays no atomic increment and decrement
per array argument); ``STAGE`` for the stages of one instance, inlined into the loop so a call
does not pass the hundreds of machine words its grouped arguments flatten to (an inlined stage is
typed inside its caller, where a None argument's branches are not pruned: code that reads an
optional argument goes in a ``HELPER`` that takes it). ``error_model="numpy"`` drops
division-by-zero checks: every divisor is a validated size or rate. :func:`fetch_lines` asks the
CPU to load an array row into its caches ahead of use (a hint that changes no value), and
:func:`trailing_zeros` is the CPU's count of trailing zero bits. Where the build shipped with the
package does not fit (:mod:`replay.compiled`: other numba, CPython or sources), the first run on a
machine compiles the model (one to two minutes on 2 idle cores; later runs load the cached build
in well under a second), and :func:`compile_notice` says so while it happens.
"""

from __future__ import annotations

import contextlib
import sys

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils, event
from numba.extending import intrinsic

from containers.progress import LOG_INTERVAL_S, Heartbeat, is_terminal, progress_bar

LOOP = dict(cache=True, error_model="numpy")
HELPER = dict(LOOP, _nrt=False)
STAGE = dict(HELPER, inline="always")

CACHE_LINE = 64
"""Bytes per CPU cache line (x86-64 and most ARM cores)."""


class _CompileProgress(event.Listener):
    """Counts numba compilations; the first one prints the notice and opens a progress bar whose
    elapsed time a heartbeat keeps moving while LLVM optimises (a minute can pass between two
    compiled functions)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.bar = None
        self.heartbeat = None

    def on_start(self, ev) -> None:
        if not self.enabled:
            return
        if self.bar is None:
            print("relayout: compiling the replay model with numba, once on this machine (up to 1-2 minutes on 2 cores; "
                  "cached for later runs)", file=sys.stderr, flush=True)
            self.bar = progress_bar(desc="compile", unit=" functions", bar_format="{desc}: {n} functions compiled, {elapsed} elapsed")
            self.heartbeat = Heartbeat(self.bar, 1.0 if is_terminal() else LOG_INTERVAL_S)
        self.bar.update(1)

    def on_end(self, ev) -> None:
        pass

    def close(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
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


@intrinsic
def _prefetch_line(typingctx, a, offset):
    """Ask the CPU to bring the cache line holding byte ``offset`` of array ``a``'s data into
    its caches (LLVM's ``prefetch``: a hint, no effect on any value; it never faults)."""
    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        i8p = ir.IntType(8).as_pointer()
        ptr = builder.gep(builder.bitcast(data, i8p), [args[1]])
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                            "llvm.prefetch.p0i8")
        builder.call(fn, [ptr, i32(0), i32(3), i32(1)])      # read, keep in all cache levels, data
        return context.get_dummy_value()
    return types.void(a, types.intp), codegen


@njit(**STAGE)
def fetch_lines(a):
    """Bring every cache line of the contiguous array ``a``'s data (``a.nbytes`` bytes) into
    the CPU caches ahead of use; meant for rows of a few lines."""
    n = a.nbytes
    for off in range(0, n, CACHE_LINE):
        _prefetch_line(a, off)
    if n > 0:
        _prefetch_line(a, n - 1)


@intrinsic
def trailing_zeros(typingctx, x):
    """The number of trailing zero bits of the int64 ``x`` (LLVM's ``cttz``: one instruction on
    x86-64 and ARM64): ``log2(x)`` when ``x`` is a power of two, so ``y >> trailing_zeros(x)`` is
    ``y // x`` and ``y & (x - 1)`` is ``y % x`` for every int64 ``y`` (floor division, as
    Python's). 64 for ``x == 0``."""
    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i64, [i64, ir.IntType(1)]), "llvm.cttz.i64")
        return builder.call(fn, [args[0], ir.IntType(1)(0)])       # defined (64) for 0
    return types.int64(types.int64), codegen
