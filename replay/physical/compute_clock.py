"""The compute thread's emulated compute: sleeps that add up to the compute model's time.

:class:`ComputeClock` is how the harness's calling thread plays the runtime's compute thread: it
sleeps for each stretch of compute the model charges (dense time, resident experts' matmuls, a
loaded expert's matmul), takes the thread's own work (routing, planning and submitting reads,
building records: about 1 ms per layer in Python) off those sleeps, and times each wait for an
expert's bytes from where the compute model would have reached it. Times in nanoseconds of
``time.perf_counter_ns`` unless a name says seconds.
"""

from __future__ import annotations

import time


SPIN_SECONDS = 300e-6
"""The last stretch of an emulated compute (s) is spent yielding the GIL in a loop, not asleep."""


class ComputeClock:
    """Emulated compute: the compute thread's time between waits adds up to the compute model's.

    The thread does work of its own the runtime does not (routing, planning and submitting reads,
    building records, waking after a wait: about 1 ms per layer in Python). That work, and a
    sleep's lateness (tens of microseconds), are carried as a lag (ns) and taken off the next
    sleeps, so the thread reaches the next wait, and the next layer's routing, when the compute
    model says, as long as its own work fits in the compute; otherwise it would lengthen every
    window in which reads run without the thread waiting for them (a prefetch load's before the
    next layer is routed above all). Where it does not fit (experts of tens of microseconds of
    compute), a wait is timed from where the compute model would have reached it
    (:meth:`waited`), so the lag is counted as the stall it is, not as compute. A wait ends the
    lag: the thread resumes where the bytes arrived, as the runtime does. Work that delays a
    layer's reads (routing, planning them) cannot be undone: those reads are issued that much
    later than the model issues them, so the layer's clock starts when they are issued
    (:meth:`begin`), and that work lengthens the step's wall time instead. The last stretch of a
    sleep yields the GIL in a loop instead of blocking, so reader threads are never starved (a
    spin in compiled code with the lock released handed jobs to a reader thread no sooner:
    ``benchmarks/harness_waits.py``).
    """

    def __init__(self):
        self.lag = 0                             # ns the thread is behind the compute model
        self.mark = time.perf_counter_ns()       # the thread's time since then is not yet in the lag

    def begin(self) -> None:
        """The compute model's time starts over: what the thread did before is not lag. At a
        step's start (other runs' steps between), and when a layer's reads are issued: the work
        before (routing, planning the reads) delayed the reads and the compute alike, so the
        waits after it are timed from there, as the runtime's are from its routing."""
        self.lag, self.mark = 0, time.perf_counter_ns()

    def __call__(self, seconds: float) -> None:
        """Emulate ``seconds`` of compute, less the lag."""
        now = time.perf_counter_ns()
        want = round(seconds * 1e9) - self.lag - (now - self.mark)
        if want <= 0:
            self.lag, self.mark = -want, now
            return
        deadline = now + want
        if want > SPIN_SECONDS * 1e9:
            time.sleep(want / 1e9 - SPIN_SECONDS)
        while time.perf_counter_ns() < deadline:
            time.sleep(0)
        self.mark = time.perf_counter_ns()
        self.lag = self.mark - deadline

    def waited(self, reached_ns: int, ready_ns: int) -> tuple[int, int]:
        """The thread reached its wait for an expert at ``reached_ns`` whose bytes were ready at
        ``ready_ns`` (``time.perf_counter_ns``). Returns when the compute model needed them
        (``mark - lag``: the thread's own work since ``mark`` takes no time there) and how long
        it waited for them (ns), in the compute model's time: the runtime's stall, which the
        thread's own work, where it overran the emulated compute, would otherwise hide as
        compute. Then the model is at ``max(ready, need)``: when the thread really waited it
        goes on from ``ready_ns`` with no lag; when the bytes came while it was behind, it is
        behind by what is left."""
        need = self.mark - self.lag
        if ready_ns > reached_ns:
            self.lag, self.mark = 0, ready_ns
        elif ready_ns > need:
            self.lag, self.mark = reached_ns - ready_ns, reached_ns
        return need, max(0, ready_ns - need)
