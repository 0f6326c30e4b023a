"""Running independent tasks serially or on a Dask cluster (``dask.distributed``).

Sweeps (one gate per regime cell) and pooled counting (one task per trace file) are many
independent calls of one function. An :class:`Executor` runs them:

* ``map(function, [args, ...])`` returns ``[function(*args), ...]`` in the order given;
* ``map_reduce(function, [args, ...], combine)`` returns ``combine`` folded over the results in
  the order given (a balanced tree of pairwise ``combine(left, right)`` calls, so ``combine``
  must be associative; the result is the same as the serial left fold for exact combines such
  as adding counts), without collecting every result in one place first;
* ``share(value)`` returns a handle to pass as an argument instead of ``value``, so a large
  argument common to every task (a trace, a plan) travels to each machine once.

:class:`SerialExecutor` runs everything in this process, in order. :class:`DaskExecutor` submits
to a ``distributed.Client``: a local cluster on this machine's cores (one single-threaded worker
process per core; the replay model holds the GIL) or an existing scheduler by address. Task
functions and their arguments must be picklable: module-level functions, dataclasses, arrays.
Results are identical on both (each task is a deterministic function of its arguments; floats
travel bit for bit).

An :class:`~containers.errors.InputError` raised in a task reaches the caller as the same
one-line error, wherever the task ran.

:func:`open_executor` picks one from a ``--scheduler`` value: ``local`` (the default: a local
cluster, or serial when dask is not installed), ``none`` (serial) or a scheduler address
(``tcp://host:8786``).
"""

from __future__ import annotations

import contextlib
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from containers.progress import progress_bar

from containers.errors import InputError

SERIAL = "none"
"""``--scheduler`` value for the serial path (no Dask)."""
LOCAL = "local"
"""``--scheduler`` value for a local cluster on this machine's cores (the default)."""
CONNECT_GRACE_S = 2.0
"""Seconds a connection attempt is given beyond its timeout to report before it is abandoned."""


@dataclass(frozen=True)
class _Outcome:
    """A task's result, or the input error it raised (InputError itself does not pickle)."""

    value: Any = None
    where: str | None = None
    problem: str | None = None

    def unwrap(self):
        if self.problem is not None:
            raise InputError(self.where, self.problem)
        return self.value


def _run(function: Callable, *args) -> _Outcome:
    try:
        return _Outcome(function(*args))
    except InputError as e:
        return _Outcome(None, e.where, e.problem)


def _combine(combine: Callable, left: _Outcome, right: _Outcome) -> _Outcome:
    if left.problem is not None:
        return left
    if right.problem is not None:
        return right
    return _run(combine, left.value, right.value)


class Executor(ABC):
    """Runs independent tasks; see the module doc. ``name`` says where, ``workers`` how many
    run at once."""

    name = "executor"
    workers = 1

    @abstractmethod
    def map(self, function: Callable, tasks: Sequence[tuple], desc: str = "tasks") -> list:
        """``[function(*args) for args in tasks]``, in order; ``desc`` labels the progress bar."""

    @abstractmethod
    def map_reduce(self, function: Callable, tasks: Sequence[tuple], combine: Callable, desc: str = "tasks"):
        """``combine`` (associative) over ``function(*args)`` of every task, in task order."""

    def share(self, value):
        """A handle to pass to tasks instead of ``value`` (the value itself when serial)."""
        return value


class SerialExecutor(Executor):
    """Every task in this process, in order."""

    name = "serial"

    def map(self, function, tasks, desc="tasks"):
        return [_run(function, *args).unwrap() for args in progress_bar(tasks, desc=desc, leave=False)]

    def map_reduce(self, function, tasks, combine, desc="tasks"):
        """A left fold as the results come (one result held at a time); equal to the tree the
        Dask executor builds because ``combine`` is associative."""
        if not tasks:
            raise ValueError("map_reduce needs at least one task")
        total = None
        for i, args in enumerate(progress_bar(tasks, desc=desc, leave=False)):
            value = _run(function, *args).unwrap()
            total = value if i == 0 else _run(combine, total, value).unwrap()
        return total


def _tree(items: list, pair: Callable):
    """Combine ``items`` pairwise, neighbours first, keeping their order: ((a b) (c d)) e."""
    while len(items) > 1:
        items = [pair(items[i], items[i + 1]) if i + 1 < len(items) else items[i] for i in range(0, len(items), 2)]
    return items[0]


