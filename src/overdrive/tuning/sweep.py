"""What `optimize` and `bench` share: resolving the user's arguments, and the batch-size sweep."""

from __future__ import annotations

import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from overdrive.core.devices import resolve_device
from overdrive.core.errors import ConfigError, arg, one_line
from overdrive.core.flops import count_flops_per_sample, layer_flop_share
from overdrive.core.gain import RECHECK_ROUNDS, RECHECK_WIDTH, Gain, compare
from overdrive.core.measure import (
    TIMING_ROWS,
    Measurement,
    Runner,
    cycle_indices,
    judge_outputs,
)
from overdrive.core.roofline import weight_bytes
from overdrive.techniques import TechniqueConfig, technique_for
from overdrive.techniques.registry import compute_dtype, compute_layers, fallbacks
from overdrive.techniques.compose import build
from overdrive.workloads import Workload, create_workload

DEFAULT_TEXT_SAMPLES = 512
_UNSET = object()


@dataclass(kw_only=True)
class Session:
    workload: Workload
    spec: str
    device: torch.device
    batch_size: int
    num_samples: int  # rows evaluated per measurement (≥ batch_size)
    num_distinct_samples: int  # of which distinct; fewer when samples repeat to fill a batch
    out_dir: Path | None  # where results are written; None: nowhere

    def describe_samples(self) -> str:
        if self.num_distinct_samples < self.num_samples:
            return (f"{self.num_samples} evaluation rows ({self.num_distinct_samples} distinct samples, repeated "
                    f"to fill batch size {self.batch_size})")
        return f"{self.num_samples} evaluation samples"

    def sweep_sizes(self, requested: list[int]) -> list[int]:
        """The batch sizes a sweep can use: only the fixed one for static-batch models."""
        fixed = self.workload.fixed_batch_size
        return [fixed] if fixed else requested

    def refused_sizes(self, requested: list[int]) -> list[str]:
        """Why each of `requested` that the model cannot take is not measured (a static-batch model
        takes one size): failures to report, not sizes to drop without a word."""
        fixed = self.workload.fixed_batch_size
        return [f"batch size {b}: {self.spec} takes only batch size {fixed} (exported with a static batch dimension)"
                for b in requested if fixed and b != fixed]


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"{arg('input_dtype', name)} is not a torch dtype; expected e.g. float32, int64")
    return dtype


def writable_folder(root: str | Path, name: str) -> Path:
    """ROOT/<name made safe for a path>, created and checked writable now, not after minutes of measuring.

    Raises:
        ConfigError: it cannot be written.
    """
    folder = Path(root) / (re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "workload")
    _check_writable(folder, root)
    return folder


def _check_writable(folder: Path, root: str | Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"{arg('out', root)}: cannot write results under {folder} ({exc.strerror or exc}); "
                          "expected a writable folder") from None


