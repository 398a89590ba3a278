"""Interference: what other work on the machine took from a timed pass, read from the OS.

A pass timed on a shared CPU can run preempted: another process holds a core, this process's
threads wait on the run queue, and with OpenMP's barriers one waiting thread stalls the others
(an eager mobilenet_v3_small pass took 4× longer beside one busy process on 2 cores, while a
runtime with its own thread pool slowed far less, so the "speedup" grew 4×). Timing alone
cannot tell that pass from a slow one; the kernel can. Around each timed stretch `LoadMeter`
reads, for every thread of this process, its CPU time and its run-queue wait
(`/proc/self/task/*/schedstat`: nanoseconds on a CPU, and runnable but waiting for one; Linux
schedstats, `sched_info`), the CPU time the hypervisor stole (`/proc/stat`, "steal") and the CPU
time the whole machine used (`/proc/stat`).

A stretch ran preempted by other work when its threads waited for a CPU beyond `PREEMPTED_SHARE`
of its wall time while no more of them were busy than there are CPUs to run them. With more busy
threads than CPUs (a runtime's pool beside PyTorch's OpenMP team: an ONNX Runtime model's output
copied by a parallel torch op while ONNX Runtime's worker still spins), the waits are the model's
own and part of what it costs, in `run` and `serve` too; such a stretch counts as preempted only
when other processes used more than `OTHERS_SHARE` of a CPU beside it, on the CPUs this process
may run on. `gain.compare` times a preempted round again instead of averaging it in. Where schedstats are missing (not Linux, a
kernel without them), the stretch's CPU time over its wall time, against the best the same
runner reached, stands in.
"""

from __future__ import annotations

import glob
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

# A stretch whose threads waited on the run queue (or had time stolen) for more than this share of its wall
# time, in thread-seconds per second, ran preempted. An idle machine reads 0.00-0.01 (kernel threads, the
# odd daemon); one busy process beside a 2-thread model, 0.5-1.0.
PREEMPTED_SHARE = 0.05
# With more busy threads than CPUs: other processes using more than this many CPUs' worth of this process's CPUs
# beside the stretch (one busy process on a CPU shared with two of ours takes a third of it; /proc/stat counts in
# scheduler ticks, so a tick per CPU is taken off first, the most a stretch can misread).
OTHERS_SHARE = 0.25
# A thread that ran this share of a stretch's wall time was busy in it.
BUSY_THREAD_SHARE = 0.1
# Without schedstats: a stretch whose CPU time per wall second fell below this share of the runner's best.
CPU_SHARE_DROP = 0.8

_TASKS = "/proc/self/task/*/schedstat"
_TICK_S = 1 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01  # /proc/stat's unit
_STAT = Path("/proc/stat")


def _threads() -> dict[str, tuple[int, int]] | None:
    """{thread id: (ns on a CPU, ns waiting on a run queue)} for this process; None without schedstats."""
    out = {}
    for path in glob.glob(_TASKS):
        try:
            fields = Path(path).read_text().split()
        except OSError:  # a thread that ended between the listing and the read
            continue
        if len(fields) >= 2:
            out[path] = (int(fields[0]), int(fields[1]))
    return out or None


def _machine() -> tuple[float, float] | None:
    """(CPU seconds spent busy, CPU seconds stolen by the hypervisor), summed over the CPUs this process may run on
    (/proc/stat's per-CPU lines; a process pinned to some CPUs, such as a pytest-xdist worker, is not crowded by
    work on the others); None where unknown."""
    try:
        lines = _STAT.read_text().splitlines()
    except OSError:
        return None
    allowed = _affinity()
    rows = [line.split() for line in lines if line.startswith("cpu")]
    per_cpu = [r for r in rows if r[0] != "cpu" and r[0][3:].isdigit() and (allowed is None or int(r[0][3:]) in allowed)]
    chosen = per_cpu or [r for r in rows if r[0] == "cpu"]
    busy = stolen = 0
    for row in chosen:
        try:
            user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in row[1:9])
        except ValueError:
            return None
        busy += user + nice + system + irq + softirq
        stolen += steal
    if not chosen:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    return busy / tick, stolen / tick


@dataclass(frozen=True)
class Snapshot:
    wall_s: float
    cpu_s: float
    threads: dict[str, tuple[int, int]] | None
    machine: tuple[float, float] | None


def snapshot() -> Snapshot:
    """The clocks `PassLoad` is the difference of (reading them costs ~0.1 ms)."""
    return Snapshot(wall_s=time.perf_counter(), cpu_s=time.process_time(), threads=_threads(), machine=_machine())


def _affinity() -> set[int] | None:
    try:
        return os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return None


def _cpus() -> int:
    allowed = _affinity()
    return len(allowed) if allowed else (os.cpu_count() or 1)


