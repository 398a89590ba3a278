"""ONNX Runtime as a technique: the plan's model exported to ONNX (proved against PyTorch on real
rows, `overdrive.files.onnx`), run by an InferenceSession at graph optimisation level ALL.

Providers by device: CPU → CPUExecutionProvider; CUDA → TensorrtExecutionProvider (when the
build has it), CUDAExecutionProvider, then CPU for the ops they lack. On CUDA the inputs and the
output stay on the device (IOBinding on the torch tensors' memory: no host round trip).
`onnxruntime-int8` quantises the exported graph with onnxruntime.quantization: dynamic (int8
weights per channel, activations scaled per tensor at run time) or static (QDQ, activations
calibrated on the workload's training rows, never its evaluation rows).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

from overdrive.core.workload import Workload
from overdrive.techniques.registry import TechniqueConfig, register
from overdrive.techniques.runtime.exported import ExportedRuntime, RuntimeModule, cpu_model, input_signature

CALIBRATION_ROWS = 128


class Optimization(str, enum.Enum):
    """ONNX Runtime graph optimisation levels (onnxruntime.GraphOptimizationLevel)."""

    ALL = "all"
    EXTENDED = "extended"
    BASIC = "basic"


@dataclass(frozen=True, kw_only=True)
class OnnxRuntimeConfig(TechniqueConfig):
    """Attributes:
    optimization: the session's graph optimisation level.
    tensorrt: on CUDA, put the TensorRT execution provider first when the build has it.
    """
    name: ClassVar[str] = "onnxruntime"

    optimization: Optimization = Optimization.ALL
    tensorrt: bool = True

    def __post_init__(self):
        object.__setattr__(self, "optimization", Optimization(self.optimization))


class Calibration(str, enum.Enum):
    DYNAMIC = "dynamic"  # activation scales computed per call (per tensor, over the whole batch)
    STATIC = "static"  # activation scales calibrated once on training rows (QDQ)


@dataclass(frozen=True, kw_only=True)
class OnnxRuntimeInt8Config(TechniqueConfig):
    """Attributes:
    calibration: dynamic (scales per call) or static (calibrated on up to CALIBRATION_ROWS training rows).
    per_channel: int8 weight scales per output channel (else per tensor).
    """
    name: ClassVar[str] = "onnxruntime-int8"

    calibration: Calibration = Calibration.DYNAMIC
    per_channel: bool = True

    def __post_init__(self):
        object.__setattr__(self, "calibration", Calibration(self.calibration))


def providers_for(device: torch.device, tensorrt: bool) -> list:
    """The execution providers for `device`, best first, among those this onnxruntime build has."""
    import onnxruntime as ort

    if device.type != "cuda":
        return ["CPUExecutionProvider"]
    available = ort.get_available_providers()
    if "CUDAExecutionProvider" not in available:
        raise RuntimeError(f"this onnxruntime build has no CUDA provider (it has {', '.join(available)}); "
                           "install onnxruntime-gpu")
    index = device.index or 0
    chosen: list = []
    if tensorrt and "TensorrtExecutionProvider" in available:
        chosen.append(("TensorrtExecutionProvider", {"device_id": index, "trt_fp16_enable": False}))
    return chosen + [("CUDAExecutionProvider", {"device_id": index}), "CPUExecutionProvider"]


def ort_module(path: Path, *, device: torch.device, optimization: str, providers: list, names: list[str], output: str,
               runtime: str, keep=None) -> RuntimeModule:
    """A RuntimeModule running `path` with ONNX Runtime on `device`."""
    from overdrive.files.onnx import ort_session

    def make(threads: int):
        return ort_session(path, threads=threads, providers=providers, optimization=optimization)

    if device.type == "cuda":
        shapes: dict[tuple, tuple] = {}

        def run(session, inputs):
            binding = session.io_binding()
            inputs = [t.contiguous() for t in inputs]
            for name, t in zip(names, inputs):
                binding.bind_input(name, "cuda", device.index or 0, _numpy_dtype(t.dtype), list(t.shape), t.data_ptr())
            key = tuple(tuple(t.shape) for t in inputs)
            torch.cuda.current_stream(device).synchronize()  # ORT reads on its own stream: torch's writes must be done
            if key in shapes:  # the output's shape for these input shapes is known: ORT writes into torch's memory
                out = torch.empty(shapes[key], dtype=torch.float32, device=device)
                binding.bind_output(output, "cuda", device.index or 0, np.float32, list(out.shape), out.data_ptr())
                session.run_with_iobinding(binding)
                binding.synchronize_outputs()
                return out
            binding.bind_output(output, "cuda", device.index or 0)
            session.run_with_iobinding(binding)
            result = torch.from_numpy(binding.copy_outputs_to_cpu()[0]).to(device)  # first call at this shape only
            shapes[key] = tuple(result.shape)
            return result.float()
    else:
        def run(session, inputs):
            (out,) = session.run([output], {n: t.detach().cpu().numpy() for n, t in zip(names, inputs)})
            return torch.from_numpy(np.ascontiguousarray(out)).float()

    return RuntimeModule(make, run, runtime=runtime, keep=keep)


def _numpy_dtype(dtype: torch.dtype):
    return {torch.float32: np.float32, torch.float16: np.float16, torch.int64: np.int64, torch.int32: np.int32,
            torch.bool: np.bool_, torch.uint8: np.uint8}[dtype]


@register
class OnnxRuntime(ExportedRuntime):
    config_cls = OnnxRuntimeConfig
    lossless = False  # its fusions reorder float math; judged by the fidelity floor
    package = "onnxruntime"
    install_hint = "pip install onnxruntime, or onnxruntime-gpu for CUDA"
    description = "ONNX Runtime (exported, proved on real rows; CPU / CUDA / TensorRT providers)"

    def apply(self, model, config, *, workload, device):
        from overdrive.files.onnx import cached_onnx

        exported = cached_onnx(cpu_model(model), workload)
        module = ort_module(exported.path, device=device, optimization=config.optimization.value,
                            providers=providers_for(device, config.tensorrt), names=exported.input_names,
                            output=exported.output_names[0], runtime=f"onnxruntime ({exported.exporter} export)",
                            keep=exported.cache)
        return _reported(module, self.name, exported, workload=workload)


@register
class OnnxRuntimeInt8(ExportedRuntime):
    fidelity_risk = 0.5  # one activation scale per tensor: the time budget's prediction weighs it (tuning.budget)
    config_cls = OnnxRuntimeInt8Config
    lossless = False
    devices = ("cpu",)  # onnxruntime's int8 kernels (MatMulInteger, QLinear*) are CPU kernels
    opt_in = True  # dynamic: one activation scale per batch, so rows depend on their batch-mates
    package = "onnxruntime"
    install_hint = "pip install onnxruntime"
    description = "ONNX Runtime int8 (dynamic, or static calibrated on training rows)"
    compute_dtype = "int8"
    batch_dependence = "ONNX Runtime's dynamic int8 scales each activation with one scale for the whole batch"

    def apply(self, model, config, *, workload, device):
        from onnxruntime.quantization import QuantFormat, QuantType, quantize_dynamic, quantize_static

        from overdrive.files.cache import cached, versions
        from overdrive.files.onnx import cached_onnx

        if config.calibration == Calibration.STATIC and not workload.train_samples:
            raise RuntimeError("static int8 calibrates on the workload's training rows, and it has none (pass --data "
                               "with 100+ rows, or use calibration dynamic)")
        exported = cached_onnx(cpu_model(model), workload)
        reader = _CalibrationReader(workload, exported.input_names) if config.calibration == Calibration.STATIC else None
        parts = {"fp32": exported.cache.folder.name, "config": config.to_dict(), "versions": versions("onnxruntime"),
                 "calibration": reader.key() if reader else None}

        def make(folder: Path) -> dict:
            fp32 = _preprocessed(exported.path, folder)
            if reader is None:
                quantize_dynamic(str(fp32), str(folder / "model.int8.onnx"), weight_type=QuantType.QInt8,
                                 per_channel=config.per_channel)
            else:
                quantize_static(str(fp32), str(folder / "model.int8.onnx"), reader, quant_format=QuantFormat.QDQ,
                                per_channel=config.per_channel, activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
            if fp32 != exported.path:
                fp32.unlink(missing_ok=True)
            return {}

        entry = cached("onnxruntime-int8", parts, make)
        int8 = entry.folder / "model.int8.onnx"
        module = ort_module(int8, device=device, optimization="all", providers=["CPUExecutionProvider"],
                            names=exported.input_names, output=exported.output_names[0],
                            runtime=f"onnxruntime int8 {config.calibration.value}", keep=(exported.cache, entry))
        return _reported(module, self.name, exported, int8, workload=workload)


def _reported(module: RuntimeModule, technique: str, exported, path: Path | None = None,
              workload: Workload | None = None) -> RuntimeModule:
    """The module with its report (the runtime, the exporter and the export's proof figure), the
    ONNX file it runs (`onnx_path`, which `overdrive export` copies) and its input signature."""
    module.onnx_path = path or exported.path
    if workload is not None:
        module.signature = input_signature(workload, exported.input_names)
    providers = module.session().get_providers()
    module.overdrive_report = {"technique": technique, "runtime": module.runtime, "providers": ", ".join(providers),
                               "export max |diff|": f"{exported.max_abs_diff:.2g} on {exported.proof_rows} rows"}
    return module


def _preprocessed(path: Path, folder: Path) -> Path:
    """onnxruntime's recommended pre-processing before quantisation (shape inference, folding),
    written into `folder`, or the file as it is when that step fails."""
    try:
        from onnxruntime.quantization.shape_inference import quant_pre_process

        out = folder / "model.pre.onnx"
        quant_pre_process(str(path), str(out), skip_symbolic_shape=True)  # its symbolic pass writes temporary files into the current folder
        return out
    except Exception:  # noqa: BLE001 - quantising the plain export still works
        return path


class _CalibrationReader:
    """onnxruntime.quantization.CalibrationDataReader over the workload's training rows, in batches of 8."""

    def __init__(self, workload: Workload, names: list[str]):
        rows = list(workload.train_samples)[:CALIBRATION_ROWS]
        self._feeds = [dict(zip(names, (t.numpy() for t in workload.collate(rows[i:i + 8])))) for i in range(0, len(rows), 8)]
        self.rewind()

    def key(self) -> str:
        """sha256 (hex) of the calibration rows, for the cache of quantised files."""
        from overdrive.files.cache import tensors_key

        return tensors_key(a for feed in self._feeds for a in (torch.from_numpy(v) for v in feed.values()))

    def get_next(self):
        return next(self._batches, None)

    def rewind(self):  # a calibrator that reads the rows twice gets them twice, not an empty second pass
        self._batches = iter(self._feeds)