def open_session(workload: str | Workload, *, device: str | torch.device | None = "auto", batch_size: int | None = None,
                 num_samples: int | None = None, out: str | Path | None = None,
                 input_shape: tuple[int, ...] | None = None, input_dtype: str | torch.dtype = "float32",
                 data: str | Path | Iterable | None = None, text_field: str | None = None,
                 weights: str | Path | None = None, dynamic_dims: dict | None = None) -> Session:
    """Resolve the device, workload, batch size, sample count and output folder.

    Args:
        workload: a workload spec (see `create_workload`) or a built Workload.
        data: the user's evaluation rows, judged instead of the workload's own samples (see
            `overdrive.workloads.data.with_data`); `text_field` names their JSONL field / CSV column.
        device: "auto", "cpu", "cuda", "cuda:N" or a torch.device.
        batch_size: rows per call; None: the workload's (its fixed one for static-batch models).
        num_samples: distinct evaluation samples; None: 512 for text, all otherwise.
        out: results go to OUT/<workload name>/ (checked writable now); None: nowhere.
        input_shape, input_dtype: for model files that store no input shape (TorchScript).
        dynamic_dims: for a spec: the dimensions whose size varies from row to row
            (`overdrive.workloads.user.workload_from_model`).
        weights: a checkpoint loaded into the model (`overdrive.workloads.weights`): a DCP folder
            `train` wrote, or a torch.save state dict.

    Raises:
        ConfigError: a device, batch size, dtype or folder that cannot work (the message names it).
        WorkloadError: the workload cannot be built.
        DataError: `data` cannot be read or does not suit the model.
    """
    device = device if isinstance(device, torch.device) else resolve_device(device)
    if out is not None:  # before the model is built (digits-cnn trains, a user's factory may take minutes)
        _check_writable(Path(out), out)
    spec = workload if isinstance(workload, str) else workload.name
    if isinstance(workload, str):
        workload = create_workload(workload, input_shape=input_shape, input_dtype=parse_dtype(input_dtype),
                                   dynamic_dims=dynamic_dims)
    if weights is not None:
        from overdrive.workloads.weights import load_weights

        load_weights(workload, weights)
    if data is not None:
        from overdrive.workloads.data import with_data

        workload = with_data(workload, data, text_field=text_field, max_rows=num_samples)
    elif text_field is not None:
        raise ConfigError(f"{arg('text_field')} names the text column of {arg('data')}; give the data file too")
    batch_size = batch_size or workload.fixed_batch_size or workload.default_batch_size
    if workload.fixed_batch_size and batch_size != workload.fixed_batch_size:
        raise ConfigError(f"{spec} accepts only batch size {workload.fixed_batch_size} (it was exported with a "
                          f"static batch dimension); pass {arg('batch_size', workload.fixed_batch_size)}, or export "
                          "it with a dynamic batch (torch.export.Dim)")
    default_n = DEFAULT_TEXT_SAMPLES if workload.is_text else len(workload.samples)
    distinct = min(num_samples or default_n, len(workload.samples))
    if num_samples is not None and num_samples > len(workload.samples):
        note = f"{num_samples} evaluation rows asked for, the workload holds {len(workload.samples)}: all are used"
        if note not in workload.notes:
            workload.notes.append(note)
    return Session(
        workload=workload,
        spec=spec,
        device=device,
        batch_size=batch_size,
        num_samples=max(distinct, batch_size),  # a batch is always full; samples repeat when there are too few
        num_distinct_samples=distinct,
        out_dir=writable_folder(out, workload.name) if out is not None else None,
    )