class DaskExecutor(Executor):
    """Tasks on a ``distributed.Client``'s workers."""

    def __init__(self, client, name: str):
        self.client = client
        self.name = name
        self.workers = max(1, len(client.scheduler_info().get("workers", {})))

    @staticmethod
    def _progress(done, total: int, desc: str) -> None:
        for _ in progress_bar(done, total=total, desc=desc, leave=False):
            pass

    def map(self, function, tasks, desc="tasks"):
        from distributed import as_completed

        futures = [self.client.submit(_run, function, *args, pure=False) for args in tasks]
        self._progress(as_completed(futures), len(futures), desc)
        return [o.unwrap() for o in self.client.gather(futures)]

    def map_reduce(self, function, tasks, combine, desc="tasks"):
        """The whole tree is submitted at once, so pairs combine as soon as both sides are done
        and each task's result is released once combined: the workers hold the partial results
        in flight, not one per task."""
        from distributed import as_completed

        if not tasks:
            raise ValueError("map_reduce needs at least one task")
        leaves = [self.client.submit(_run, function, *args, pure=False) for args in tasks]
        top = _tree(list(leaves), lambda a, b: self.client.submit(_combine, combine, a, b, pure=False))
        done = as_completed(leaves)
        del leaves
        self._progress(done, len(tasks), desc)
        return top.result().unwrap()

    def share(self, value):
        return self.client.scatter(value, broadcast=True, hash=False)


def dask_available() -> bool:
    try:
        import distributed  # noqa: F401
    except ImportError:
        return False
    return True


HANDSHAKE_MAX_BYTES = 1 << 20
"""The longest first message a Dask scheduler may announce (its handshake is some tens of bytes)."""


def _probe(scheduler: str, timeout_s: float) -> None:
    """For a ``tcp://`` (or scheme-less) address: connect and read the 8-byte length a Dask
    scheduler sends first, within ``timeout_s``; silence, or a length no handshake has (an HTTP
    server, say), is an :class:`InputError` before the Dask client reads or allocates anything."""
    import socket
    import struct

    scheme, sep, rest = scheduler.partition("://")
    if sep and scheme != "tcp":
        return
    host, _, port = (rest if sep else scheme).rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s) as sock:
            head = b""
            while len(head) < 8:
                more = sock.recv(8 - len(head))
                if not more:
                    raise InputError(None, f"{scheduler} closed the connection without a Dask handshake")
                head += more
    except socket.timeout:
        raise InputError(None, f"the Dask scheduler at {scheduler} did not answer within {timeout_s:g} s "
                               "(is a Dask scheduler listening there?)") from None
    except (OSError, ValueError) as e:
        raise InputError(None, f"cannot reach the Dask scheduler at {scheduler} ({e})") from None
    size = struct.unpack("<Q", head)[0]
    if not 0 < size <= HANDSHAKE_MAX_BYTES:
        raise InputError(None, f"{scheduler} is not a Dask scheduler (its first message announces {size:,} bytes)")


def _connect(client_class, scheduler: str, timeout_s: float):
    """A client of the scheduler at ``scheduler``, or one :class:`InputError` within about
    ``timeout_s`` seconds: whatever answers there (nothing, an HTTP server, garbage) is given that
    long, in a thread of its own, so no reply can hold the command."""
    import threading

    box = {}

    def connect():
        try:
            box["client"] = client_class(scheduler, timeout=f"{timeout_s}s")
        except BaseException as e:          # noqa: BLE001 - whatever the peer made it raise, reported below
            box["error"] = e

    thread = threading.Thread(target=connect, name="relayout-dask-connect", daemon=True)
    thread.start()
    thread.join(timeout_s + CONNECT_GRACE_S)
    if thread.is_alive():
        raise InputError(None, f"the Dask scheduler at {scheduler} did not answer within {timeout_s:g} s "
                               "(is a Dask scheduler listening there?)")
    if "error" in box:
        e = box["error"]
        raise InputError(None, f"cannot reach the Dask scheduler at {scheduler} ({type(e).__name__}: "
                               f"{str(e).splitlines()[0][:160] if str(e) else 'no detail'})")
    return box["client"]


@contextlib.contextmanager
def open_executor(scheduler: str | None = LOCAL, workers: int | None = None, timeout_s: float = 10.0) -> Iterator[Executor]:
    """An executor for ``scheduler`` (``local``, ``none`` or an address), closed on exit.

    ``local`` starts a cluster of ``workers`` single-threaded worker processes (default: this
    machine's cores) and stops it on exit; without dask installed it falls back to serial.
    An address connects to that scheduler's cluster (dask must be installed), waiting at most
    ``timeout_s`` seconds for it to answer; a tcp address is first probed for a Dask handshake, so
    a peer that is not a scheduler never reaches the Dask client.
    """
    scheduler = LOCAL if scheduler is None else scheduler
    if scheduler == SERIAL or (scheduler == LOCAL and not dask_available()):
        yield SerialExecutor()
        return
    if not dask_available():
        raise InputError(None, f"--scheduler {scheduler} needs dask.distributed (pip install \"dask[distributed]\")")
    import logging

    from distributed import Client, LocalCluster

    if scheduler == LOCAL:
        n = workers or os.cpu_count() or 1
        with LocalCluster(n_workers=n, threads_per_worker=1, processes=True, dashboard_address=None,
                          silence_logs=logging.ERROR) as cluster, Client(cluster) as client:
            yield DaskExecutor(client, f"local Dask cluster ({n} worker processes)")
        return
    _probe(scheduler, timeout_s)
    client = _connect(Client, scheduler, timeout_s)
    with client:
        yield DaskExecutor(client, f"Dask cluster at {scheduler}")
