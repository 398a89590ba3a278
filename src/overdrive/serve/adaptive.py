"""Adaptive batching: wait for more rows only while the rows expected to arrive make the batch
cheaper per row than running it now.

The rule (applied when a model instance is idle and a batch could start): with `n` rows ready
for the oldest request's batch, running now costs the instance T(n)/n seconds per row, T the
measured time of a batch of n rows. Waiting `w` seconds brings λ·w more rows of that bucket in
expectation (λ: the measured arrival rate, rows/s), and costs the idle instance those w seconds
as well: (w + T(n + λw)) / (n + λw) per row. The batcher waits for the w (among the times k
more rows are expected, k = 1, 2, 4, ...) that minimises that cost, and only if it is below
running now; never past the oldest request's `max_queue_delay` (the cap); and it stops waiting
as soon as a wait brought nothing (the prediction failed: a closed loop whose clients are all
already queued sends nothing more until answered).

At light load λ·T < 1, so the wait costs more than the batch saves and a lone request runs at
once: a single client pays no queue delay. Under load the instance is busy most of the time and
rows accumulate while it runs anyway; the rule only adds a wait when a short one fills the batch
enough to pay for itself.

Sources: Clipper (Crankshaw et al., NSDI 2017, §4.3) adapts the batch size to the measured
batch latency; Triton Inference Server's dynamic batcher waits up to `max_queue_delay_microseconds`
for a preferred size. Here the wait itself is chosen per batch from the measured cost curve and
arrival rate, and the fixed delay remains the cap (and the `fixed` policy).
"""

from __future__ import annotations

import math
from collections import defaultdict

ADAPTIVE, FIXED = "adaptive", "fixed"
POLICIES = (ADAPTIVE, FIXED)
_GAIN = 0.97  # a wait must cut the cost per row by ≥ 3%: within the timing noise it does not pay


class CostCurve:
    """Measured seconds per batch by rows, per length bucket (exponentially weighted means).

    `seconds(bucket, rows)` interpolates linearly between measured sizes; below the smallest it
    is the smallest's time, above the largest it grows in proportion to the rows (no saving is
    assumed where none was measured). A bucket with no measurement uses the nearest that has one.
    """

    def __init__(self, weight: float = 0.2):
        self.weight = weight
        self._points: dict[int, dict[int, float]] = defaultdict(dict)

    def observe(self, bucket: int, rows: int, seconds: float) -> None:
        points = self._points[bucket]
        old = points.get(rows)
        points[rows] = seconds if old is None else old + self.weight * (seconds - old)

    def known(self) -> bool:
        return any(self._points.values())

    def seconds(self, bucket: int, rows: int) -> float | None:
        if not self.known():
            return None
        if not self._points.get(bucket):
            bucket = min((b for b, p in self._points.items() if p), key=lambda b: abs(b - bucket))
        points = sorted(self._points[bucket].items())
        if rows <= points[0][0]:
            return points[0][1]
        if rows >= points[-1][0]:
            size, t = points[-1]
            return t * rows / size
        for (r0, t0), (r1, t1) in zip(points, points[1:]):
            if r0 <= rows <= r1:
                return t0 + (t1 - t0) * (rows - r0) / (r1 - r0)
        raise AssertionError("unreachable")


class ArrivalRate:
    """Rows per second arriving per bucket, exponentially decayed with time constant `tau_s`."""

    def __init__(self, tau_s: float = 0.25):
        self.tau_s = tau_s
        self._mass: dict[int, tuple[float, float]] = {}  # bucket → (decayed rows, at time)

    def arrived(self, bucket: int, rows: int, now: float) -> None:
        mass, at = self._mass.get(bucket, (0.0, now))
        self._mass[bucket] = (mass * math.exp(-(now - at) / self.tau_s) + rows, now)

    def per_s(self, bucket: int, now: float) -> float:
        mass, at = self._mass.get(bucket, (0.0, now))
        return mass * math.exp(-(now - at) / self.tau_s) / self.tau_s


def best_wait(curve: CostCurve, rate: ArrivalRate, *, bucket: int, rows: int, room: int, now: float,
              latest: float) -> float:
    """Seconds to wait before running a batch of `rows` rows of `bucket` (0: run now).

    Args:
        room: rows the batch may still take (max_batch_size − rows).
        latest: time.monotonic() after which no wait may end (the oldest request's cap).
    """
    now_cost = curve.seconds(bucket, rows)
    per_s = rate.per_s(bucket, now)
    if now_cost is None or per_s <= 0 or room <= 0:
        return 0.0
    best, best_w = now_cost / rows * _GAIN, 0.0
    for k in sorted({2 ** i for i in range(room.bit_length())} | {room}):  # 1, 2, 4, ... and a full batch
        w = k / per_s
        if now + w > latest:
            break
        cost = (w + curve.seconds(bucket, rows + k)) / (rows + k)
        if cost < best:
            best, best_w = cost, w
    return best_w
