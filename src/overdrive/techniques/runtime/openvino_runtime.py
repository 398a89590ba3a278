"""OpenVINO as a technique (CPU: Intel and AMD x86): the plan's model converted from the PyTorch
module with `openvino.convert_model` (its TorchScript/FX frontend, dynamic shapes), compiled for
the CPU plugin with the latency hint and the instance's thread count.

`openvino` takes the CPU plugin's inference precision: its default (bf16 on a CPU with
AVX512-BF16 or AMX, f32 elsewhere; the plan records which), or f32, or bf16. `openvino-int8`
quantises weights and activations to int8 with NNCF post-training quantisation
(`nncf.quantize`, the transformer model type for text), calibrated on the workload's training
rows, never its evaluation rows.
"""

from __future__ import annotations

import contextlib
import enum
import io
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

from overdrive.core.devices import cpu_has_native_bf16
from overdrive.core.workload import Workload
from overdrive.techniques.registry import TechniqueConfig, register
from overdrive.techniques.runtime.exported import ExportedRuntime, RuntimeModule, cpu_model, input_signature

CALIBRATION_ROWS = 128


def openvino():
    """The `openvino` module, imported with OpenVINO's and NNCF's usage telemetry declined in this
    process. Both send it unless the user opted out (`openvino_telemetry`: an event at import and at
    every `convert_model`, each from a process forked off a worker thread to time the request out).
    A fork of a process running torch's, OpenMP's or gRPC's threads can crash (seen here: SIGSEGV in
    the child's `getaddrinfo`, taking a pytest worker with it), and overdrive sends nothing anywhere.
    The user's consent file is neither read nor written."""
    try:
        from openvino_telemetry.utils.opt_in_checker import ConsentCheckResult, OptInChecker
        from openvino_telemetry.utils.sender import TelemetrySender
    except ImportError:
        pass
    else:
        OptInChecker.check = lambda self, *args, **kwargs: ConsentCheckResult.DECLINED
        TelemetrySender.send = lambda self, *args, **kwargs: None  # an instance made before this call
    import openvino as ov

    return ov


_core = None
_core_lock = threading.Lock()


def core():
    """The process's one `openvino.Core`, made on first use and kept until the process ends.

    One, not one per model: OpenVINO's CPU plugin (2026.4 here) gives each Core's plugin an alternate signal stack
    (sigaltstack(2)) on the thread that first compiles on it, and when that Core goes it unmaps the stack, putting
    the previous one back only if its own is still the thread's current one. Two Cores that go in another order
    than they came, or one freed on another thread, leave the thread's signal stack at unmapped memory, and the
    next signal that has a handler (SIGINT, SIGTERM, SIGCHLD) kills the process with SIGSEGV (seen: a test worker
    that had built several OpenVINO modules died while it waited for a child process)."""
    global _core
    with _core_lock:
        if _core is None:
            _core = openvino().Core()
        return _core


class Precision(str, enum.Enum):
    DEFAULT = "default"  # the CPU plugin's own choice for this CPU
    F32 = "f32"
    BF16 = "bf16"


@dataclass(frozen=True, kw_only=True)
class OpenVinoConfig(TechniqueConfig):
    """Attributes:
    precision: the CPU plugin's INFERENCE_PRECISION_HINT (default: the plugin's choice for this CPU).
    """
    name: ClassVar[str] = "openvino"

    precision: Precision = Precision.DEFAULT

    def __post_init__(self):
        object.__setattr__(self, "precision", Precision(self.precision))


@dataclass(frozen=True, kw_only=True)
class OpenVinoInt8Config(TechniqueConfig):
    """Attributes:
    calibration_rows: training rows NNCF calibrates the activation ranges on.
    """
    name: ClassVar[str] = "openvino-int8"

    calibration_rows: int = CALIBRATION_ROWS

    def __post_init__(self):
        if not isinstance(self.calibration_rows, int) or self.calibration_rows < 1:
            raise ValueError(f"calibration_rows must be a positive integer, not {self.calibration_rows!r}")


def convert(model: torch.nn.Module, workload: Workload):
    """The openvino.Model of `model` (fp32, CPU): from its torch.export program (dynamic batch and
    sequence axes), else OpenVINO's TorchScript frontend on a small real batch, which is refused when
    the trace fixed a data-dependent value (`files.onnx.traced`).

    Raises:
        RuntimeError: both conversions failed (both reasons given).
    """
    ov = openvino()

    from overdrive.files.onnx import example_inputs, export_shapes, quiet_export, reason, traced

    model = cpu_model(model)
    example = example_inputs(workload)
    with torch.no_grad(), quiet_export():
        try:
            program = torch.export.export(model, example, dynamic_shapes=export_shapes(workload, example, model), strict=False)
            return ov.convert_model(program)
        except Exception as exc:  # noqa: BLE001 - try the TorchScript frontend, then report both
            first = reason(exc)
        try:
            return traced(lambda: ov.convert_model(model, example_input=example))
        except Exception as exc:  # noqa: BLE001
            raise RuntimeError(f"OpenVINO conversion failed: from torch.export: {first} | from a TorchScript trace: "
                               f"{reason(exc)}") from None


