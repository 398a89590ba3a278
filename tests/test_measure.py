"""Measurement protocol: percentiles, ordering, throughput arithmetic, peak memory, compile time."""

from __future__ import annotations

import time

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from overdrive.core.measure import measure, percentile
from overdrive.core.timer import Timer
from overdrive.core.workload import Workload, embedding_fidelity, logits_fidelity
from overdrive.techniques import BatchingPolicy
from tests.conftest import requires_cuda

CPU = torch.device("cpu")


@given(st.lists(st.floats(min_value=0, max_value=1e6, allow_nan=False), min_size=1, max_size=50))
def test_percentile_is_bounded_and_monotone(values):
    p50, p90, p99 = (percentile(values, q) for q in (50, 90, 99))
    assert min(values) <= p50 <= p90 <= p99 <= max(values)


def test_percentile_matches_known_values():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([5], 99) == 5


class _Sleeper(torch.nn.Module):
    """Sleeps 1 ms per row; returns row index × 2 so that ordering is checkable."""

    def forward(self, x):
        time.sleep(1e-3 * x.shape[0])
        return x * 2


def _sleep_workload(n=12):
    return Workload(name="sleep", model=_Sleeper(), samples=[torch.tensor([float(i)]) for i in range(n)],
                    collate=lambda s: (torch.stack(s),), fidelity=logits_fidelity, fidelity_key="min_cosine",
                    default_batch_size=4, sample_length=lambda s: int(s.item()))  # longest first: reversed


def test_measure_times_calls_and_restores_order():
    w = _sleep_workload()
    indices = list(range(12))
    m, out = measure(w.model, w, device=CPU, batch_size=4, indices=indices,
                     policy=BatchingPolicy(sort_by_length=True), min_timed_calls=6, min_timed_s=0.0)
    assert torch.equal(out.squeeze(1), torch.arange(12.0) * 2)  # sorted in reverse, returned in input order
    assert m.num_timed_calls >= 6 and m.num_timed_calls % 3 == 0  # whole passes over 3 batches
    assert 4.0 <= m.latency_ms["p50"] <= 40.0  # 4 rows × 1 ms sleep, plus overhead
    assert m.samples_per_s == pytest.approx(4 / (m.latency_ms["p50"] / 1e3), rel=0.5)
    assert m.samples_per_s < 1000  # cannot beat 1 ms per row
    assert m.peak_memory_bytes and m.peak_memory_bytes > 10 * 2**20  # a Python process with torch


def test_partial_batches_are_judged_and_timed():
    w = _sleep_workload(10)
    m, out = measure(w.model, w, device=CPU, batch_size=4, indices=list(range(10)), min_timed_calls=4, min_timed_s=0.0)
    assert out.shape == (10, 1)
    assert m.num_timed_calls % 3 == 0 and m.num_timed_calls == 3 * m.num_passes  # 4 + 4 + the 2-row remainder
    assert m.samples_per_s < 10 / 0.010  # 10 rows per pass take at least 10 ms of sleep


def test_compile_time_is_warmup_beyond_steady_state():
    class _SlowFirst(torch.nn.Module):
        calls = 0

        def forward(self, x):
            self.calls += 1
            time.sleep(0.3 if self.calls == 1 else 0.001)
            return x

    w = _sleep_workload(8)
    m, _ = measure(_SlowFirst(), w, device=CPU, batch_size=4, indices=list(range(8)), min_timed_calls=4, min_timed_s=0.0)
    assert 0.25 <= m.compile_s <= 0.5


def test_measure_rejects_bad_arguments():
    w = _sleep_workload()
    with pytest.raises(ValueError):
        measure(w.model, w, device=CPU, batch_size=0, indices=[0])
    with pytest.raises(ValueError):
        measure(w.model, w, device=CPU, batch_size=4, indices=[])


def test_embedding_fidelity_detects_damage():
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(50, 16, generator=g)
    same = embedding_fidelity(ref.clone(), ref)
    assert same["min_cosine"] == pytest.approx(1.0, abs=1e-6) and same["top10_agreement"] == 1.0
    damaged = ref.clone()
    damaged[3] = -damaged[3]
    worse = embedding_fidelity(damaged, ref)
    assert worse["min_cosine"] == pytest.approx(-1.0, abs=1e-5) and worse["mean_cosine"] < 0.97
    shuffled = embedding_fidelity(ref[torch.randperm(50, generator=g)], ref)
    assert shuffled["top10_agreement"] < 0.6


def test_logits_fidelity_figures():
    ref = torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 1.0]])
    out = torch.tensor([[1.0, 2.0, 0.0], [0.0, 3.0, 1.0]])
    f = logits_fidelity(out, ref)
    assert f["top1_agreement"] == 0.5
    assert f["max_rel_error"] == pytest.approx(1.0)


def test_batch_larger_than_the_data_cycles_samples_to_fill_it():
    from overdrive.core.measure import cycle_indices

    w = _sleep_workload(5)
    indices = cycle_indices(16, len(w.samples))
    assert indices[:7] == [0, 1, 2, 3, 4, 0, 1]
    m, out = measure(w.model, w, device=CPU, batch_size=16, indices=indices, min_timed_calls=2, min_timed_s=0.0,
                     policy=BatchingPolicy(sort_by_length=True))
    assert m.batch_size == 16 and m.latency_ms["p50"] >= 16.0  # 16 rows × 1 ms: the batch really was full
    assert torch.equal(out.squeeze(1), torch.tensor([2.0 * i for i in indices]))


def test_timer_times_the_work_and_spans_hooks():
    timer = Timer(torch.device("cpu"))
    out, seconds = timer(lambda x: (time.sleep(0.05), x + 1)[1], 1)
    assert out == 2 and 0.05 <= seconds < 1.0
    token = timer.start()
    time.sleep(0.02)
    assert 0.02 <= timer.stop(token) < 1.0


