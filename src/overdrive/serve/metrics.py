"""The server's Prometheus metrics: overdrive's own names, and Triton Inference Server's names
for the same figures, so dashboards built for Triton read an overdrive server unchanged.

Every series of a model is present at 0 from the moment the model is registered. Triton's names
(from its metrics documentation, `nv_inference_*`, labels `model` and `version`) are exported as
series under their exact names (declared `untyped`: the Prometheus client library names every counter
`*_total`, Triton's counters have no suffix; PromQL's rate() reads them alike), computed from
overdrive's own figures:

    nv_inference_request_success          requests answered 200
    nv_inference_request_failure          requests answered with an error, or dropped (any reason)
    nv_inference_count                    rows run by the model (Triton: inferences)
    nv_inference_exec_count               batches run (Triton: model executions)
    nv_inference_request_duration_us      end-to-end time of answered requests, µs, cumulative
    nv_inference_queue_duration_us        time requests waited for their batch, µs, cumulative
    nv_inference_compute_infer_duration_us  model time per batch, µs, cumulative (Triton counts it per
                                          request; here per batch, as the batcher runs it)
    nv_inference_pending_request_count    rows waiting in the queue (Triton: requests)

A client that disconnects before its answer (HTTP 499) is counted in
`overdrive_client_disconnects_total`, never among the responses sent
(`overdrive_requests_total{status}`).
"""

from __future__ import annotations

import time
from collections import defaultdict

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import Metric

REJECTION_REASONS = ("invalid", "too_large", "queue_full", "timeout", "client_disconnected", "shutting_down",
                     "model_error", "nonfinite_output", "warming_up", "unavailable")
LATENCY_BUCKETS = (.0005, .001, .002, .005, .01, .02, .05, .1, .2, .5, 1, 2, 5, 10, 30)


class Metrics:
    """The metrics of one server (all its models), in their own registry."""

    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("overdrive_requests", "Inference responses sent, by HTTP status (gRPC: the HTTP "
                                "equivalent)", ["model", "status"], registry=r)
        self.request_seconds = Histogram("overdrive_request_duration_seconds", "End-to-end time of answered requests, "
                                         "from the request read to the response ready", ["model"], registry=r,
                                         buckets=LATENCY_BUCKETS)
        self.queue_seconds = Histogram("overdrive_queue_duration_seconds", "Time from arrival to the start of its batch",
                                       ["model"], registry=r, buckets=LATENCY_BUCKETS)
        self.compute_seconds = Histogram("overdrive_compute_duration_seconds", "Model time per batch", ["model"],
                                         registry=r, buckets=LATENCY_BUCKETS[:-1])
        self.batch_rows = Histogram("overdrive_batch_size", "Rows per model batch", ["model"], registry=r,
                                    buckets=[2 ** i for i in range(12)])
        self.batch_requests = Histogram("overdrive_batch_requests", "Requests (or chunks) per model batch", ["model"],
                                        registry=r, buckets=[2 ** i for i in range(12)])
        self.queue_depth = Gauge("overdrive_queue_depth", "Rows waiting in the queue", ["model"], registry=r)
        self.in_flight = Gauge("overdrive_inflight_requests", "Requests admitted and not yet answered", ["model"],
                               registry=r)
        self.busy = Counter("overdrive_instance_busy_seconds", "Seconds each model instance spent running batches "
                            "(its utilisation: the rate of this counter)", ["model", "instance"], registry=r)
        self.cold = Counter("overdrive_cold_batches", "Batches of a size the warm-up did not run (the first one of "
                            "each size pays kernel set-up)", ["model"], registry=r)
        self.rejections = Counter("overdrive_rejections", "Requests refused or dropped, by reason", ["model", "reason"],
                                  registry=r)
        self.disconnects = Counter("overdrive_client_disconnects", "Clients gone before their answer (HTTP 499): not "
                                   "among the responses sent", ["model"], registry=r)
        self._totals: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))  # model → figure → value
        r.register(_TritonNames(self))

    def add_model(self, model: str, instances: int) -> ModelMetrics:
        """Register a model: every one of its series exists (at 0) from now on."""
        for metric in (self.request_seconds, self.queue_seconds, self.compute_seconds, self.batch_rows,
                       self.batch_requests, self.queue_depth, self.in_flight, self.cold, self.disconnects):
            metric.labels(model)
        for status in ("200", "400", "404", "413", "500", "503", "504"):
            self.requests.labels(model, status)
        for reason in REJECTION_REASONS:
            self.rejections.labels(model, reason)
        for i in range(instances):
            self.busy.labels(model, str(i))
        self._totals[model]  # noqa: B018 — created at 0
        return ModelMetrics(self, model)


