"""ONNX export with proof: the model is exported, run by ONNX Runtime on real rows, and refused
when its answers differ from PyTorch's beyond float tolerance.

The exporter is torch.onnx's dynamo exporter (`torch.onnx.export(..., dynamo=True)`, built on
torch.export), falling back to the TorchScript exporter (`dynamo=False`) when the dynamo one
fails. The batch axis is dynamic (unless the model takes one batch size), and so is every
dimension whose size varies from row to row: a text workload's sequence axis, or the workload's
`dynamic_dims`. Inputs are named as `serve` and `run` name them (`input_ids`, `attention_mask`;
`input`, `input__0`, ...).
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from overdrive.core.errors import WorkloadError
from overdrive.core.workload import Workload

# The export is refused when max |ONNX Runtime − PyTorch| > EXPORT_ATOL + EXPORT_RTOL × max |PyTorch|
# on the proof rows (fp32 both sides; ORT's fusions reorder float sums, which stays far below this).
EXPORT_ATOL = 1e-4
EXPORT_RTOL = 1e-4
PROOF_ROWS = 64


class ExportError(WorkloadError, RuntimeError):
    """The model could not be exported, or its export gives other answers than PyTorch."""


@dataclass(kw_only=True)
class OnnxExport:
    """An exported ONNX file and how it was made.

    Attributes:
        path: the .onnx file (weights inside; models over 2 GB keep an external-data file beside it).
        exporter: "dynamo" or "torchscript".
        input_names, output_names: the graph's input and output names, in the model's order.
        dynamic_axes: input name -> {axis: axis name} of the axes whose size may vary.
        max_abs_diff: max |ONNX Runtime − PyTorch| over the proof rows (fp32), or None when unproven.
        proof_rows: how many real rows the proof ran.
        notes: what happened on the way (the dynamo exporter's failure before the fallback).
        cache: the `files.cache.Entry` the file lives in (`cached_onnx`), or None.
    """

    path: Path
    exporter: str
    input_names: list[str]
    output_names: list[str]
    dynamic_axes: dict[str, dict[int, str]]
    max_abs_diff: float | None = None
    proof_rows: int = 0
    notes: list[str] = field(default_factory=list)
    cache: object = field(default=None, repr=False)


def varying_dims(workload: Workload, num_inputs: int) -> dict[int, tuple[int, ...]]:
    """Input index -> the dimensions (of the batched tensor, ≥ 1) whose size varies between batches:
    the workload's `dynamic_dims`, or the sequence axis of every input of a text workload."""
    if workload.dynamic_dims:
        return dict(workload.dynamic_dims)
    if workload.is_text:
        return {i: (1,) for i in range(num_inputs)}
    return {}


def input_names(workload: Workload, num_inputs: int) -> list[str]:
    """The names of the model's positional inputs, as `serve` and `run` spell them: the workload's
    `input_names` (a Hugging Face model's keywords); for a tensor model without them `input`, or
    `input__0`, `input__1`, ... (`files.tensor_sources.input_names`); for text, its forward's
    parameter names (`input_ids`, `attention_mask`), else input_0, input_1, ..."""
    import inspect

    from overdrive.files.tensor_sources import input_names as served_names

    names = list(workload.input_names or []) if workload.is_text else served_names(workload)
    if len(names) != num_inputs:
        try:
            params = inspect.signature(workload.model.forward).parameters.values()
            names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][:num_inputs]
        except (TypeError, ValueError):
            names = []
    return names if len(names) == num_inputs and len(set(names)) == num_inputs else [f"input_{i}" for i in range(num_inputs)]


def output_name(workload: Workload) -> str:
    """The name of the model's one output tensor: its path in the model's output, or "output" (for a bare tensor,
    whose path is "": ONNX Runtime refuses a graph output without a name)."""
    names = workload.output_names or []
    return names[0] if len(names) == 1 and names[0] else "output"


def example_inputs(workload: Workload, rows: int = 4) -> tuple[torch.Tensor, ...]:
    """A small real batch to trace with: at least 2 rows (a batch of 1 is specialised as a constant),
    of different lengths for a text workload (training rows when there are some)."""
    pool = list(workload.train_samples or workload.samples)
    n = workload.fixed_batch_size or max(2, min(rows, len(pool)))
    if workload.bucket_length is not None:
        pool = sorted(pool[:256], key=workload.bucket_length)[-n:]  # the longest: a sequence axis of size 1 would specialise
    chosen = [pool[i % len(pool)] for i in range(n)]
    return tuple(workload.collate(chosen))