@dataclass(kw_only=True)
class PassLoad:
    """What a timed stretch (one pass, or a round's passes of one side) ran beside.

    Attributes:
        wall_s: its wall time, seconds.
        cpu_s: this process's CPU time over it (all threads), seconds.
        waited_s: its threads' run-queue wait, thread-seconds; None without schedstats.
        busy_threads: its threads that ran ≥ `BUSY_THREAD_SHARE` of the stretch; None without schedstats.
        cpus: the CPUs this process may run on.
        stolen_s: CPU time stolen by the hypervisor (the CPUs this process may run on), seconds; None where unknown.
        others_s: CPU time other processes (and the kernel) used meanwhile on those CPUs, seconds; None where unknown.
    """

    wall_s: float
    cpu_s: float
    waited_s: float | None = None
    busy_threads: int | None = None
    cpus: int = 1
    stolen_s: float | None = None
    others_s: float | None = None

    @classmethod
    def between(cls, start: Snapshot, end: Snapshot) -> PassLoad:
        wall, cpu = max(end.wall_s - start.wall_s, 1e-9), max(0.0, end.cpu_s - start.cpu_s)
        waited = busy = stolen = others = None
        if start.threads is not None and end.threads is not None:
            deltas = [(run - start.threads.get(tid, (0, 0))[0], wait - start.threads.get(tid, (0, 0))[1])
                      for tid, (run, wait) in end.threads.items()]
            waited = max(0, sum(w for _, w in deltas)) / 1e9
            busy = sum(r / 1e9 >= BUSY_THREAD_SHARE * wall for r, _ in deltas)
        if start.machine is not None and end.machine is not None:
            stolen = max(0.0, end.machine[1] - start.machine[1])
            others = max(0.0, end.machine[0] - start.machine[0] - cpu)
        return cls(wall_s=wall, cpu_s=cpu, waited_s=waited, busy_threads=busy, cpus=_cpus(), stolen_s=stolen,
                   others_s=others)

    @property
    def cpu_share(self) -> float:
        """CPU seconds per wall second (≈ the busy threads, for a model that keeps them busy)."""
        return self.cpu_s / self.wall_s

    @property
    def waited_share(self) -> float | None:
        """Run-queue wait plus stolen time per wall second, in thread-seconds per second; None without schedstats.

        /proc/stat counts steal in scheduler ticks (10 ms at USER_HZ 100): a stretch over which the count moved by
        one tick may have lost anything from nothing to two ticks, so one tick less is counted, the least it lost (a
        single tick in a 0.2 s stretch would otherwise read as 5% stolen and set the round aside)."""
        if self.waited_s is None:
            return None
        stolen = max(0.0, (self.stolen_s or 0.0) - _TICK_S)
        return (self.waited_s + stolen) / self.wall_s

    @property
    def self_contended(self) -> bool:
        """More of this process's threads were busy than there are CPUs: its waits are its own."""
        return self.busy_threads is not None and self.busy_threads > self.cpus

    def preempted(self, best_cpu_share: float | None = None) -> bool:
        """Whether other work took CPU time this stretch needed: its threads waited on the run queue
        (or were stolen from) beyond `PREEMPTED_SHARE` with no more busy threads than CPUs; with more,
        other processes used over `OTHERS_SHARE` of a CPU (of those this process may run on) beside it; without schedstats, its CPU share
        fell below `CPU_SHARE_DROP` × `best_cpu_share` (the best the same runner reached)."""
        share = self.waited_share
        if share is None:
            return best_cpu_share is not None and self.cpu_share < CPU_SHARE_DROP * best_cpu_share
        if self.self_contended:
            return self.others_s is not None and max(0.0, self.others_s - _TICK_S * self.cpus) / self.wall_s > OTHERS_SHARE
        return share > PREEMPTED_SHARE

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
        self_contended: stretches with more busy threads of this process than CPUs (their waits are
            the model's own: counted, not set aside).
        source: "schedstat" (run-queue wait) or "cpu_time" (CPU share against the best, no schedstats).
    """

    stretches: int = 0
    preempted: int = 0
    waited_share: float | None = None
    self_contended: int = 0
    source: str = "schedstat"

    @classmethod
    def of(cls, loads: list[PassLoad], flags: list[bool]) -> Contention:
        """The summary of stretches `loads`, `flags` saying which ran preempted."""
        shares = sorted(s for s in (load.waited_share for load in loads) if s is not None)
        median = shares[len(shares) // 2] if shares else None
        return cls(stretches=len(loads), preempted=sum(flags), waited_share=median,
                   self_contended=sum(load.self_contended for load in loads), source="schedstat" if shares else "cpu_time")

    @property
    def busy(self) -> bool:
        """More than a quarter of the stretches ran preempted: the figures are the busy machine's."""
        return self.stretches > 0 and self.preempted > self.stretches / 4

    def describe(self) -> str:
        share = "" if self.waited_share is None or math.isnan(self.waited_share) else \
            f"; its threads waited for a CPU {self.waited_share:.2f} s per second of the stretch (median, summed over threads)"
        return f"{self.preempted} of {self.stretches} timed stretches ran preempted by other work{share}"

    def to_dict(self) -> dict:
        return asdict(self)


def wait_until_idle(*, max_s: float = 0.2, window_s: float = 0.01, busy_share: float = 0.25) -> float:
    """Sleep until this process's own threads stop using the CPU, at most `max_s` seconds.

    After a parallel region, an OpenMP team spins before it sleeps (libgomp's spin count), and so do a
    runtime's worker threads after a call (ONNX Runtime's `allow_spinning`). In an interleaved comparison
    the other side's pass starts at once: its threads then share the cores with threads spinning for
    nothing, and both sides run slower than either does alone (an ONNX Runtime worker spun ~40 ms after
    each call; an eager mobilenet_v3_small pass started at once ran 2× slower, its threads waiting for
    a CPU ~80% of the time, on 2 cores). The process is idle when, over a `window_s` sleep, it used
    under `busy_share` of one CPU. The window spans a few scheduler ticks: the CPU time of a thread
    running on another core is brought up to date only at a tick (4 ms at HZ=250), so a shorter window
    can read a spinning thread as idle.

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