class ModelMetrics:
    """One model's observations: what the batcher reports (`BatcherMetrics`), and the server's.
    The labelled series are looked up once (a `labels()` call takes a lock and a dict lookup)."""

    def __init__(self, metrics: Metrics, model: str):
        self.m, self.model = metrics, model
        self.totals = metrics._totals[model]  # noqa: SLF001
        m = metrics
        self._rows, self._requests = m.batch_rows.labels(model), m.batch_requests.labels(model)
        self._compute, self._queue = m.compute_seconds.labels(model), m.queue_seconds.labels(model)
        self._depth, self._in_flight = m.queue_depth.labels(model), m.in_flight.labels(model)
        self._latency, self._ok = m.request_seconds.labels(model), m.requests.labels(model, "200")
        self._busy: dict[int, object] = {}

    # BatcherMetrics
    def batch(self, rows: int, requests: int, compute_s: float, instance: int = 0) -> None:
        self._rows.observe(rows)
        self._requests.observe(requests)
        self._compute.observe(compute_s)
        busy = self._busy.get(instance) or self._busy.setdefault(instance, self.m.busy.labels(self.model, str(instance)))
        busy.inc(compute_s)
        self.totals["rows"] += rows
        self.totals["batches"] += 1
        self.totals["compute_s"] += compute_s

    def queued(self, seconds: float) -> None:
        self._queue.observe(seconds)
        self.totals["queue_s"] += seconds

    def depth(self, rows: int) -> None:
        self._depth.set(rows)
        self.totals["pending"] = rows

    def rejected(self, reason: str) -> None:
        self.m.rejections.labels(self.model, reason).inc()
        if reason == "client_disconnected":
            self.m.disconnects.labels(self.model).inc()
        self.totals["failure"] += 1

    # the server's
    def cold_batch(self) -> None:
        self.m.cold.labels(self.model).inc()

    def answered(self, status: int, started: float) -> None:
        """A response was sent (never called for a client that went away)."""
        if status == 200:
            seconds = time.perf_counter() - started
            self._ok.inc()
            self._latency.observe(seconds)
            self.totals["success"] += 1
            self.totals["request_s"] += seconds
        else:
            self.m.requests.labels(self.model, str(status)).inc()

    def admitted(self, delta: int) -> None:
        self._in_flight.inc(delta)


class _TritonNames:
    """Triton Inference Server's metric names, read off overdrive's figures at scrape time."""

    FIGURES = [("nv_inference_request_success", "unknown", "success", 1, "Number of successful inference requests"),
               ("nv_inference_request_failure", "unknown", "failure", 1, "Number of failed inference requests"),
               ("nv_inference_count", "unknown", "rows", 1, "Number of inferences performed (rows)"),
               ("nv_inference_exec_count", "unknown", "batches", 1, "Number of model executions (batches)"),
               ("nv_inference_request_duration_us", "unknown", "request_s", 1e6,
                "Cumulative end-to-end inference request duration in microseconds"),
               ("nv_inference_queue_duration_us", "unknown", "queue_s", 1e6,
                "Cumulative inference queuing duration in microseconds"),
               ("nv_inference_compute_infer_duration_us", "unknown", "compute_s", 1e6,
                "Cumulative compute inference duration in microseconds (per batch)"),
               ("nv_inference_pending_request_count", "gauge", "pending", 1,
                "Instantaneous number of pending rows awaiting execution")]

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def collect(self):
        for name, kind, key, scale, doc in self.FIGURES:
            family = Metric(name, doc, kind)
            for model, totals in list(self.metrics._totals.items()):  # noqa: SLF001
                family.add_sample(name, {"model": model, "version": "1"}, totals[key] * scale)
            yield family
