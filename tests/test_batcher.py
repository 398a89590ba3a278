"""The dynamic batcher's invariant, checked directly (no HTTP): row caps and splitting, delay,
length buckets, the queue bound, timeouts, disconnects, error isolation and drain."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from overdrive.serve.batcher import (
    ClientDisconnected,
    DynamicBatcher,
    ExecutionError,
    QueueFull,
    RequestTimeout,
    RequestTooLarge,
    ShuttingDown,
    length_bucket,
)

pytestmark = pytest.mark.timeout(60)


class ListModel:
    """Payloads are lists of ints (rows); a row < 0 raises; result = rows × 10. Records batches."""

    def __init__(self, delay_s: float = 0.0):
        self.delay_s = delay_s
        self.batches: list[list[list[int]]] = []
        self.gate = threading.Event()
        self.gate.set()

    def rows(self, payload):
        return len(payload)

    def slice(self, payload, start, stop):
        return payload[start:stop]

    def concat(self, results):
        return [x for r in results for x in r]

    def execute(self, payloads, instance):
        self.gate.wait(10)
        self.batches.append([list(p) for p in payloads])
        time.sleep(self.delay_s)
        if any(x < 0 for p in payloads for x in p):
            raise ValueError("negative row")
        return [[x * 10 for x in p] for p in payloads]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


async def started(model, **kw):
    batcher = DynamicBatcher(model, **{"max_batch_size": 4, "max_queue_delay_s": 0.005, "max_queue_size": 64, **kw})
    batcher.start()
    return batcher


@settings(max_examples=25, deadline=None)
@given(sizes=st.lists(st.integers(1, 11), min_size=1, max_size=12), cap=st.integers(1, 6))
def test_every_request_gets_exactly_its_rows_and_no_batch_exceeds_the_cap(sizes, cap):
    model = ListModel()

    async def main():
        batcher = await started(model, max_batch_size=cap, max_queue_size=1000)
        payloads = [list(range(100 * i, 100 * i + n)) for i, n in enumerate(sizes)]
        results = await asyncio.gather(*(batcher.infer(p) for p in payloads))
        await batcher.drain(1)
        return payloads, results

    payloads, results = run(main())
    assert results == [[x * 10 for x in p] for p in payloads]
    assert all(sum(len(p) for p in batch) <= cap for batch in model.batches)
    assert sorted(x for b in model.batches for p in b for x in p) == sorted(x for p in payloads for x in p)


def test_a_full_batch_goes_at_once_and_a_partial_one_after_the_delay():
    model = ListModel()

    async def main():
        batcher = await started(model, max_batch_size=4, max_queue_delay_s=0.3)
        t0 = time.monotonic()
        await asyncio.gather(*(batcher.infer([i]) for i in range(4)))
        full = time.monotonic() - t0
        t0 = time.monotonic()
        await batcher.infer([9])
        partial = time.monotonic() - t0
        await batcher.drain(1)
        return full, partial

    full, partial = run(main())
    assert full < 0.2 and 0.28 < partial < 1.0
    assert [sum(len(p) for p in b) for b in model.batches] == [4, 1]


def test_only_rows_of_the_oldest_requests_length_bucket_join_its_batch():
    model = ListModel()

    async def main():
        model.gate.clear()  # hold the instance so the queue fills
        batcher = await started(model, max_batch_size=8, max_queue_delay_s=0.0, length=lambda p: p[0])
        first = asyncio.ensure_future(batcher.infer([1]))
        await asyncio.sleep(0.05)
        lengths = [100, 10, 90, 40, 12, 120, 33]  # buckets 7, 4, 7, 6, 4, 7, 6
        tasks = [asyncio.ensure_future(batcher.infer([n])) for n in lengths]
        await asyncio.sleep(0.05)
        model.gate.set()
        await asyncio.gather(first, *tasks)
        await batcher.drain(1)

    run(main())
    assert [[p[0] for p in b] for b in model.batches[1:]] == [[100, 90, 120], [10, 12], [40, 33]]
    assert length_bucket(16) == 4 and length_bucket(17) == 5 and length_bucket(1) == 4


def test_the_queue_bound_counts_rows_and_refuses_at_once():
    model = ListModel()

    async def main():
        model.gate.clear()
        batcher = await started(model, max_batch_size=4, max_queue_size=6)
        first = asyncio.ensure_future(batcher.infer([1]))  # taken by the instance, no longer queued
        await asyncio.sleep(0.05)
        queued = asyncio.ensure_future(batcher.infer([1, 2, 3, 4, 5]))
        await asyncio.sleep(0.01)
        with pytest.raises(QueueFull, match="5 of 6 rows"):
            await batcher.infer([1, 2])
        with pytest.raises(RequestTooLarge):
            await batcher.infer(list(range(7)))
        model.gate.set()
        await asyncio.gather(first, queued)
        assert await batcher.infer([1, 2]) == [10, 20]  # room again
        await batcher.drain(1)

    run(main())


def test_timeouts_and_disconnects_drop_queued_requests_before_execution():
    model = ListModel()

    async def main():
        model.gate.clear()
        batcher = await started(model, max_batch_size=1)
        first = asyncio.ensure_future(batcher.infer([1]))
        await asyncio.sleep(0.05)
        gone = asyncio.Event()
        timed = asyncio.ensure_future(batcher.infer([777], timeout_s=0.05))
        left = asyncio.ensure_future(batcher.infer([888], disconnected=gone.wait))
        cancelled = asyncio.ensure_future(batcher.infer([999]))
        kept = asyncio.ensure_future(batcher.infer([2]))
        await asyncio.sleep(0.1)
        gone.set()
        cancelled.cancel()
        await asyncio.sleep(0.05)
        assert batcher.queued_rows == 1
        model.gate.set()
        with pytest.raises(RequestTimeout):
            await timed
        with pytest.raises(ClientDisconnected):
            await left
        assert await first == [10] and await kept == [20]
        await batcher.drain(1)
        assert batcher.in_flight == 0

    run(main())
    assert [p[0] for b in model.batches for p in b] == [1, 2]


def test_a_failing_batch_is_bisected_so_only_the_bad_request_fails():
    model = ListModel()

    async def main():
        batcher = await started(model, max_batch_size=8, max_queue_delay_s=0.2)
        results = await asyncio.gather(*(batcher.infer([i if i != 5 else -1]) for i in range(8)), return_exceptions=True)
        assert await batcher.infer([3]) == [30]
        await batcher.drain(1)
        return results

    results = run(main())
    assert isinstance(results[5], ExecutionError) and "negative row" in str(results[5])
    assert [r for i, r in enumerate(results) if i != 5] == [[i * 10] for i in range(8) if i != 5]


def test_drain_finishes_admitted_requests_and_refuses_new_ones():
    model = ListModel(delay_s=0.05)

    async def main():
        batcher = await started(model, max_batch_size=2, max_queue_delay_s=0.0, instances=2)
        tasks = [asyncio.ensure_future(batcher.infer([i])) for i in range(10)]
        await asyncio.sleep(0.01)
        drain = asyncio.ensure_future(batcher.drain(5))
        await asyncio.sleep(0)
        with pytest.raises(ShuttingDown):
            await batcher.infer([1])
        assert await drain == 0
        return await asyncio.gather(*tasks)

    assert run(main()) == [[i * 10] for i in range(10)]


def test_drain_timeout_answers_the_still_queued_with_shutting_down():
    model = ListModel()

    async def main():
        model.gate.clear()
        batcher = await started(model, max_batch_size=1)
        tasks = [asyncio.ensure_future(batcher.infer([i])) for i in range(3)]
        await asyncio.sleep(0.05)
        drain = asyncio.ensure_future(batcher.drain(0.1))
        await asyncio.sleep(0.2)
        model.gate.set()
        refused = await drain
        return refused, await asyncio.gather(*tasks, return_exceptions=True)

    refused, results = run(main())
    assert refused == 2 and results[0] == [0]
    assert all(isinstance(r, ShuttingDown) for r in results[1:])


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        DynamicBatcher(ListModel(), max_batch_size=0, max_queue_delay_s=0, max_queue_size=4)
    with pytest.raises(ValueError):
        DynamicBatcher(ListModel(), max_batch_size=1, max_queue_delay_s=-1, max_queue_size=4)


def test_each_instance_thread_is_set_up_once_and_runs_only_its_own_work():
    class ThreadedModel(ListModel):
        def __init__(self):
            super().__init__(delay_s=0.01)
            self.started: dict[int, int] = {}  # instance -> thread id
            self.ran: list[tuple[int, int]] = []

        def start_instance(self, instance):
            assert instance not in self.started
            self.started[instance] = threading.get_ident()

        def execute(self, payloads, instance):
            self.ran.append((instance, threading.get_ident()))
            return super().execute(payloads, instance)

    model = ThreadedModel()

    async def main():
        batcher = await started(model, instances=3, max_batch_size=1)
        where = await batcher.on_instances(lambda i: (i, threading.get_ident()))
        await asyncio.gather(*(batcher.infer([i]) for i in range(12)))
        await batcher.drain(1)
        return where

    where = run(main())
    assert dict(where) == model.started and len(set(model.started.values())) == 3
    assert threading.get_ident() not in model.started.values()
    assert all(model.started[instance] == thread for instance, thread in model.ran)


# -- the adaptive policy ------------------------------------------------------------------------


def _curve(points: dict[int, float], bucket: int = 0):
    from overdrive.serve.adaptive import CostCurve

    curve = CostCurve()
    for rows, seconds in points.items():
        curve.observe(bucket, rows, seconds)
    return curve


def _rate(per_s: float, bucket: int = 0, now: float = 100.0):
    """An arrival estimate that reads `per_s` rows/s at `now` (the mass τ·λ, arrived at `now`)."""
    from overdrive.serve.adaptive import ArrivalRate

    rate = ArrivalRate(tau_s=0.25)
    rate.arrived(bucket, round(per_s * 0.25), now)
    return rate


def test_the_cost_curve_interpolates_and_assumes_no_saving_beyond_what_was_measured():
    curve = _curve({1: 0.010, 8: 0.017})
    assert curve.seconds(0, 1) == 0.010 and curve.seconds(0, 8) == 0.017
    assert curve.seconds(0, 4) == pytest.approx(0.010 + 0.007 * 3 / 7)
    assert curve.seconds(0, 16) == pytest.approx(0.034)  # in proportion beyond the largest size
    assert curve.seconds(7, 1) == 0.010  # an unmeasured bucket borrows the nearest
    curve.observe(0, 8, 0.027)  # an exponentially weighted mean, weight 0.2
    assert curve.seconds(0, 8) == pytest.approx(0.019)


def test_a_lone_client_is_never_made_to_wait():
    from overdrive.serve.adaptive import best_wait

    # Batching pays enormously (8 rows cost what 1 does), but one closed-loop client sends a row
    # every 12 ms: waiting for the next costs more than the whole batch.
    curve = _curve({1: 0.010, 8: 0.010})
    assert best_wait(curve, _rate(1 / 0.012), bucket=0, rows=1, room=7, now=100.0, latest=101.0) == 0.0


def test_under_load_it_waits_only_while_the_expected_rows_make_rows_cheaper():
    from overdrive.serve.adaptive import best_wait

    curve = _curve({1: 0.010, 2: 0.0101, 4: 0.0102, 8: 0.0104})
    rate = _rate(4000.0)  # a row every 0.25 ms: 7 more rows in 1.75 ms make each row ~6× cheaper
    assert best_wait(curve, rate, bucket=0, rows=1, room=7, now=100.0, latest=101.0) == pytest.approx(7 / 4000)
    assert best_wait(curve, rate, bucket=0, rows=1, room=7, now=100.0, latest=100.0005) == pytest.approx(2 / 4000)
    assert best_wait(curve, rate, bucket=0, rows=8, room=0, now=100.0, latest=101.0) == 0.0  # full
    linear = _curve({1: 0.001, 8: 0.008})  # no saving from batching: never wait
    assert best_wait(linear, rate, bucket=0, rows=1, room=7, now=100.0, latest=101.0) == 0.0
    assert best_wait(_curve({}), rate, bucket=0, rows=1, room=7, now=100.0, latest=101.0) == 0.0  # nothing measured


def test_adaptive_runs_a_lone_request_at_once_though_the_cap_is_long():
    model = ListModel()

    async def main():
        batcher = await started(model, max_batch_size=8, max_queue_delay_s=1.0, policy="adaptive")
        batcher.observe(1, 0.002)
        batcher.observe(8, 0.002)  # batching looks free
        took = []
        for i in range(5):  # one client, one request at a time
            t0 = time.monotonic()
            assert await batcher.infer([i]) == [i * 10]
            took.append(time.monotonic() - t0)
        await batcher.drain(1)
        return took

    assert max(run(main())) < 0.2  # the cap is 1 s; fixed would wait all of it


def test_adaptive_stops_waiting_when_a_wait_brings_nothing():
    model = ListModel()

    async def main():
        batcher = await started(model, max_batch_size=64, max_queue_delay_s=2.0, policy="adaptive")
        batcher.observe(1, 0.050)
        batcher.observe(64, 0.051)  # waiting for rows pays a lot ...
        batcher.arrivals.arrived(0, 1000, time.monotonic())  # ... and rows have been arriving at 4000/s
        t0 = time.monotonic()
        results = await asyncio.gather(*(batcher.infer([i]) for i in range(8)))  # ... but nothing follows it
        took = time.monotonic() - t0
        await batcher.drain(1)
        return results, took

    results, took = run(main())
    assert results == [[i * 10] for i in range(8)]
    assert took < 1.0  # not the 2 s cap: one wait found nothing, so the batch went
    assert [sum(len(p) for p in b) for b in model.batches] == [8]


def test_adaptive_learns_the_cost_of_each_batch_size_from_the_batches_it_runs():
    model = ListModel(delay_s=0.01)

    async def main():
        batcher = await started(model, max_batch_size=4, max_queue_delay_s=0.0, policy="adaptive")
        await asyncio.gather(*(batcher.infer([i]) for i in range(4)))
        await batcher.drain(1)
        return batcher

    batcher = run(main())
    assert 0.009 < batcher.curve.seconds(0, 4) < 0.5


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="adaptive, fixed"):
        DynamicBatcher(ListModel(), max_batch_size=1, max_queue_delay_s=0, max_queue_size=4, policy="eager")