def axes_for(workload: Workload, inputs: tuple[torch.Tensor, ...]) -> dict[str, dict[int, str]]:
    """Input name -> {axis: name} of the dynamic axes: the batch (unless the model takes one batch
    size) and the varying dimensions; inputs that vary together share an axis name."""
    names = input_names(workload, len(inputs))
    dims = varying_dims(workload, len(inputs))
    axes = {}
    for i, (name, tensor) in enumerate(zip(names, inputs)):
        a = {} if workload.fixed_batch_size else {0: "batch"}
        for d in dims.get(i, ()):
            if d < tensor.dim():
                a[d] = "sequence" if workload.is_text and d == 1 else f"dim{d}"
        axes[name] = a
    return axes


def export_onnx(model: nn.Module, workload: Workload, path: str | Path, *, inputs: tuple[torch.Tensor, ...] | None = None,
                prove: bool = True, opset: int | None = None) -> OnnxExport:
    """Export `model` (fp32, CPU, `model(*inputs) -> tensor [B, ...]`) to `path` and prove it.

    Args:
        model: the module to export (a plan's model before any runtime step: pruning and folding
            are exported, autocast and torch.compile are not).
        workload: gives the input names, the dynamic axes, a traced example and the proof rows.
        inputs: the example to trace with (default: `example_inputs(workload)`).
        prove: run the file with ONNX Runtime on up to PROOF_ROWS of the workload's rows (in
            batches of the example's size) and compare with `model`.
        opset: the ONNX opset (default: the exporter's).

    Returns:
        the OnnxExport (path, exporter used, names, dynamic axes, proof figures).

    Raises:
        ExportError: both exporters failed (both reasons given), or the proof found
            max |ONNX Runtime − PyTorch| beyond EXPORT_ATOL + EXPORT_RTOL × max |PyTorch|.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    model = model.eval().cpu()
    inputs = tuple(t.cpu() for t in (inputs if inputs is not None else example_inputs(workload)))
    names = input_names(workload, len(inputs))
    outputs = [output_name(workload)]
    axes = axes_for(workload, inputs)
    notes: list[str] = []
    exporter = None
    errors = []
    for kind in ("dynamo", "torchscript"):
        try:
            _export(kind, model, inputs, path, names, outputs, axes, opset)
            exporter = kind
            break
        except Exception as exc:  # noqa: BLE001 - try the other exporter, then report both
            errors.append(f"{kind} exporter: {reason(exc)}")
            path.unlink(missing_ok=True)
    if exporter is None:
        raise ExportError(f"{workload.name}: ONNX export failed. " + " | ".join(errors))
    notes += [f"{e}; the TorchScript exporter was used" for e in errors]
    result = OnnxExport(path=path, exporter=exporter, input_names=names, output_names=outputs, dynamic_axes=axes, notes=notes)
    if prove:
        try:
            prove_onnx(result, model, workload, batch_size=len(inputs[0]))
        except BaseException:
            path.unlink(missing_ok=True)  # no file that failed its proof is left for a runtime to load
            raise
    return result


def cached_onnx(model: nn.Module, workload: Workload, *, opset: int | None = None) -> OnnxExport:
    """`export_onnx` through the cache (`overdrive.files.cache`): a model exported before with the
    same weights, code, example and versions is read back instead of exported again, then proved
    on the workload's real rows all the same (the proof, not the key, is what vouches for it).

    Returns:
        the OnnxExport, its `path` inside the cache entry; `notes` says "from the cache" on a hit.

    Raises:
        ExportError: as `export_onnx` (a cached file that fails the proof is removed first).
    """
    from overdrive.files.cache import cached, model_key, outputs_key, tensors_key, versions

    model = model.eval().cpu()
    inputs = tuple(t.cpu() for t in example_inputs(workload))
    names = input_names(workload, len(inputs))
    parts = {"model": model_key(model), "answers": outputs_key(model, inputs), "example": tensors_key(inputs),
             "names": names, "output": output_name(workload), "axes": axes_for(workload, inputs), "opset": opset,
             "versions": versions("onnx", "onnxscript")}

    def make(folder: Path) -> dict:
        made = export_onnx(model, workload, folder / "model.onnx", inputs=inputs, prove=False, opset=opset)
        return {"exporter": made.exporter, "input_names": made.input_names, "output_names": made.output_names,
                "dynamic_axes": {k: {str(a): n for a, n in v.items()} for k, v in made.dynamic_axes.items()},
                "notes": made.notes}

    entry = cached("onnx", parts, make)
    meta = entry.meta
    result = OnnxExport(path=entry.folder / "model.onnx", exporter=meta["exporter"], input_names=meta["input_names"],
                        output_names=meta["output_names"],
                        dynamic_axes={k: {int(a): n for a, n in v.items()} for k, v in meta["dynamic_axes"].items()},
                        notes=list(meta["notes"]) + (["from the cache"] if entry.hit else []))
    result.cache = entry  # also keeps a temporary folder alive when caching is off
    try:
        prove_onnx(result, model, workload, batch_size=len(inputs[0]))
    except ExportError:
        if entry.hit:
            import shutil

            shutil.rmtree(entry.folder, ignore_errors=True)
        raise
    return result


def _export(kind: str, model: nn.Module, inputs, path: Path, names, outputs, axes, opset) -> None:
    with quiet_export(), torch.no_grad():
        if kind == "dynamo":
            dims: dict[str, torch.export.Dim] = {}  # one per axis name: inputs that vary together share it
            specs = [{a: dims.setdefault(n, torch.export.Dim(n)) for a, n in axes[name].items()} or None for name in names]
            program = torch.onnx.export(model, inputs, input_names=names, output_names=outputs,
                                        dynamic_shapes=bind_shapes(model, specs), dynamo=True, opset_version=opset,
                                        verbose=False)
            program.save(str(path), external_data=_too_large(model))
        else:
            traced(lambda: torch.onnx.export(model, inputs, str(path), input_names=names, output_names=outputs,
                                             dynamic_axes=axes, dynamo=False, opset_version=opset or 17))


def bind_shapes(model: nn.Module, specs: list) -> tuple | dict:
    """torch.export `dynamic_shapes` for `model(*inputs)`: one spec per input, laid out as the model's
    forward binds its positional arguments (a `forward(*inputs)` takes them as one argument, whose
    spec is then the tuple of specs); the specs as they are when the signature cannot be read."""
    import inspect

    try:
        return dict(inspect.signature(model.forward).bind(*specs).arguments)
    except (TypeError, ValueError):
        return tuple(specs)


def traced(fn):
    """`fn()` (a TorchScript trace: torch.onnx's TorchScript exporter, OpenVINO's PyTorch frontend),
    refused when the tracer warned that it turned a value computed from a tensor into a constant
    (a data-dependent `if`, `.item()`, a shape read as a Python number): the graph then follows the
    traced rows' branch for every row, and may answer other rows differently without a sign.

    Raises:
        RuntimeError: the tracer's first such warning, quoted.
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn()
    fixed = [w for w in caught if issubclass(w.category, torch.jit.TracerWarning)]
    if fixed:
        first = str(fixed[0].message).split(". ")[0]
        raise RuntimeError(f"the TorchScript trace fixed a value computed from a tensor into the graph ({first}), so the "
                           "file could answer rows unlike the traced ones differently; refused")
    return result


