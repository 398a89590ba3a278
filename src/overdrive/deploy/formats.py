"""`overdrive export`: what a plan found, in the forms users deploy.

- `onnx`: the plan's model as an ONNX file, proved against PyTorch on real rows
  (`overdrive.files.onnx`); a plan whose runtime is ONNX Runtime gives the very file it ran
  (int8 included).
- `pt2`: a torch.export program (`torch.export.save`), dynamic batch and sequence axes, proved by
  loading it back; `overdrive optimize/serve/run FILE.pt2` and `torch.export.load` read it.
- `triton`: a Triton Inference Server model repository, `<out>/<name>/config.pbtxt` and
  `<out>/<name>/1/model.onnx` (platform onnxruntime_onnx): inputs and outputs with their dims,
  `max_batch_size`, `dynamic_batching` from the batch curve `optimize` measured, `instance_group`.
- `kserve`: a KServe InferenceService manifest (v2 protocol) whose container runs
  `overdrive serve` on the plan, with readiness and liveness probes on `/v2/health/*` and
  Prometheus scrape annotations; the plan is copied beside it.

Steps whose effect lives in PyTorch's own execution (autocast, torch.compile, torch.ao int8,
inference_mode) cannot travel in a file: the export says which steps it carries and which not.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from overdrive.core.errors import ConfigError, PlanError, arg
from overdrive.core.workload import Workload
from overdrive.files.onnx import (
    EXPORT_ATOL,
    EXPORT_RTOL,
    PROOF_ROWS,
    ExportError,
    OnnxExport,
    axes_for,
    example_inputs,
    export_onnx,
    export_shapes,
    input_names,
    ort_session,
    output_name,
    proof_batches,
    prove_onnx,
    quiet_export,
    reason,
)
from overdrive.techniques import conflict, get_technique

FORMATS = ("onnx", "pt2", "triton", "kserve")
SERVE_PORT = 8080  # KServe's default container port


@dataclass(kw_only=True)
class Exported:
    """What `export` wrote.

    Attributes:
        format: one of FORMATS.
        path: the main file or folder written.
        files: every file written.
        carried: the plan's steps the export carries (pruning, folding, the runtime's int8).
        not_carried: the plan's steps it cannot carry, with why.
        max_abs_diff: max |exported − PyTorch| on the proof rows, where the format was proved.
        notes: what else the user should know (exporter used, the batch curve's source).
    """

    format: str
    path: Path
    files: list[Path] = field(default_factory=list)
    carried: list[str] = field(default_factory=list)
    not_carried: list[str] = field(default_factory=list)
    max_abs_diff: float | None = None
    notes: list[str] = field(default_factory=list)


def export(plan: Any, format: str, path: str | Path, *, model: Any = None, name: str | None = None,
           image: str = "overdrive:latest", overwrite: bool = False) -> Exported:
    """Write what `plan` found in `format` at `path`.

    Args:
        plan: a plan.json path, a Plan, or an OptimizeResult.
        format: "onnx", "pt2", "triton" or "kserve".
        path: the file (onnx, pt2) or folder (triton: the model repository; kserve: the manifest's folder).
        model: the model (or Workload) a plan made from a Python module was made for.
        name: the model's name in Triton's repository and KServe's manifest (default: the workload's).
        image: the container image that has overdrive installed (kserve).
        overwrite: replace what is at `path` (else an existing file or folder is refused).

    Raises:
        ConfigError: an unknown format, a Python-module plan without `model`, `path` existing (without
            `overwrite`) or not writable.
        ExportError: the model cannot be exported, or its export differs from PyTorch beyond tolerance.
        PlanError: the plan file cannot be read.
    """
    if format not in FORMATS:
        raise ConfigError(f"{arg('format', format)}: expected one of {', '.join(FORMATS)}")
    path = Path(path)
    target = path / "inferenceservice.yaml" if format == "kserve" else path
    taken = target.exists() or (format == "kserve" and path.is_dir() and any(path.iterdir()))
    if format != "triton" and taken and not overwrite:
        raise ConfigError(f"{arg('out', path)} exists{' and is not empty' if format == 'kserve' else ''}; pass "
                          f"{arg('overwrite', True)} to replace it")
    if format in ("onnx", "pt2") and path.is_dir():
        raise ConfigError(f"{arg('out', path)} is a folder; {format} writes a file (e.g. {path / ('model.' + format)})")
    try:  # fail now, not after an export of minutes
        (path if format in ("triton", "kserve") else path.parent).mkdir(parents=True, exist_ok=True)
        if format in ("onnx", "pt2"):
            existed = path.exists()
            with open(path, "ab"):
                pass
            if not existed:
                path.unlink()
    except OSError as exc:
        raise ConfigError(f"{arg('out', path)}: cannot write there ({exc.strerror or exc})") from None
    loaded, workload, plan_path = _resolve(plan, model)
    name = _model_name(name or workload.name)
    if format == "triton" and (path / name).exists() and not overwrite:  # a repository holds other models too
        raise ConfigError(f"{arg('out', path)} already holds a model {name!r}; pass {arg('overwrite', True)} to replace it, "
                          f"or {arg('name')} to add it under another name")
    try:
        if format == "kserve":
            out = _kserve(loaded, plan_path, workload, path, name, image)
        else:
            carried, not_carried, steps = _split(loaded.steps, format)
            if format == "onnx":
                out = _onnx(workload, steps, path)
            elif format == "pt2":
                out = _pt2(workload, steps, path)
            else:
                out = _triton(loaded, plan_path, workload, steps, path, name)
            out.carried, out.not_carried = carried, not_carried
    except OSError as exc:
        raise ConfigError(f"{arg('out', path)}: cannot write there ({exc.strerror or exc})") from None
    if len(workload.output_names or []) > 1:
        out.notes.append(f"the model's outputs {', '.join(workload.output_names)} are flattened per row and concatenated, in "
                         "that order, into the one output (as `serve` and `run` give them)")
    out.notes += [n for n in workload.notes if "differ from those optimize measured" in n]
    return out


# -- what the plan is, and what travels -----------------------------------------------------------


def _resolve(plan: Any, model: Any):
    """(Plan, its workload as serve and run build it, the plan file or None)."""
    from overdrive.tuning.api import PYTHON_MODEL_PREFIX, as_workload
    from overdrive.tuning.result import OptimizeResult
    from overdrive.tuning.plan import Plan, load_plan
    from overdrive.tuning.sweep import open_session

    if isinstance(plan, OptimizeResult):
        return plan.plan, plan.session.workload, None
    plan_path = None
    if not isinstance(plan, Plan):
        plan_path = Path(plan)
        plan, _, _ = load_plan(plan_path, device="cpu")
    for i, step in enumerate(plan.steps):  # a hand-edited plan that `build` would refuse is refused here too
        clash = conflict(plan.steps[:i], step)
        if clash:
            raise PlanError(f"{plan_path or 'the plan'}: {step.name}: {clash}")
    if isinstance(model, Workload):
        return plan, model, plan_path
    if model is not None:
        from overdrive.tuning.reuse import _example_from

        # the workload optimize measured, as `overdrive.load` rebuilds it: input names, judged outputs, varying dims
        workload = as_workload(model, _example_from(plan), output=plan.outputs, dynamic_dims=plan.dynamic_dims or {})
        workload.extra["rows_said"] = ("rows made to the plan's input shapes (not your data: export the OptimizeResult "
                                       "for a proof on its rows)")
        return plan, workload, plan_path
    if plan.workload.startswith(PYTHON_MODEL_PREFIX):
        raise ConfigError(f"the plan was made from a Python module ({plan.workload}), which only Python can rebuild: "
                          "overdrive.export(plan, format, out, model=<that module>), or optimize a factory "
                          "(package.module:build) for a plan the command line can export")
    workload = open_session(plan.create_workload(), device="cpu", batch_size=plan.batch_size).workload
    return plan, workload, plan_path


def _split(steps, format: str) -> tuple[list[str], list[str], list]:
    """(steps carried, steps not carried with why, the steps to build for the file)."""
    carried, not_carried, build_steps = [], [], []
    for step in steps:
        technique = get_technique(step.name)
        if technique.name in ("onnxruntime", "onnxruntime-int8") and format != "pt2":
            carried.append(step.name)
            build_steps.append(step)
        elif technique.exportable:
            carried.append(step.name)
            if technique.stage > 0:  # batching policies change how rows are grouped, not the model
                build_steps.append(step)
        else:
            why = "a runtime of its own" if technique.leaves_pytorch else "PyTorch's execution, not the graph"
            not_carried.append(f"{step.name} ({why})")
    return carried, not_carried, build_steps


def _model_for_file(workload: Workload, steps):
    """The CPU model of the carried steps, and the ONNX file of its ONNX Runtime step (or None)."""
    from overdrive.techniques.compose import build

    model, _ = build(workload, steps, torch.device("cpu"))
    return model, getattr(model, "onnx_path", None)


def _model_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in Path(name).stem).strip("-") or "model"


# -- onnx and pt2 ---------------------------------------------------------------------------------


def _onnx(workload: Workload, steps, path: Path) -> Exported:
    model, runtime_file = _model_for_file(workload, steps)
    path.parent.mkdir(parents=True, exist_ok=True)
    if runtime_file is not None:  # the file ONNX Runtime ran in the plan (int8 included): measured as written
        shutil.copyfile(runtime_file, path)
        pytorch, _ = _model_for_file(workload, [s for s in steps if not get_technique(s.name).leaves_pytorch])
        inputs = example_inputs(workload)
        copied = OnnxExport(path=path, exporter="the plan's", input_names=input_names(workload, len(inputs)),
                            output_names=[output_name(workload)], dynamic_axes=axes_for(workload, inputs))
        quantised = "int8" in model.runtime
        prove_onnx(copied, pytorch, workload, batch_size=len(inputs[0]), refuse=not quantised)
        note = "; its difference is int8 quantisation's, judged by the plan's fidelity floor" if quantised else ""
        return Exported(format="onnx", path=path, files=[path], max_abs_diff=copied.max_abs_diff,
                        notes=[f"the file the plan's ONNX Runtime step runs ({model.runtime}){note}", *copied.notes])
    exported = export_onnx(model, workload, path)
    return Exported(format="onnx", path=path, files=[path], max_abs_diff=exported.max_abs_diff,
                    notes=[f"{exported.exporter} exporter; dynamic axes {exported.dynamic_axes}; "
                           f"proved on {exported.proof_rows} {_rows_said(workload)} with ONNX Runtime", *exported.notes])


def _rows_said(workload: Workload) -> str:
    """What the rows an export is proved on are, for its notes."""
    return workload.extra.get("rows_said", "real rows")


def _pt2(workload: Workload, steps, path: Path) -> Exported:
    model, _ = _model_for_file(workload, steps)
    inputs = example_inputs(workload)
    try:
        with torch.no_grad(), quiet_export():
            program = torch.export.export(model, inputs, dynamic_shapes=export_shapes(workload, inputs, model), strict=False)
    except Exception as exc:  # noqa: BLE001 - the user's model; say why
        raise ExportError(f"{workload.name}: torch.export failed: {reason(exc)}") from None
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.export.save(program, str(path))
    loaded = torch.export.load(str(path)).module()
    worst, scale = 0.0, 0.0
    rows = min(PROOF_ROWS, len(workload.samples))
    for _, batch in proof_batches(workload, len(inputs[0])):  # the trace's batch size, 1, and above it
        with torch.no_grad():
            expected = model(*batch).float()
            try:
                got = loaded(*batch).float()
            except Exception as exc:  # noqa: BLE001 - a guard torch.export added (e.g. batch ≤ 4): the file cannot serve it
                raise ExportError(f"{workload.name}: the torch.export program refuses a batch of {len(batch[0])} rows "
                                  f"({reason(exc)}); refused") from None
        worst = max(worst, (got - expected).abs().max().item())
        scale = max(scale, expected.abs().max().item())
    if not worst <= EXPORT_ATOL + EXPORT_RTOL * scale:
        raise ExportError(f"{workload.name}: the torch.export program differs from the model by max |diff| {worst:.3g}; refused")
    axes = axes_for(workload, inputs)
    return Exported(format="pt2", path=path, files=[path], max_abs_diff=worst,
                    notes=[f"torch.export program, dynamic axes {axes}; loaded back and proved on {rows} {_rows_said(workload)}"])


# -- triton ---------------------------------------------------------------------------------------

_TRITON_TYPES = {torch.float32: "TYPE_FP32", torch.float16: "TYPE_FP16", torch.bfloat16: "TYPE_BF16",
                 torch.int64: "TYPE_INT64", torch.int32: "TYPE_INT32", torch.int8: "TYPE_INT8", torch.uint8: "TYPE_UINT8",
                 torch.bool: "TYPE_BOOL"}


def batch_curve(plan_path: Path | None, plan) -> tuple[list[tuple[int, float, float]], str]:
    """[(batch size, samples/s, p50 latency ms)] of the plan's model, from the results.json `optimize`
    wrote beside the plan (its batch-size sweep), else the plan's own figure; and where it came from."""
    if plan_path is not None and (plan_path.parent / "results.json").is_file():
        try:
            sweep = json.loads((plan_path.parent / "results.json").read_text()).get("sweep", {})
            label = next((k for k in sweep if k.startswith("plan")), None) or (list(sweep)[-1] if sweep else None)
            points = [(int(p["batch_size"]), float(p["samples_per_s"]), float(p["latency_ms"]["p50"]))
                      for p in sweep.get(label, []) if p.get("samples_per_s")]
            if points:
                return sorted(points), f"the batch-size sweep in {plan_path.parent / 'results.json'} ({label})"
        except (ValueError, KeyError, TypeError):
            pass
    m = plan.measured or {}
    if m.get("samples_per_s") and m.get("latency_ms"):
        return [(plan.batch_size, float(m["samples_per_s"]), float(m["latency_ms"]["p50"]))], "the plan's measured figure"
    return [], "nothing measured"


def dynamic_batching(curve: list[tuple[int, float, float]], max_batch_size: int) -> tuple[list[int], int]:
    """(preferred batch sizes, max queue delay in µs) from a measured batch curve.

    Preferred sizes: the measured sizes ≤ max_batch_size whose throughput is within 10% of the
    best (Triton forms those first). Queue delay: half the p50 latency of one batch at the
    smallest preferred size, so waiting for batch-mates adds at most half a batch's compute time
    to a request's latency (Triton's `max_queue_delay_microseconds`; its docs suggest starting
    small and raising it while throughput improves)."""
    usable = [(b, s, lat) for b, s, lat in curve if b <= max_batch_size]
    if not usable:
        return [max_batch_size], 1000
    best = max(s for _, s, _ in usable)
    preferred = [b for b, s, _ in usable if s >= 0.9 * best]
    latency = next(lat for b, _, lat in usable if b == preferred[0])
    return preferred, max(100, int(latency * 1000 / 2))


def _triton(plan, plan_path, workload: Workload, steps, folder: Path, name: str) -> Exported:
    model_dir = folder / name
    onnx = _onnx(workload, steps, model_dir / "1" / "model.onnx")
    inputs = example_inputs(workload)
    axes = axes_for(workload, inputs)
    names = input_names(workload, len(inputs))
    (out,) = ort_session(onnx.path).run([output_name(workload)], {n: t.numpy() for n, t in zip(names, inputs)})
    out = torch.from_numpy(out)
    max_batch = workload.fixed_batch_size or max(plan.batch_size, 1)
    curve, source = batch_curve(plan_path, plan)
    preferred, delay_us = dynamic_batching(curve, max_batch if workload.fixed_batch_size else max(max_batch, 2 * plan.batch_size))
    if not workload.fixed_batch_size:
        max_batch = max(max_batch, *preferred)
    kind = "KIND_GPU" if plan.device == "cuda" else "KIND_CPU"

    def dims(name, t):
        return [-1 if a in axes.get(name, {}) else n for a, n in enumerate(t.shape) if a > 0]

    lines = [f'name: "{name}"', 'platform: "onnxruntime_onnx"', f"max_batch_size: {max_batch}"]
    for field_name, tensors, tensor_names in (("input", inputs, names), ("output", (out,), [output_name(workload)])):
        lines.append(f"{field_name} [")
        entries = [f'  {{\n    name: "{n}"\n    data_type: {_TRITON_TYPES.get(t.dtype, "TYPE_FP32")}\n'
                   f"    dims: [ {', '.join(str(d) for d in (dims(n, t) if field_name == 'input' else list(t.shape[1:])))} ]\n  }}"
                   for n, t in zip(tensor_names, tensors)]
        lines.append(",\n".join(entries))
        lines.append("]")
    if not workload.fixed_batch_size:
        lines.append("dynamic_batching {\n"
                     f"  preferred_batch_size: [ {', '.join(str(b) for b in preferred)} ]\n"
                     f"  max_queue_delay_microseconds: {delay_us}\n}}")
    lines.append(f"instance_group [\n  {{\n    count: 1\n    kind: {kind}\n  }}\n]")
    config = model_dir / "config.pbtxt"
    config.write_text(f"# written by overdrive export from {plan_path or plan.workload}; dynamic batching from "
                      f"{source}\n" + "\n".join(lines) + "\n")
    return Exported(format="triton", path=folder, files=[config, onnx.path], max_abs_diff=onnx.max_abs_diff,
                    notes=[*onnx.notes, f"dynamic batching from {source}: preferred sizes {preferred}, "
                                        f"max queue delay {delay_us} µs"])


# -- kserve ---------------------------------------------------------------------------------------


def _kserve(plan, plan_path, workload: Workload, folder: Path, name: str, image: str) -> Exported:
    import yaml

    if plan_path is None:
        raise ConfigError("kserve needs a saved plan (plan.json) to copy beside the manifest; save the result first")
    folder.mkdir(parents=True, exist_ok=True)
    copied = folder / "plan.json"
    if copied.resolve() != plan_path.resolve():
        shutil.copyfile(plan_path, copied)
        for sibling in plan_path.parent.glob("*.pt"):  # pruning checkpoints the plan names
            shutil.copyfile(sibling, folder / sibling.name)
    mount = "/mnt/models"
    probe = {"port": SERVE_PORT, "scheme": "HTTP"}
    manifest = {
        "apiVersion": "serving.kserve.io/v1beta1",
        "kind": "InferenceService",
        "metadata": {"name": name, "annotations": {
            "serving.kserve.io/enable-prometheus-scraping": "true",
            "prometheus.io/scrape": "true", "prometheus.io/port": str(SERVE_PORT), "prometheus.io/path": "/metrics"}},
        "spec": {"predictor": {
            "minReplicas": 1,
            "containers": [{
                "name": "kserve-container",
                "image": image,
                "command": ["overdrive", "serve", f"{mount}/plan.json", "--host", "0.0.0.0", "--port", str(SERVE_PORT),
                            "--device", plan.device],
                "env": [{"name": "HF_HUB_OFFLINE", "value": "1"}, {"name": "STORAGE_URI", "value": f"pvc://{name}-plan"}],
                "ports": [{"containerPort": SERVE_PORT, "protocol": "TCP"}],
                "readinessProbe": {"httpGet": {"path": "/v2/health/ready", **probe}, "periodSeconds": 5},
                "livenessProbe": {"httpGet": {"path": "/v2/health/live", **probe}, "periodSeconds": 10,
                                  "initialDelaySeconds": 30},
                "resources": {"requests": {"cpu": "2", "memory": "4Gi"},
                              **({"limits": {"nvidia.com/gpu": "1"}} if plan.device == "cuda" else {})},
            }],
        }},
    }
    path = folder / "inferenceservice.yaml"
    path.write_text("# written by overdrive export; the container serves the KServe v2 protocol (`overdrive serve`).\n"
                    f"# KServe's storage initializer copies STORAGE_URI to {mount}: put this folder (plan.json) on the PVC "
                    f"{name}-plan, or point STORAGE_URI at s3:// or gs://; the image needs overdrive and the model installed.\n"
                    + yaml.safe_dump(manifest, sort_keys=False))
    return Exported(format="kserve", path=path, files=[path, copied], carried=[s.name for s in plan.steps],
                    notes=[f"the container runs `overdrive serve` on the plan: every step is carried; image {image}"])


def describe(result: Exported) -> list[str]:
    """The lines the command line prints for an export."""
    lines = [f"wrote {result.format}: {result.path}"]
    if result.carried or result.not_carried:
        lines.append(f"carries: {', '.join(result.carried) or 'the fp32 model'}")
    if result.not_carried:
        lines.append(f"not carried: {'; '.join(result.not_carried)}")
    if result.max_abs_diff is not None:
        lines.append(f"max |exported − PyTorch| on real rows: {result.max_abs_diff:.3g}")
    return lines + result.notes


__all__ = ["FORMATS", "Exported", "batch_curve", "describe", "dynamic_batching", "export"]