def cached_convert(model: torch.nn.Module, workload: Workload, quantize=None, quantize_key=None):
    """`convert` (then `quantize(ov_model)`, when given) through the cache (`overdrive.files.cache`):
    the IR saved at full precision (`compress_to_fp16=False`) and read back on a later call with the
    same weights, code, example and versions.

    Args:
        quantize: ov.Model -> ov.Model applied after conversion (NNCF), cached with it.
        quantize_key: what `quantize`'s result depends on besides the model (settings, calibration rows).

    Raises:
        RuntimeError: as `convert`.
    """
    ov = openvino()

    from overdrive.files.cache import cached, model_key, outputs_key, tensors_key, versions
    from overdrive.files.onnx import example_inputs

    model = cpu_model(model)
    example = example_inputs(workload)
    parts = {"model": model_key(model), "answers": outputs_key(model, example), "example": tensors_key(example),
             "dynamic": {str(k): list(v) for k, v in (workload.dynamic_dims or {}).items()},
             "quantize": quantize_key, "versions": versions("openvino", "nncf")}

    def make(folder: Path) -> dict:
        ov_model = convert(model, workload)
        if quantize is not None:
            ov_model = quantize(ov_model)
        ov.save_model(ov_model, str(folder / "model.xml"), compress_to_fp16=False)
        return {}

    entry = cached("openvino-int8" if quantize else "openvino", parts, make)
    return core().read_model(str(entry.folder / "model.xml")), entry


def ov_module(ov_model, *, config: dict, runtime: str, technique: str) -> RuntimeModule:
    """A RuntimeModule running `ov_model` on the CPU plugin; one compiled model and infer request
    per thread count, the output copied out of the request's buffer before the next call."""
    seen = {}

    def make(threads: int):
        compiled = core().compile_model(ov_model, "CPU", {**config, "INFERENCE_NUM_THREADS": threads,
                                                       "PERFORMANCE_HINT": "LATENCY"})
        precision = compiled.get_property("INFERENCE_PRECISION_HINT")
        seen["precision"] = precision.to_string() if hasattr(precision, "to_string") else str(precision)
        return compiled.create_infer_request()

    def run(request, inputs):
        request.infer([np.ascontiguousarray(t.detach().cpu().numpy()) for t in inputs])
        return torch.from_numpy(np.array(request.get_output_tensor(0).data, dtype=np.float32, copy=True))

    module = RuntimeModule(make, run, runtime=runtime)
    module.runtime = f"{runtime}, inference precision {seen.get('precision', '?')}"
    module.overdrive_report = {"technique": technique, "runtime": module.runtime}
    return module


@register
class OpenVino(ExportedRuntime):
    config_cls = OpenVinoConfig
    lossless = False  # bf16 by default on CPUs that have it; fusions reorder float math
    devices = ("cpu",)
    package = "openvino"
    install_hint = "pip install openvino"
    description = "OpenVINO on CPU (converted from PyTorch; the CPU plugin's precision: bf16 where the CPU has it)"

    def dtype_of(self, config):
        """The CPU plugin's default is bf16 where the CPU has AVX512-BF16 or AMX (what `apply` reports)."""
        if config.precision == Precision.DEFAULT:
            return "bfloat16" if cpu_has_native_bf16() else "float32"
        return {Precision.F32: "float32", Precision.BF16: "bfloat16"}[config.precision]

    def apply(self, model, config, *, workload, device):
        ov_model, entry = cached_convert(model, workload)
        hint = {} if config.precision == Precision.DEFAULT else {"INFERENCE_PRECISION_HINT": config.precision.value}
        module = ov_module(ov_model, config=hint, runtime="openvino", technique=self.name)
        module._keep, module.signature = entry, input_signature(workload)
        return module


@register
class OpenVinoInt8(ExportedRuntime):
    fidelity_risk = 0.5  # one activation scale per tensor: the time budget's prediction weighs it (tuning.budget)
    config_cls = OpenVinoInt8Config
    lossless = False
    devices = ("cpu",)
    package = "nncf"
    install_hint = "pip install nncf openvino"
    description = "OpenVINO int8 (NNCF post-training quantisation calibrated on training rows)"
    compute_dtype = "int8"

    def applicability(self, workload: Workload, device: torch.device) -> str | None:
        if not workload.train_samples:
            return "not applicable: int8 calibrates on the workload's training rows, and it has none (pass --data with 100+ rows)"
        return super().applicability(workload, device)

    def apply(self, model, config, *, workload, device):
        openvino()  # before nncf, which imports it
        import nncf

        from overdrive.files.cache import tensors_key

        nncf.set_log_level(logging.ERROR)
        rows = list(workload.train_samples)[:config.calibration_rows]
        batches = [workload.collate(rows[i:i + 8]) for i in range(0, len(rows), 8)]
        model_type = nncf.ModelType.TRANSFORMER if workload.is_text else None

        def quantize(ov_model):
            with contextlib.redirect_stdout(io.StringIO()):  # NNCF draws progress bars on stdout
                return nncf.quantize(ov_model, nncf.Dataset([[t.numpy() for t in b] for b in batches]),
                                     model_type=model_type, subset_size=len(batches))

        key = {"config": config.to_dict(), "rows": tensors_key(t for b in batches for t in b),
               "model_type": str(model_type)}
        quantized, entry = cached_convert(model, workload, quantize=quantize, quantize_key=key)
        module = ov_module(quantized, config={}, runtime=f"openvino int8 (NNCF, {len(rows)} training rows)",
                           technique=self.name)
        module._keep, module.signature = entry, input_signature(workload)
        return module