def sweep(session: Session, configs: dict[str, list[TechniqueConfig]], batch_sizes: list[int],
          progress=lambda _: None, warn=lambda _: None, reports: dict[str, list[dict]] | None = None, *,
          rounds: int = RECHECK_ROUNDS, max_rows: int | None = None, audit: bool = False,
          notice=lambda _: None, max_rounds: int | None = None,
          max_width: float | None = None, stop=lambda last_s: False) -> dict[str, list[tuple[int, Measurement]]]:
    """Measure each configuration at each batch size, on the same rows `optimize` judged (cycled up
    to one full batch when there are fewer; passes timed over the first `TIMING_ROWS`, as there). When the first configuration is the eager baseline
    (no steps), every other one is timed against it in `rounds` interleaved rounds
    (`gain.compare`), so its `gain` (speedup with a 99% interval) is the one `optimize` reports,
    and its fidelity is against the baseline at the same batch size.

    Args:
        reports: when given, receives each configuration's technique reports from its first build.
        rounds: interleaved rounds per configuration and batch size (at least, with `max_rounds`).
        max_rounds, max_width: with these, each comparison goes on past `rounds` until its 99% interval is
            no wider than `max_width` (high / low), or `max_rounds` rounds (`gain.compare`).
        max_rows: rows per pass at most (the report's curve needs no full pass); None: all of them.
        audit: also audit one forward of each configuration at each size (`core.audit`, `Measurement.audit`).
        notice: called with what makes a point's figures partly something else (CUDA-graph shapes run eagerly).
        stop: called before each batch size after the first with the seconds the last one took; True leaves
            the rest out (a warning says which): optimize's time budget.

    Every measurement gets its roofline point (`Measurement.roofline`): the FLOPs per sample a pruning
    step left, else the first model's (counted eagerly), against this device's measured peaks.

    A configuration that fails at a batch size is reported through `warn` and left out of
    that point; the rest of the sweep goes on.

    Returns:
        {label: [(batch_size, measurement), ...]} in the order given.
    """
    workload = session.workload
    out: dict[str, list[tuple[int, Measurement]]] = {label: [] for label in configs}
    first_flops, first_weights, shares = _UNSET, None, {}
    first = next(iter(configs), None)
    baseline_label = first if first is not None and not configs[first] else None
    last_s = 0.0
    for k, b in enumerate(batch_sizes):
        if k and stop(last_s):
            warn(f"batch sizes {', '.join(str(x) for x in batch_sizes[k:])} left out of the sweep: the time budget "
                 "would not cover them")
            break
        point_started = time.monotonic()
        rows = max(session.num_distinct_samples, b) if max_rows is None else max(b, min(session.num_distinct_samples, max_rows))
        indices = cycle_indices(rows, len(workload.samples))
        runners: dict[str, Runner] = {}
        outputs: dict[str, torch.Tensor] = {}
        gains: dict[str, Gain] = {}
        flops: dict[str, float | None] = {}
        try:
            for label, steps in configs.items():
                progress(f"{label} @ batch {b}")
                try:
                    collected: list[dict] = []
                    model, policy = build(workload, steps, session.device, collected)
                    if first_flops is _UNSET:
                        first_flops = count_flops_per_sample(model, workload, device=session.device, indices=indices)
                        first_weights = weight_bytes(model)
                        shares = {layers: layer_flop_share(model, workload, device=session.device, indices=indices,
                                                           layer_types=layers)
                                  for layers in {compute_layers(s) for s in configs.values()} if layers is not None}
                    flops[label] = next((r["flops_per_sample_after"] for r in reversed(collected)
                                         if r.get("flops_per_sample_after")), first_flops)
                    runners[label] = Runner(model, workload, device=session.device, batch_size=b, indices=indices,
                                            policy=policy, timing_rows=TIMING_ROWS)
                    outputs[label] = runners[label].warm_up()
                    if reports is not None:
                        reports.setdefault(label, collected)
                    if label != baseline_label and baseline_label in runners:
                        gains[label] = compare(runners[baseline_label], runners[label], min_gain=0.0, min_rounds=rounds,
                                               max_rounds=max_rounds or rounds, max_width=max_width)
                    elif baseline_label is None:
                        for _ in range(rounds):
                            runners[label].timed_pass()
                except Exception as exc:  # noqa: BLE001 - one failing point must not lose the others
                    warn(f"{label} at batch size {b} failed: {one_line(exc)}")
                    runners.pop(label, None)
            if baseline_label in runners and not runners[baseline_label].pass_s:  # the baseline alone
                for _ in range(rounds):
                    runners[baseline_label].timed_pass()
            reference = outputs.get(baseline_label)
            for label, runner in runners.items():
                m = judge_outputs(runner.measurement(), workload, outputs[label], indices, reference)
                m.gain = gains.get(label)
                steps = configs[label]
                share = shares.get(compute_layers(steps)) if compute_layers(steps) is not None else 1.0
                m.roofline = runner.roofline(flops[label], compute_dtype(steps), m.samples_per_s, fp32_weights=first_weights,
                                             dtype_share=1.0 if share is None else share)
                fell_back = fallbacks(runner.model)
                if fell_back:  # not a failure: said, with the figures
                    notice(f"{label} at batch size {b}: {fell_back}")
                if audit:  # asked for: a failure is one of the point's failures
                    try:
                        m.audit = runner.audit(opaque=any(technique_for(s).leaves_pytorch for s in steps))
                    except Exception as exc:  # noqa: BLE001 - the user's model under the counting modes
                        warn(f"{label} at batch size {b}: the audit failed: {one_line(exc)}")
                out[label].append((b, m))
        finally:
            for runner in runners.values():
                runner.model, runner.batches = None, []
            runners.clear()
            torch.compiler.reset()
            last_s = time.monotonic() - point_started
    return out


def compare_plan(session: Session, plan, batch_sizes: list[int], progress=lambda _: None, *, audit: bool = False,
                 notice=lambda _: None) -> tuple[dict[str, list[tuple[int, Measurement]]], list[str], dict[str, list[dict]]]:
    """The eager fp32 baseline and `plan` (a Plan, or None for the baseline alone) measured at each
    batch size, interleaved (`sweep`): the plan's gain over the baseline with its 99% interval (timed
    until it is no wider than `RECHECK_WIDTH`, or `3 × RECHECK_ROUNDS` rounds), and its fidelity against the
    baseline at the same size; `progress` is called with a description before each measurement.

    Returns:
        (curves {label: [(batch size, Measurement)]}, the baseline first; the points that failed,
        one line each; the technique reports of each configuration's first build).
    """
    configs = {"baseline (eager fp32)": []}
    if plan is not None:
        configs["plan: " + (" + ".join(plan.names) or "baseline")] = plan.steps
    failures: list[str] = []
    reports: dict[str, list[dict]] = {}
    curves = sweep(session, configs, batch_sizes, progress=progress, warn=failures.append, reports=reports, audit=audit,
                   notice=notice, max_rounds=3 * RECHECK_ROUNDS, max_width=RECHECK_WIDTH)
    return curves, failures, reports