@contextlib.contextmanager
def quiet_export():
    """Exporters print graphs, pass logs and symbolic-shape notes on stdout/stderr and at INFO level;
    overdrive reports what matters (the exporter used, why one failed, the proof) itself."""
    loggers = [logging.getLogger(n) for n in ("torch.onnx", "torch.export", "torch.fx.experimental.symbolic_shapes",
                                               "torch._dynamo", "onnxscript", "onnx_ir", "openvino", "nncf")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


# Lines exporters add that point elsewhere (a stack trace overdrive does not print, a log setting, a web page).
_POINTERS = ("the error above occurred", "refer to the full stack trace", "for more information", "if you would like to view",
             "set torch_logs", "you can replace your", "see https://", "exportdb")


def _before_pointer(line: str) -> str:
    """`line` up to the first phrase that points elsewhere."""
    lower = line.lower()
    cut = min([lower.index(p) for p in _POINTERS if p in lower], default=len(line))
    return line[:cut].strip()


def reason(exc: BaseException, *, max_chars: int = 400) -> str:
    """One line saying why an exporter failed. torch.onnx wraps the cause in a message that points at
    a stack trace overdrive does not print ("Refer to the full stack trace above"): the cause it was
    raised from is quoted instead; and torch.export's own lines that point elsewhere ("The error above
    occurred when calling torch.export.export", a web page, a log setting) are dropped, the rest joined."""
    while "stack trace" in str(exc) and exc.__cause__ is not None:
        exc = exc.__cause__
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))  # terminal colours
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    kept = [cut for cut in (_before_pointer(line) for line in lines) if cut] or lines[-1:]
    said = f"{type(exc).__name__}: {' '.join(kept)}".rstrip(": ")
    return said if len(said) <= max_chars else said[:max_chars].rsplit(" ", 1)[0] + " …"


