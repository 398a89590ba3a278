"""What `optimize` and `bench` share: resolving the user's arguments, and the batch-size sweep."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from overdrive.core.devices import resolve_device
from overdrive.core.errors import UserError, one_line
from overdrive.core.measure import Measurement, cycle_indices, measure
from overdrive.optimize.plan import Step, build
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
    out_dir: Path

    def describe_samples(self) -> str:
        if self.num_distinct_samples < self.num_samples:
            return (f"{self.num_samples} evaluation rows ({self.num_distinct_samples} distinct samples, repeated "
                    f"to fill batch size {self.batch_size})")
        return f"{self.num_samples} evaluation samples"

    def sweep_sizes(self, requested: list[int]) -> list[int]:
        """The batch sizes a sweep can use: only the fixed one for static-batch models."""
        fixed = self.workload.fixed_batch_size
        return [fixed] if fixed else requested


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise UserError(f"--input-dtype {name!r} is not a torch dtype; expected e.g. float32, int64")
    return dtype


def open_session(args, *, batch_size: int | None = None) -> Session:
    """Resolve device, workload, batch size, sample count and output folder from CLI args.

    Raises:
        UserError: any of them is invalid (the message names what was expected).
    """
    device = resolve_device(args.device)
    workload = create_workload(args.workload, input_shape=args.input_shape, input_dtype=parse_dtype(args.input_dtype))
    batch_size = batch_size or args.batch_size or workload.fixed_batch_size or workload.default_batch_size
    if workload.fixed_batch_size and batch_size != workload.fixed_batch_size:
        raise UserError(f"{args.workload} accepts only batch size {workload.fixed_batch_size} (it was exported with a "
                        f"static batch dimension); pass --batch-size {workload.fixed_batch_size}, or export it with "
                        "a dynamic batch (torch.export.Dim)")
    default_n = DEFAULT_TEXT_SAMPLES if workload.is_text else len(workload.samples)
    distinct = min(args.num_samples or default_n, len(workload.samples))
    num_samples = max(distinct, batch_size)  # a batch is always full; samples repeat when there are too few
    safe_name = re.sub(r"[^A-Za-z0-9_.-]+", "_", workload.name).strip("_") or "workload"
    out_dir = Path(args.out) / safe_name
    try:  # fail now, not after minutes of measuring
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise UserError(f"--out {args.out}: cannot write results under {out_dir} ({exc.strerror or exc}); "
                        "expected a writable folder") from None
    return Session(
        workload=workload,
        spec=args.workload,
        device=device,
        batch_size=batch_size,
        num_samples=num_samples,
        num_distinct_samples=distinct,
        out_dir=out_dir,
    )


def measure_steps(session: Session, steps: list[Step], *, batch_size: int, reference: torch.Tensor | None = None,
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


def sweep(session: Session, configs: dict[str, list[Step]], batch_sizes: list[int],
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
