"""`load` and `bench` (exported by `overdrive`): a plan `optimize` made, rebuilt on a model and
measured again; a module measured as it is."""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from overdrive.core.digest import weights_fingerprint
from overdrive.core.errors import ConfigError, WorkloadError, arg
from overdrive.core.flops import count_flops_per_sample
from overdrive.core.measure import Measurement, cycle_indices, measure
from overdrive.core.workload import Workload
from overdrive.tuning.api import PYTHON_MODEL_PREFIX, data_left, as_workload
from overdrive.tuning.plan import Plan, load_plan
from overdrive.techniques.compose import build
from overdrive.tuning.sweep import compare_plan, open_session
from overdrive.workloads.structured import user_facing


def load(plan: str | Path, model: nn.Module | Workload | None = None, *, example_inputs=None,
         device: str | torch.device = "auto") -> nn.Module:
    """Rebuild a saved plan: its techniques applied to a fresh copy of the model, on the device.

    Args:
        plan: a plan.json written by `optimize` (`result.save`, or `overdrive optimize`).
        model: the model (or Workload) the plan was made for; it is copied, not changed. None:
            the plan's own workload (a built-in name, factory or file).
        example_inputs: inputs [B, ...] for techniques that trace the model (channel pruning);
            None: rows of the names, shapes and dtypes the plan recorded (seeded normal floats,
            integer zeros, masks of ones).
        device: "auto" (the device type the plan was tuned on), "cpu", "cuda" or "cuda:N".

    Returns:
        The optimized module in eval mode, on the device, called as your model is: the same
        arguments (`fast(**inputs)` for a model given a dict example), and for structured outputs
        the same structure holding the outputs the plan judged (as `OptimizeResult.model`).

    Warns:
        PlanWeightsWarning: `model`'s weights are not those the plan was measured on (its figures
            were measured on other weights; the rebuilt model still computes with `model`'s).

    Raises:
        PlanError: the file is not a plan, names missing checkpoints, or was tuned on another device type.
        ConfigError: a plan made from a Python module, loaded without `model`.
    """
    device_name = str(device) if isinstance(device, torch.device) else device
    loaded, resolved, _ = load_plan(plan, device=device_name)
    if model is None:
        if loaded.workload.startswith(PYTHON_MODEL_PREFIX):
            raise ConfigError(f"{plan} was made from a Python module ({loaded.workload}); pass that module as "
                              f"{arg('model')}")
        workload = open_session(loaded.create_workload(), device=resolved, batch_size=loaded.batch_size).workload
    elif isinstance(model, Workload):
        workload = model
    else:  # the workload optimize measured: the same input names, judged outputs and varying dimensions
        workload = as_workload(model, example_inputs if example_inputs is not None else _example_from(loaded),
                               output=loaded.outputs, dynamic_dims=loaded.dynamic_dims or {})
    if model is not None and loaded.model_sha256 and weights_fingerprint(workload.model) != loaded.model_sha256:
        warnings.warn(f"{plan}: this model's weights differ from those optimize measured the plan on (another "
                      "initialisation, a changed architecture or fine-tuned weights?): the plan's speedup and fidelity "
                      "were measured on other weights; optimize this model for figures that hold for it",
                      PlanWeightsWarning, stacklevel=2)
    return user_facing(build(workload, loaded.steps, resolved)[0], workload.model)


class PlanWeightsWarning(UserWarning):
    """`load(plan, model)` was given a model whose weights are not those the plan was measured on."""


def _example_from(plan: Plan) -> tuple[torch.Tensor, ...] | dict[str, torch.Tensor]:
    """A batch of the plan's batch size with the recorded input names, row shapes and dtypes: seeded
    normal floats, integer zeros (token ids), ones for masks (a mask of zeros is all padding); a dict
    when the plan recorded names."""
    if not plan.inputs:
        raise ConfigError(f"the plan records no input shapes; pass {arg('example_inputs')}")
    generator = torch.Generator().manual_seed(0)
    example = []
    for spec in plan.inputs:
        dtype = getattr(torch, spec["dtype"])
        shape = (plan.batch_size, *spec["shape"])
        if dtype.is_floating_point:
            example.append(torch.randn(shape, generator=generator).to(dtype))
        else:
            mask = "mask" in str(spec.get("name", "")) or dtype == torch.bool
            example.append(torch.ones(shape, dtype=dtype) if mask else torch.zeros(shape, dtype=dtype))
    names = [spec.get("name") for spec in plan.inputs]
    return dict(zip(names, example)) if all(names) else tuple(example)