def export_shapes(workload: Workload, inputs: tuple[torch.Tensor, ...], model: nn.Module | None = None) -> tuple | dict:
    """torch.export `dynamic_shapes` for `inputs`: Dim.AUTO on each dynamic axis (torch.export finds
    each axis's range, e.g. a sequence up to max_position_embeddings), None for static inputs; laid
    out as `model`'s forward binds them (`bind_shapes`) when it is given."""
    axes = axes_for(workload, inputs)
    specs = [{a: torch.export.Dim.AUTO for a in axes[name]} or None for name in input_names(workload, len(inputs))]
    return bind_shapes(model, specs) if model is not None else tuple(specs)


def _too_large(model: nn.Module) -> bool:
    """True when the weights exceed protobuf's 2 GB limit (they go to an external-data file)."""
    return sum(p.numel() * p.element_size() for p in model.parameters()) > 1_800_000_000


def ort_session(path: str | Path, *, threads: int | None = None, providers: list | None = None,
                optimization: str = "all"):
    """An onnxruntime.InferenceSession for `path`: graph optimisation `optimization` ("all",
    "extended", "basic", "none"), `threads` intra-op threads (default torch's), CPU provider by default."""
    import onnxruntime as ort

    levels = {"all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL, "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
              "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC, "none": ort.GraphOptimizationLevel.ORT_DISABLE_ALL}
    options = ort.SessionOptions()
    options.graph_optimization_level = levels[optimization]
    options.intra_op_num_threads = threads or torch.get_num_threads()
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=providers or ["CPUExecutionProvider"])


def prove_onnx(export: OnnxExport, model: nn.Module, workload: Workload, *, batch_size: int = 8,
               rows: int = PROOF_ROWS, refuse: bool = True) -> float:
    """Run the exported file with ONNX Runtime (CPU, basic graph optimisation) on up to `rows` of the
    workload's real rows and compare with `model`; sets and returns `export.max_abs_diff`.

    Args:
        refuse: raise when the difference is beyond tolerance; False only measures it (a quantised
            file, whose difference is the quantisation's, judged by the plan's fidelity floor).

    Raises:
        ExportError: ONNX Runtime cannot load the file, the difference is beyond EXPORT_ATOL + EXPORT_RTOL ×
            max |PyTorch| (the figure is given), or the file's output shape differs from the model's.
    """
    try:
        session = ort_session(export.path, optimization="basic")
    except Exception as exc:  # noqa: BLE001 - ONNX Runtime's own error types: the exporter wrote a graph it refuses
        raise ExportError(f"{workload.name}: ONNX Runtime could not load the exported file: {reason(exc)}") from exc
    worst, scale = 0.0, 0.0
    sizes = set()
    for chunk, inputs in proof_batches(workload, batch_size, rows):
        sizes.add(len(chunk))
        with torch.no_grad():
            expected = model(*inputs).float().numpy()
        (got,) = session.run(export.output_names, {n: t.numpy() for n, t in zip(export.input_names, inputs)})
        if got.shape != expected.shape:
            raise ExportError(f"{workload.name}: the ONNX model gives shape {list(got.shape)} where PyTorch gives "
                              f"{list(expected.shape)} (batch of {len(chunk)})")
        worst = max(worst, float(np.max(np.abs(got.astype(np.float32) - expected))) if got.size else 0.0)
        scale = max(scale, float(np.max(np.abs(expected))) if expected.size else 0.0)
    export.max_abs_diff, export.proof_rows = worst, min(rows, len(workload.samples))
    export.notes.append("proved at batch sizes " + ", ".join(str(b) for b in sorted(sizes)))
    bound = EXPORT_ATOL + EXPORT_RTOL * scale
    if refuse and (not worst <= bound or math.isnan(worst)):
        raise ExportError(f"{workload.name}: the ONNX export differs from PyTorch by max |diff| {worst:.3g} on "
                          f"{export.proof_rows} real rows (allowed {bound:.3g}); refused")
    return worst


def proof_batches(workload: Workload, batch_size: int, rows: int = PROOF_ROWS):
    """(rows, collated inputs) over up to `rows` of the workload's real rows (cycled when it has fewer,
    so that every size below is reached), in batches of `batch_size`, 1 and 2·batch_size + 1 in turn:
    a graph that fixed a branch on the batch size it was traced at answers wrongly on one side of it.
    A static-batch model gets its one batch size (a short last batch filled with copies of its first row)."""
    samples = list(workload.samples)
    if workload.fixed_batch_size:
        sizes = [workload.fixed_batch_size]
    else:
        sizes = [batch_size, 1, 2 * batch_size + 1]
    total = max(min(rows, len(samples)), sum(sizes))
    position, turn = 0, 0
    while position < total:
        size = sizes[turn % len(sizes)]
        chunk = [samples[(position + k) % len(samples)] for k in range(size)]
        position, turn = position + size, turn + 1
        yield chunk, workload.collate(chunk)
