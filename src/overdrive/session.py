"""What `optimize` and `bench` share: resolving the user's arguments, and the batch-size sweep."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from overdrive.devices import resolve_device
from overdrive.errors import UserError
from overdrive.measure import Measurement, cycle_indices, measure
from overdrive.plan import Step, build
from overdrive.workloads import Workload, create_workload

DEFAULT_TEXT_SAMPLES = 512


@dataclass(kw_only=True)
class Session:
    workload: Workload
    spec: str
    device: torch.device
    batch_size: int
    num_samples: int
    out_dir: Path


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
    default_n = DEFAULT_TEXT_SAMPLES if workload.is_text else len(workload.samples)
    num_samples = min(args.num_samples or default_n, len(workload.samples))
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
        batch_size=batch_size or args.batch_size or workload.default_batch_size,
        num_samples=num_samples,
        out_dir=out_dir,
    )


def measure_steps(session: Session, steps: list[Step], *, batch_size: int, reference: torch.Tensor | None = None,
                  num_samples: int | None = None, min_timed_calls: int = 5) -> tuple[Measurement, torch.Tensor]:
    """Build `steps` on the session's workload and measure them at `batch_size` on the first
    `num_samples` samples (default: two batches' worth, cycled when the workload has fewer)."""
    available = len(session.workload.samples)
    indices = cycle_indices(max(num_samples or 2 * batch_size, batch_size), available)
    model, policy = build(session.workload, steps, session.device)
    try:
        return measure(model, session.workload, device=session.device, batch_size=batch_size,
                       indices=indices, policy=policy, reference=reference,
                       min_timed_calls=min_timed_calls, min_timed_s=0.5)
    finally:
        del model
        torch.compiler.reset()


def sweep(session: Session, configs: dict[str, list[Step]], batch_sizes: list[int],
          progress=lambda _: None) -> dict[str, list[tuple[int, Measurement]]]:
    """Measure each configuration at each batch size; fidelity against the baseline at that size.

    Returns:
        {label: [(batch_size, measurement), ...]} in the order given.
    """
    out: dict[str, list[tuple[int, Measurement]]] = {label: [] for label in configs}
    for b in batch_sizes:
        reference = None
        for label, steps in configs.items():
            progress(f"{label} @ batch {b}")
            m, outputs = measure_steps(session, steps, batch_size=b, reference=reference)
            if reference is None and not steps:
                reference = outputs
                m.fidelity = session.workload.fidelity(outputs, outputs)
            out[label].append((b, m))
    return out