def _weights_dtype(model: nn.Module) -> str:
    """The floating dtype most of `model`'s parameters are stored in ("float32" when it has none), the
    dtype whose GEMM peak is its compute roof."""
    counts: dict[torch.dtype, int] = {}
    for p in model.parameters():
        if p.is_floating_point():
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    dtype = max(counts, key=counts.get) if counts else torch.float32
    return {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(dtype, "float32")


def bench(model: str | nn.Module, example_inputs=None, *, batch_sizes: list[int] | None = None,
          device: str | torch.device | None = None, plan: str | Path | None = None,
          data: Iterable | str | Path | None = None, num_samples: int | None = None,
          text_field: str | None = None, audit: bool = False) -> dict[int, Measurement]:
    """Measure latency, throughput and peak memory at each batch size.

    Args:
        model: a module (measured as it is, e.g. `result.model` or `load(...)`) with
            `example_inputs`, or a workload name / spec (its eager fp32 model, or `plan`'s).
        example_inputs: for a module: a tensor or tuple of tensors [B, ...].
        batch_sizes: rows per call; None: B, the example's (or the plan's, the workload's).
        device: for a module: where its inputs go (None: the device of its first parameter,
            else the CPU); for a workload: "auto", "cpu", "cuda", "cuda:N".
        plan: for a workload: a plan.json whose model is measured; its fidelity against the eager
            fp32 model at the same batch size is filled in.
        data: the rows measured: for a module, batches like `example_inputs` (default: the
            example's rows); for any model, a file as for `optimize`; `text_field` names the text
            column of a .jsonl / .csv file.
        num_samples: rows per measurement (≥ the batch size); None: 512 for text, all otherwise.
        audit: also audit one forward at each size (`Measurement.audit`: host↔device copies, syncs,
            operations; see `overdrive.core.audit`).

    Every Measurement has its roofline point (`Measurement.roofline`) against this device's measured peaks.

    Returns:
        {batch size: Measurement}, in the order of `batch_sizes` (static-batch models: their one size).

    Raises:
        ConfigError, WorkloadError, PlanError: as for `optimize` and `load`.
    """
    if isinstance(model, nn.Module):
        workload = as_workload(model, example_inputs, data=data)
        if device is None:
            first = next(iter([*model.parameters(), *model.buffers()]), None)
            device = first.device if first is not None else torch.device("cpu")
        session = open_session(workload, device=device, num_samples=num_samples, data=data_left(model, data),
                               text_field=text_field)
        workload = session.workload
        if session.refused_sizes(batch_sizes or []):
            raise ConfigError(f"{arg('batch_sizes', batch_sizes)}: {session.refused_sizes(batch_sizes)[0]}")
        sizes = session.sweep_sizes(batch_sizes or [session.batch_size])
        # The workload's model is `model` as it is called with the workload's inputs (keyword inputs, structured
        # outputs flattened), not a copy.
        called = workload.model
        indices = cycle_indices(session.num_distinct_samples, len(workload.samples))
        flops = count_flops_per_sample(called, workload, device=session.device, indices=indices)
        out = {}
        for b in sizes:
            indices = cycle_indices(max(session.num_distinct_samples, b), len(workload.samples))
            out[b] = measure(called, workload, device=session.device, batch_size=b, indices=indices, min_timed_calls=5,
                             min_timed_s=0.5, flops_per_sample=flops, dtype=_weights_dtype(model), audit=audit)[0]
        return out
    loaded = None
    if plan is not None:
        loaded, device, _ = load_plan(plan, device=device or "auto", workload=model)
    session = open_session(model, device=device or "auto", batch_size=loaded.batch_size if loaded else None,
                           num_samples=num_samples, data=data, text_field=text_field)
    if session.refused_sizes(batch_sizes or []):
        raise ConfigError(f"{arg('batch_sizes', batch_sizes)}: {session.refused_sizes(batch_sizes)[0]}")
    curves, failures, _ = compare_plan(session, loaded, session.sweep_sizes(batch_sizes or [session.batch_size]),
                                       audit=audit)
    if failures:
        raise WorkloadError("; ".join(failures))
    return dict(curves[list(curves)[-1]])