@requires_cuda
def test_timer_waits_for_the_gpu_not_the_launch():
    """A kernel that keeps the GPU busy returns to the host at once; the Timer must report the GPU's time."""
    timer = Timer(torch.device("cuda"))
    torch.cuda._sleep(1_000)  # context and the kernel loaded
    torch.cuda.synchronize()
    start = time.perf_counter()
    torch.cuda._sleep(100_000_000)  # on the order of 50 ms of GPU time at ~2 GHz
    launch_s = time.perf_counter() - start
    torch.cuda.synchronize()
    _, seconds = timer(torch.cuda._sleep, 100_000_000)
    assert seconds > 0.01 and seconds > 5 * launch_s, (seconds, launch_s)


class _MaskedMean(torch.nn.Module):
    """Token ids [B, S] and their mask -> [B, 4], with a branch on whether any row is padded (remove-padding's)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(50, 4)

    def forward(self, ids, mask):
        x = self.embed(ids)
        if bool(mask.all()):  # nothing padded: a path of its own, a graph of its own once compiled
            return x.mean(dim=1)
        return (x * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True)


def test_the_warm_up_is_the_jobs_and_graphs_compiled_after_it_are_counted(text_workload):
    """A compiled model that builds graphs for rows past run's and serve's warm-up (batch 1 and the batch size,
    padded and not) would stop a job mid-way to compile: the Runner counts them (`late_graphs`)."""
    from overdrive.core.measure import Runner

    torch._dynamo.reset()
    indices = list(range(24))
    dynamic = torch.compile(_MaskedMean().eval(), backend="eager", dynamic=True)
    runner = Runner(dynamic, text_workload, device=CPU, batch_size=8, indices=indices)
    runner.warm_up()
    assert runner.late_graphs == 0  # both branches and the batch sizes were warmed before the first pass
    torch._dynamo.reset()
    static = torch.compile(_MaskedMean().eval(), backend="eager", dynamic=False)  # a graph per length
    runner = Runner(static, text_workload, device=CPU, batch_size=8, indices=indices)
    runner.warm_up()
    assert runner.late_graphs >= 2
    from overdrive.tuning.guard import late_graphs

    assert "a job would stop to compile each" in late_graphs(runner)
    torch._dynamo.reset()


def test_a_settled_runner_stays_settled_and_a_busy_one_settles_again(text_workload):
    """The baseline is compared with each candidate in turn: it settles once (two clean stretches agree), and each
    later comparison runs one stretch to bring its caches back. A settle cut short by a busy machine is not kept."""
    from overdrive.core.measure import Runner

    runner = Runner(_MaskedMean().eval(), text_workload, device=CPU, batch_size=8, indices=list(range(16)))
    stretches: list[int] = []
    busy = [False]

    def stretch(n):
        stretches.append(n)
        runner.meter.flags.append(busy[0])
        return [(0.01, [0.005, 0.005])] * n, busy[0]

    runner._stretch = stretch
    runner._pass = lambda timed: (0.01, [0.005, 0.005], None)
    first = runner.settle(min_unit_s=0.2)
    assert first == (pytest.approx(0.01), 20) and stretches == [20, 20]
    assert runner.settle(min_unit_s=0.2) == first and stretches == [20, 20, 20]  # one stretch, no search
    busy[0] = True
    runner.settle(min_unit_s=0.05)  # another unit; the machine busy: cut short after two preempted stretches
    assert stretches[3:] == [5, 5]
    busy[0] = False
    runner.settle(min_unit_s=0.05)
    assert stretches[5:] == [5, 5]  # a search of its own again, not the busy attempt's figure


def test_a_text_baseline_is_timed_in_the_batches_run_cuts(text_workload, conv_workload):
    """A plan is measured against what `run` and `serve` do without it: `run` sorts each chunk of text
    by token length, so the baseline's batches are the ones `run` cuts (not data order, which would
    credit length bucketing and padding removal with padding no deployment pads)."""
    from overdrive.core.measure import make_batches
    from overdrive.run.replica import chunk_batches
    from overdrive.techniques.compose import build

    _, policy = build(text_workload, [], torch.device("cpu"))
    assert policy == BatchingPolicy.deployed(text_workload) and policy.sort_by_length
    assert not build(conv_workload, [], torch.device("cpu"))[1].sort_by_length
    indices = list(range(len(text_workload.samples)))
    timed = make_batches(text_workload, indices=indices, batch_size=8, policy=policy, device=torch.device("cpu"))

    class Texts:  # a chunk of records as run reads them: the samples stand in for texts
        kind = "text"

        def __len__(self):
            return len(indices)

        def read(self, i):
            return text_workload.samples[i]

    cut = chunk_batches(Texts(), 0, 4096, 8, bucket=True, lengths=lambda texts: [len(t) for t in texts])
    assert [[indices[p] for p in b.positions] for b in timed] == cut
    lengths = [len(s) for s in text_workload.samples]
    assert len(set(lengths)) > 8  # the lengths differ, so the order matters


def test_the_tuner_does_not_try_length_bucketing_on_text_but_a_plan_holding_it_builds(text_workload):
    from overdrive.techniques.compose import build
    from overdrive.techniques.registry import default_config
    from overdrive.tuning.tuner import Tuner

    tuner = Tuner(workload=text_workload, device=torch.device("cpu"), batch_size=8, techniques=["length-bucketing"])
    assert "already batched by length" in tuner._skip_reason("length-bucketing")
    _, policy = build(text_workload, [default_config("length-bucketing")], torch.device("cpu"))
    assert policy.sort_by_length
