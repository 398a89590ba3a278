"""Interference: what other work on the machine took from a timed pass, read from the OS.

A pass timed on a shared CPU can run preempted: another process holds a core, this process's
threads wait on the run queue, and with OpenMP's barriers one waiting thread stalls the others
(an eager mobilenet_v3_small pass took 4× longer beside one busy process on 2 cores, while a
runtime with its own thread pool slowed far less, so the "speedup" grew 4×). Timing alone
cannot tell that pass from a slow one; the kernel can. Around each timed pass `LoadMeter`
reads:

- the run-queue wait of every thread of this process (`/proc/self/task/*/schedstat`, second
  field: nanoseconds a runnable thread waited for a CPU; Linux schedstats, `sched_info`);
- the process's CPU time (`time.process_time`, user + system over all threads);
- the CPU time the hypervisor stole from this virtual machine (`/proc/stat`, "steal");
- CPU pressure (`/proc/pressure/cpu`, "some" total: time some task waited for a CPU).

`PassLoad.waited_share` is the run-queue wait (plus stolen time) over the pass's wall time, in
thread-seconds per second: 0 on an idle machine, ~0.8 for that mobilenet pass beside one busy
process. A pass above `PREEMPTED_SHARE` ran preempted: `measure.compare` repeats its round
instead of averaging it in. Where schedstats are missing (not Linux, a kernel without them), the
pass's CPU time over its wall time, against the best the same runner reached, stands in.
"""

from __future__ import annotations

import glob
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

# A pass in which this process's threads waited on the run queue (or had time stolen) for more than
# this share of its wall time, in thread-seconds per second, ran preempted. An idle machine reads
# 0.00-0.01 (kernel threads, the odd daemon); one busy process beside a 2-thread model, 0.5-1.0.
PREEMPTED_SHARE = 0.05
# Without schedstats: a pass whose CPU time per wall second fell below this share of the runner's best.
CPU_SHARE_DROP = 0.8

_TASKS = "/proc/self/task/*/schedstat"
_STAT = Path("/proc/stat")
_PRESSURE = Path("/proc/pressure/cpu")


def _run_queue_wait_s() -> float | None:
    """Seconds the threads of this process have waited on a run queue, summed; None without schedstats."""
    total, found = 0, False
    for path in glob.glob(_TASKS):
        try:
            fields = Path(path).read_text().split()
        except OSError:  # a thread that ended between the listing and the read
            continue
        if len(fields) >= 2:
            total += int(fields[1])
            found = True
    return total / 1e9 if found else None


def _steal_s() -> float | None:
    """CPU seconds stolen by the hypervisor, summed over CPUs (/proc/stat); None where unknown."""
    try:
        fields = _STAT.read_text().split("\n", 1)[0].split()
        ticks = int(fields[8])
    except (OSError, IndexError, ValueError):
        return None
    import os

    return ticks / os.sysconf("SC_CLK_TCK")


def _pressure_s() -> float | None:
    """Seconds in which some task waited for a CPU (PSI "some" total); None where unknown."""
    try:
        for line in _PRESSURE.read_text().splitlines():
            if line.startswith("some"):
                return int(line.rsplit("total=", 1)[1]) / 1e6
    except (OSError, IndexError, ValueError):
        return None
    return None


@dataclass(frozen=True)
class Snapshot:
    wall_s: float
    cpu_s: float
    waited_s: float | None
    stolen_s: float | None
    pressure_s: float | None


def snapshot() -> Snapshot:
    """The clocks `PassLoad` is the difference of (reading them costs ~0.1 ms)."""
    return Snapshot(wall_s=time.perf_counter(), cpu_s=time.process_time(), waited_s=_run_queue_wait_s(),
                    stolen_s=_steal_s(), pressure_s=_pressure_s())


