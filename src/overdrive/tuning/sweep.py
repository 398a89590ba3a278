"""What `optimize` and `bench` share: resolving the user's arguments, and the batch-size sweep."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from overdrive.core.devices import resolve_device
from overdrive.core.errors import ConfigError, arg, one_line
from overdrive.core.measure import Measurement, cycle_indices, measure
from overdrive.techniques import TechniqueConfig
from overdrive.tuning.plan import build
from overdrive.workloads import Workload, create_workload

DEFAULT_TEXT_SAMPLES = 512


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
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"{arg('out', root)}: cannot write results under {folder} ({exc.strerror or exc}); "
                          "expected a writable folder") from None
    return folder


def open_session(workload: str | Workload, *, device: str | torch.device | None = "auto", batch_size: int | None = None,
                 num_samples: int | None = None, out: str | Path | None = None,
                 input_shape: tuple[int, ...] | None = None, input_dtype: str | torch.dtype = "float32",
                 data: str | Path | Iterable | None = None, text_field: str | None = None) -> Session:
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

    Raises:
        ConfigError: a device, batch size, dtype or folder that cannot work (the message names it).
        WorkloadError: the workload cannot be built.
        DataError: `data` cannot be read or does not suit the model.
    """
    device = device if isinstance(device, torch.device) else resolve_device(device)
    spec = workload if isinstance(workload, str) else workload.name
    if isinstance(workload, str):
        workload = create_workload(workload, input_shape=input_shape, input_dtype=parse_dtype(input_dtype))
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
    return Session(
        workload=workload,
        spec=spec,
        device=device,
        batch_size=batch_size,
        num_samples=max(distinct, batch_size),  # a batch is always full; samples repeat when there are too few
        num_distinct_samples=distinct,
        out_dir=writable_folder(out, workload.name) if out is not None else None,
    )


def measure_steps(session: Session, steps: list[TechniqueConfig], *, batch_size: int, reference: torch.Tensor | None = None,
                  min_timed_calls: int = 5, reports: list[dict] | None = None) -> tuple[Measurement, torch.Tensor]:
    """Build `steps` on the session's workload and measure them at `batch_size` on the same
    samples `optimize` judged (cycled up to one full batch when there are fewer). Technique
    reports (pruning) are appended to `reports` when given."""
    indices = cycle_indices(max(session.num_distinct_samples, batch_size), len(session.workload.samples))
    model, policy = build(session.workload, steps, session.device, reports)
    try:
        return measure(model, session.workload, device=session.device, batch_size=batch_size,
                       indices=indices, policy=policy, reference=reference,
                       min_timed_calls=min_timed_calls, min_timed_s=0.5)
    finally:
        del model
        torch.compiler.reset()


def sweep(session: Session, configs: dict[str, list[TechniqueConfig]], batch_sizes: list[int],
          progress=lambda _: None, warn=lambda _: None,
          reports: dict[str, list[dict]] | None = None) -> dict[str, list[tuple[int, Measurement]]]:
    """Measure each configuration at each batch size; fidelity against the baseline at that size.
    `reports`, when given, receives each configuration's technique reports from its first build.

    A configuration that fails at a batch size is reported through `warn` and left out of
    that point; the rest of the sweep goes on.

    Returns:
        {label: [(batch_size, measurement), ...]} in the order given.
    """
    out: dict[str, list[tuple[int, Measurement]]] = {label: [] for label in configs}
    for b in batch_sizes:
        reference = None
        for label, steps in configs.items():
            progress(f"{label} @ batch {b}")
            try:
                collected: list[dict] = []
                m, outputs = measure_steps(session, steps, batch_size=b, reference=reference, reports=collected)
                if reports is not None:
                    reports.setdefault(label, collected)
            except Exception as exc:  # noqa: BLE001 - one failing point must not lose the others
                warn(f"{label} at batch size {b} failed: {one_line(exc)}")
                continue
            if reference is None and not steps:
                reference = outputs
                m.fidelity = session.workload.fidelity(outputs, outputs)
            out[label].append((b, m))
    return out


def compare_plan(session: Session, plan, batch_sizes: list[int], progress=lambda _: None,
                 ) -> tuple[dict[str, list[tuple[int, Measurement]]], list[str], dict[str, list[dict]]]:
    """The eager fp32 baseline and `plan` (a Plan, or None for the baseline alone) measured at each
    batch size, the plan's fidelity against the baseline at the same size; `progress` is called
    with a description before each measurement.

    Returns:
        (curves {label: [(batch size, Measurement)]}, the baseline first; the points that failed,
        one line each; the technique reports of each configuration's first build).
    """
    configs = {"baseline (eager fp32)": []}
    if plan is not None:
        configs["plan: " + (" + ".join(plan.names) or "baseline")] = plan.steps
    failures: list[str] = []
    reports: dict[str, list[dict]] = {}
    curves = sweep(session, configs, batch_sizes, progress=progress, warn=failures.append, reports=reports)
    return curves, failures, reports

