"""The loader pool's handoff: what handing a block of loads to colibrì's PIPE=1 pool costs.

Under ``PIPE=1`` colibrì keeps ``PIPE_WORKERS`` loader threads parked on a condition variable
(``pipe_worker``). For each block of misses the compute thread publishes the loads and
broadcasts under the pool's mutex (``pipe_dispatch``); every parked loader wakes, the first to
claim a load runs it, and a loader that finds the block drained parks again. With colibrì's
hot-thread tuning (Linux, unless ``COLI_NO_OMP_TUNE``) the loaders inherit the compute thread's
one core while the OpenMP team's other threads spin on the other cores, so all of this runs on
the compute thread's core: beyond its loads' own time a block costs the first loader's wake-up
and every futile wake (``replay.model.demand``: the handoff delays the block's loads and takes
that core).

:func:`loader_handoff` measures it on this machine the same way: native threads (compiled by
numba, calling the C library's ``pthread`` functions) in a child process, the calling thread and
a pool of ``n`` threads bound to one core, one spinning thread bound to each other core; per
block, a pause of :data:`BLOCK_GAP_SECONDS` (the compute between blocks), then one empty load
published and broadcast under the mutex, then ``sched_yield`` until its flag is set (colibrì's
default ``pipe_wait``). The block's time is then its handoff alone; the median over
:data:`BLOCKS` blocks after :data:`WARMUP_BLOCKS`, for each ``n`` in :data:`POOL_SIZES`.
Seconds. Linux with glibc (or another C library whose zeroed mutex and condition variable are
valid) only: elsewhere there is no measurement, and the model takes no handoff.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys

import numpy as np

POOL_SIZES = (1, 2, 4, 8, 16)
"""Loader pool sizes measured (colibrì clamps ``PIPE_WORKERS`` to 1-16; its default is 8)."""
BLOCKS = 400
"""Blocks timed per pool size, after :data:`WARMUP_BLOCKS`."""
WARMUP_BLOCKS = 50
"""Blocks run first and not timed (threads placed, caches warm)."""
BLOCK_GAP_SECONDS = 500e-6
"""The compute thread's busy time before each block (s): the matmuls between two layers' loads."""
TIMEOUT_SECONDS = 120.0
"""How long the child process may take, compiling included, before it is stopped."""

# The shared words (int64) of the probe: control, per-thread timespecs, the mutex and condition
# variable's addresses.
_GEN, _NEXT, _JOBS, _STOP, _MUTEX, _COND, _READY = 0, 1, 2, 3, 4, 5, 6
_CLOCK = 16                    # timespec pairs from here, one per thread slot
_SLOTS = 64
_WORDS = _CLOCK + 2 * _SLOTS
_MAIN_SLOT = 0
_MONOTONIC = 1


def _native():
    """The compiled probe: (worker, spinner, blocks) and the C functions the caller needs (create,
    join, lock, unlock, broadcast). Built in the child process only."""
    from numba import carray, cfunc, njit, types
    from numba.extending import intrinsic

    libc = ctypes.CDLL(None)
    word = ctypes.c_size_t

    def c_function(name, args):
        f = getattr(libc, name)
        f.argtypes, f.restype = args, ctypes.c_int
        return f

    lock = c_function("pthread_mutex_lock", [word])
    unlock = c_function("pthread_mutex_unlock", [word])
    wait = c_function("pthread_cond_wait", [word, word])
    broadcast = c_function("pthread_cond_broadcast", [word])
    yield_cpu = c_function("sched_yield", [])
    clock = c_function("clock_gettime", [ctypes.c_int, word])

    @intrinsic
    def words_at(typingctx, address):
        sig = types.CPointer(types.int64)(address)

        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(signature.return_type))
        return sig, codegen

    @njit(inline="always")
    def now(s, address, slot):
        clock(_MONOTONIC, address + 8 * (_CLOCK + 2 * slot))
        return s[_CLOCK + 2 * slot] * 1_000_000_000 + s[_CLOCK + 2 * slot + 1]

    @cfunc(types.uintp(types.uintp))
    def worker(address):
        s = carray(words_at(address), (_WORDS,))
        seen = 0
        while True:
            lock(s[_MUTEX])
            while s[_GEN] == seen and s[_STOP] == 0:
                wait(s[_COND], s[_MUTEX])
            seen = s[_GEN]
            if s[_STOP] != 0:
                unlock(s[_MUTEX])
                return 0
            while s[_NEXT] < s[_JOBS]:
                j = s[_NEXT]
                s[_NEXT] = j + 1
                unlock(s[_MUTEX])
                s[_READY + j] = 1                # an empty load
                lock(s[_MUTEX])
            unlock(s[_MUTEX])

    @cfunc(types.uintp(types.uintp))
    def spinner(address):
        s = carray(words_at(address), (_WORDS,))
        turns = 0
        while s[_STOP] == 0:
            clock(_MONOTONIC, address + 8 * (_CLOCK + 2 * (_SLOTS - 1)))
            turns += 1
        return turns

    @njit
    def blocks(address, gap_ns, out):
        s = carray(words_at(address), (_WORDS,))
        for k in range(len(out)):
            t = now(s, address, _MAIN_SLOT)
            end = t + gap_ns
            while t < end:
                t = now(s, address, _MAIN_SLOT)
            lock(s[_MUTEX])
            s[_READY] = 0
            s[_JOBS] = 1
            s[_NEXT] = 0
            s[_GEN] += 1
            t0 = now(s, address, _MAIN_SLOT)
            broadcast(s[_COND])
            unlock(s[_MUTEX])
            while s[_READY] == 0:
                yield_cpu()
            out[k] = now(s, address, _MAIN_SLOT) - t0
        return 0

    create = c_function("pthread_create", [word, word, word, word])
    join = c_function("pthread_join", [ctypes.c_ulong, word])
    return worker, spinner, blocks, (create, join, lock, unlock, broadcast)


def _probe(pool_sizes: tuple[int, ...], blocks: int) -> list[float]:
    """In this (child) process: the median handoff (s) for each pool size."""
    worker, spinner, run_blocks, (create, join, lock, unlock, broadcast) = _native()
    cpus = sorted(os.sched_getaffinity(0))
    compute_core, others = cpus[0], cpus[1:]
    medians = []
    for n in pool_sizes:
        s = np.zeros(_WORDS, np.int64)
        sync = np.zeros(256, np.uint8)                   # a zeroed mutex and condition variable
        s[_MUTEX], s[_COND] = sync.ctypes.data, sync.ctypes.data + 128
        threads = np.zeros(n + len(others), np.uint64)
        started = 0
        try:
            for core in others:                      # the OpenMP team's spinning threads, one per other core
                os.sched_setaffinity(0, {core})
                if create(threads.ctypes.data + 8 * started, 0, spinner.address, s.ctypes.data) != 0:
                    raise OSError("pthread_create failed")
                started += 1
            os.sched_setaffinity(0, {compute_core})      # the pool inherits the compute thread's core
            for _ in range(n):
                if create(threads.ctypes.data + 8 * started, 0, worker.address, s.ctypes.data) != 0:
                    raise OSError("pthread_create failed")
                started += 1
            out = np.zeros(WARMUP_BLOCKS + blocks, np.int64)
            run_blocks(s.ctypes.data, int(BLOCK_GAP_SECONDS * 1e9), out)
            medians.append(float(np.median(out[WARMUP_BLOCKS:])) / 1e9)
        finally:
            lock(int(s[_MUTEX]))
            s[_STOP] = 1
            broadcast(int(s[_COND]))
            unlock(int(s[_MUTEX]))
            for i in range(started):
                join(int(threads[i]), 0)
            os.sched_setaffinity(0, set(cpus))
    return medians


def loader_handoff(pool_sizes: tuple[int, ...] = POOL_SIZES, blocks: int = BLOCKS) -> dict | None:
    """Measure the loader pool's handoff on this machine (module docstring), in a child process.

    Returns
    -------
    ``{"workers": [n, ...], "seconds": [handoff, ...], "cores": C, "method": text}``, or None where
    it cannot be measured (not Linux, or the child failed: its reason is in ``"error"`` of a
    dict with empty lists).
    """
    if not sys.platform.startswith("linux") or not hasattr(os, "sched_setaffinity"):
        return None
    cmd = [sys.executable, "-m", __name__, json.dumps({"pool_sizes": list(pool_sizes), "blocks": blocks})]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_SECONDS, check=False)
    except subprocess.TimeoutExpired:
        return {"workers": [], "seconds": [], "error": f"the probe took over {TIMEOUT_SECONDS:.0f} s and was stopped"}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"workers": [], "seconds": [], "error": f"the probe failed: {tail}"}
    seconds = json.loads(lines[-1])
    return {"workers": list(pool_sizes), "seconds": seconds, "cores": len(os.sched_getaffinity(0)),
            "method": f"median over {blocks} blocks of one empty load, after {WARMUP_BLOCKS}; the pool and the "
                      f"compute thread on one core, one spinning thread on each other core; "
                      f"{BLOCK_GAP_SECONDS * 1e6:.0f} us of compute before each block"}


if __name__ == "__main__":
    args = json.loads(sys.argv[1])
    print(json.dumps(_probe(tuple(args["pool_sizes"]), int(args["blocks"]))))