def _delta(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else max(0.0, b - a)


@dataclass(kw_only=True)
class PassLoad:
    """What a timed stretch (one pass, or a round's passes of one side) ran beside.

    Attributes:
        wall_s: its wall time, seconds.
        cpu_s: this process's CPU time over it (all threads), seconds.
        waited_s: its threads' run-queue wait, thread-seconds; None without schedstats.
        stolen_s: CPU time stolen by the hypervisor (all CPUs), seconds; None where unknown.
        pressure_s: time some task on the machine waited for a CPU, seconds; None where unknown.
    """

    wall_s: float
    cpu_s: float
    waited_s: float | None = None
    stolen_s: float | None = None
    pressure_s: float | None = None

    @classmethod
    def between(cls, start: Snapshot, end: Snapshot) -> PassLoad:
        return cls(wall_s=max(end.wall_s - start.wall_s, 1e-9), cpu_s=max(0.0, end.cpu_s - start.cpu_s),
                   waited_s=_delta(start.waited_s, end.waited_s), stolen_s=_delta(start.stolen_s, end.stolen_s),
                   pressure_s=_delta(start.pressure_s, end.pressure_s))

    @property
    def cpu_share(self) -> float:
        """CPU seconds per wall second (≈ the busy threads, for a model that keeps them busy)."""
        return self.cpu_s / self.wall_s

    @property
    def waited_share(self) -> float | None:
        """Run-queue wait plus stolen time per wall second, in thread-seconds per second; None without schedstats."""
        if self.waited_s is None:
            return None
        return (self.waited_s + (self.stolen_s or 0.0)) / self.wall_s

    def preempted(self, best_cpu_share: float | None = None) -> bool:
        """Whether other work took CPU time this stretch needed: its threads waited on the run queue
        (or were stolen from) beyond `PREEMPTED_SHARE`; without schedstats, its CPU share fell below
        `CPU_SHARE_DROP` × `best_cpu_share` (the best the same runner reached)."""
        share = self.waited_share
        if share is not None:
            return share > PREEMPTED_SHARE
        return best_cpu_share is not None and self.cpu_share < CPU_SHARE_DROP * best_cpu_share

    def to_dict(self) -> dict:
        return asdict(self)


class LoadMeter:
    """The load of each timed stretch: `start = meter.start()`, the work, `preempted = meter.stop(start)`."""

    def __init__(self):
        self.loads: list[PassLoad] = []
        self.flags: list[bool] = []  # per stretch: it ran preempted

    def start(self) -> Snapshot:
        return snapshot()

    def stop(self, start: Snapshot) -> bool:
        """Record the stretch since `start`; returns whether it ran preempted (`PassLoad.preempted`,
        against the best CPU share of the stretches so far when schedstats are missing)."""
        load = PassLoad.between(start, snapshot())
        best = max((x.cpu_share for x in self.loads), default=None)
        self.loads.append(load)
        self.flags.append(load.preempted(best))
        return self.flags[-1]

    def contention(self) -> Contention:
        return Contention.of(self.loads, self.flags)


@dataclass(kw_only=True)
class Contention:
    """How busy the machine was over a measurement: the summary a Gain and a Measurement carry.

    Attributes:
        stretches: timed stretches observed.
        preempted: of which ran preempted (`PassLoad.preempted`) and were set aside.
        waited_share: median run-queue wait (+ steal) per wall second over all stretches,
            thread-seconds per second; None without schedstats.
        source: "schedstat" (run-queue wait) or "cpu_time" (CPU share against the best, no schedstats).
    """

    stretches: int = 0
    preempted: int = 0
    waited_share: float | None = None
    source: str = "schedstat"

    @classmethod
    def of(cls, loads: list[PassLoad], flags: list[bool]) -> Contention:
        """The summary of stretches `loads`, `flags` saying which ran preempted."""
        shares = sorted(s for s in (load.waited_share for load in loads) if s is not None)
        median = shares[len(shares) // 2] if shares else None
        return cls(stretches=len(loads), preempted=sum(flags), waited_share=median,
                   source="schedstat" if shares else "cpu_time")

    @property
    def busy(self) -> bool:
        """More than a quarter of the stretches ran preempted: the figures are the busy machine's."""
        return self.stretches > 0 and self.preempted > self.stretches / 4

    def describe(self) -> str:
        share = "" if self.waited_share is None or math.isnan(self.waited_share) else \
            f"; its threads waited for a CPU {100 * self.waited_share:.0f}% of the time (median)"
        return f"{self.preempted} of {self.stretches} timed stretches ran preempted by other work{share}"

    def to_dict(self) -> dict:
        return asdict(self)


def wait_until_idle(*, max_s: float = 0.05, window_s: float = 0.002, busy_share: float = 0.25) -> float:
    """Sleep until this process's own threads stop using the CPU, at most `max_s` seconds.

    After a parallel region, an OpenMP team spins before it sleeps (libgomp's spin count), and so do a
    runtime's worker threads after a call (ONNX Runtime's `allow_spinning`). In an interleaved comparison
    the other side's pass starts at once: its threads then share the cores with threads spinning for
    nothing, and both sides run slower than either does alone (an eager mobilenet_v3_small pass right
    after an ONNX Runtime pass waited for a CPU ~80% of its time on 2 cores). The process is idle when,
    over a `window_s` sleep, it used under `busy_share` of one CPU.

    Returns:
        The seconds waited.
    """
    started = time.perf_counter()
    while True:
        cpu, wall = time.process_time(), time.perf_counter()
        time.sleep(window_s)
        now = time.perf_counter()
        if time.process_time() - cpu < busy_share * (now - wall) or now - started >= max_s:
            return now - started
