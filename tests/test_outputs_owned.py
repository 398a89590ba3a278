"""Outputs are owned before the model's next call: a model that returns a view of one buffer it
reuses (the pattern of CUDA graphs and static-buffer runtimes) must still give every row of
`run`, every response of `serve` and every output `bench` judges its own answer."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from overdrive.core.measure import measure
from tests.conftest import requires_cuda
from tests.fixtures.live_server import LiveServer
from tests.fixtures.run_io import npy_rows, run, sentences, write_lines
from tests.fixtures.run_models import expected_row, reused_buffer_text
from tests.fixtures.serve_models import reused_buffer_toy

pytestmark = pytest.mark.timeout(180)


def test_the_fixture_model_overwrites_what_it_returned():
    """The premise: without a copy, the first output is the second call's answer."""
    model = reused_buffer_text().model
    codes, mask = torch.tensor([[97]]), torch.tensor([[1]])
    first = model(codes, mask)
    model(codes + 1, mask)
    assert first[0, 2].item() == 98.0


@pytest.mark.parametrize("replicas", [1, 2])
def test_run_writes_each_records_own_output_when_the_model_reuses_its_buffer(tmp_path, replicas):
    texts = sentences(400, seed=5)
    inp = write_lines(tmp_path / "in.txt", texts)
    summary = run(inp, tmp_path / "out.npy", workload=reused_buffer_text(), batch_size=4, chunk_size=40,
                  replicas=replicas)
    assert (summary.records, summary.failed) == (400, 0)
    rows, expected = npy_rows(tmp_path / "out.npy"), np.array([expected_row(t) for t in texts], dtype=np.float32)
    wrong = int((~np.isclose(rows, expected, rtol=1e-6).all(axis=1)).sum())
    assert wrong == 0, f"{wrong} of 400 rows hold another record's output"


def test_serve_answers_each_request_with_its_own_rows_when_the_model_reuses_its_buffer():
    from tests.test_serve import gather_posts, output_of, rows, tensor_body

    workload = reused_buffer_toy()
    xs = [rows(1 + i % 3, 100 + i) for i in range(160)]
    with torch.no_grad():
        expected = [workload.model.linear(torch.from_numpy(x)).numpy() for x in xs]
    with LiveServer(workload, max_batch_size=8, max_queue_delay_ms=2, batching="fixed", max_queue_size=1024) as live:
        results = asyncio.run(gather_posts(live.infer_url, [tensor_body(x) for x in xs]))
    assert [status for status, *_ in results] == [200] * len(xs)
    wrong = sum(not np.allclose(output_of(doc), e, rtol=1e-5, atol=1e-6) for (_, doc, _, _), e in zip(results, expected))
    assert wrong == 0, f"{wrong} of {len(xs)} responses hold another request's rows"


def test_bench_judges_each_rows_own_output_when_the_model_reuses_its_buffer():
    import overdrive

    workload = reused_buffer_toy()
    model = workload.model
    with torch.no_grad():
        reference = model.linear(torch.stack(list(workload.samples))).clone()
    _, outputs = measure(model, workload, device=torch.device("cpu"), batch_size=4, indices=list(range(16)),
                         min_timed_calls=2, min_timed_s=0.0)
    torch.testing.assert_close(outputs, reference)
    data = [torch.stack(list(workload.samples[i:i + 4])) for i in range(0, 16, 4)]
    m = overdrive.bench(model, data[0], batch_sizes=[4], data=data)[4]
    assert m.num_samples == 16 and m.samples_per_s > 0


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("replicas", [1, 2])
def test_run_on_cuda_copies_the_output_before_the_next_call_overwrites_it(tmp_path, replicas):
    """The device->host copy is enqueued on the compute stream right after the model's call, so
    the next call (same stream, later) cannot overwrite the buffer before the copy has read it."""
    texts = sentences(400, seed=6)
    inp = write_lines(tmp_path / "in.txt", texts)
    summary = run(inp, tmp_path / "out.npy", workload=reused_buffer_text(), batch_size=4, chunk_size=40,
                  replicas=replicas, device="cuda")
    assert summary.failed == 0
    np.testing.assert_allclose(npy_rows(tmp_path / "out.npy"), np.array([expected_row(t) for t in texts]), rtol=1e-6)


@requires_cuda
@pytest.mark.cuda
def test_serve_on_cuda_answers_each_request_with_its_own_rows():
    from overdrive.serve.model import ServedModel

    workload = reused_buffer_toy()
    model = workload.model.to("cuda")
    served = ServedModel("toy", workload, [model], [torch.device("cuda")])
    xs = [torch.randn(2, 4, generator=torch.Generator().manual_seed(i)) for i in range(8)]
    answers = [served.execute([(x,)], 0)[0] for x in xs]  # each kept past the next call
    with torch.no_grad():
        for x, answer in zip(xs, answers):
            np.testing.assert_allclose(answer, model.linear(x.cuda()).cpu().numpy(), rtol=1e-5, atol=1e-6)
