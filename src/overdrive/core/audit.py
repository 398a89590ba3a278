"""The copy and sync audit: what one forward does besides computing.

On a GPU, small and medium batches are bound by what surrounds the kernels: host↔device copies,
host synchronisations (a `.item()` waits for every kernel queued before it) and the launches
themselves. `audit_forward` counts them for one call of a model on one batch:

- **Copies inside the forward**, host→device and device→host, with their bytes, seen at the
  Python level through a `TorchFunctionMode` (`Tensor.to` / `.cuda()` / `.cpu()` / `.numpy()` /
  `.tolist()`, `Tensor.copy_` across devices, `torch.tensor` / `as_tensor` / `from_numpy` of host
  data). On the CPU they are counted as the GPU would do them: a `.cpu()` of a tensor already on
  the CPU is free here and a device→host copy and a synchronisation there; a tensor built from
  host data inside the forward is a host→device copy there.
- **Synchronisations**, by kind, through a `TorchDispatchMode`: scalar reads
  (`aten._local_scalar_dense`: `.item()`, `bool(t)`, `int(t)`, `float(t)`), data-dependent output
  shapes (`nonzero`, `masked_select`, `unique`, boolean-mask indexing, `repeat_interleave` without
  `output_size`), and every device→host copy.
- **Operations**: ATen operations dispatched (views and metadata excluded), the launch count an
  eager GPU run would roughly have; on CUDA also the kernel launches, CUDA-graph launches, memcpy
  calls and synchronisations the PyTorch profiler records (`torch.profiler`, CUPTI), which see
  inside compiled code.
- **The step around the forward**: the batch's input bytes (host→device) and output bytes
  (device→host), one copy per tensor, as `bench`, `serve` and `run` move them.

A compiled model is audited eagerly (`torch.compiler.set_stance("force_eager")`) for the copies,
syncs and ATen operations, because the modes cannot see inside a compiled graph (and would make it
recompile); compilation removes neither copies nor syncs, so these counts hold for it. Its CUDA
launches come from the profiler, on the compiled model itself.
A runtime outside PyTorch (ONNX Runtime, OpenVINO, TensorRT) does its own copies, which no
PyTorch mode sees: `Audit.opaque` says so, and the report names it.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from dataclasses import asdict, dataclass, field

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from overdrive.core.roofline import tensors_bytes

_aten = torch.ops.aten

# ATen operations whose output shape depends on the values: the host must wait for the device.
_DATA_DEPENDENT = {
    _aten.nonzero.default: "nonzero",
    _aten.masked_select.default: "masked_select",
    _aten._unique2.default: "unique",
    _aten.unique_dim.default: "unique",
    _aten.unique_consecutive.default: "unique_consecutive",
    _aten.repeat_interleave.Tensor: "repeat_interleave",
}
_LAUNCH_EVENTS = {"cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx",
                  "cudaLaunchCooperativeKernel"}
_SYNC_EVENTS = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"}


@dataclass(kw_only=True)
class Audit:
    """One forward's copies, synchronisations and operations (see the module docstring).

    Attributes:
        device: the device type audited ("cpu", "cuda").
        batch_size: rows in the audited batch.
        h2d_copies, h2d_bytes: host→device copies inside the forward (on the CPU: those a GPU would do).
        d2h_copies, d2h_bytes: device→host copies inside the forward (idem).
        syncs: {kind: count} of host synchronisations inside the forward.
        sync_sites: {kind: "file:line in function"} of the first of each kind, in the model's code (the
            innermost frame outside torch and overdrive's own).
        aten_ops: ATen operations dispatched, views excluded (eager).
        input_bytes, input_tensors: what the step copies host→device before the forward.
        output_bytes, output_tensors: what it copies device→host after.
        kernel_launches, graph_launches, memcpy_calls, device_syncs: from the CUDA profiler; None on the CPU.
        opaque: a runtime outside PyTorch ran part of the forward; its own copies are not counted.
    """

    device: str
    batch_size: int
    h2d_copies: int = 0
    h2d_bytes: int = 0
    d2h_copies: int = 0
    d2h_bytes: int = 0
    syncs: dict[str, int] = field(default_factory=dict)
    sync_sites: dict[str, str] = field(default_factory=dict)
    aten_ops: int = 0
    input_bytes: int = 0
    input_tensors: int = 0
    output_bytes: int = 0
    output_tensors: int = 0
    kernel_launches: int | None = None
    graph_launches: int | None = None
    memcpy_calls: int | None = None
    device_syncs: int | None = None
    opaque: bool = False

    @property
    def num_syncs(self) -> int:
        return sum(self.syncs.values())

    def _sync(self, kind: str) -> None:
        self.syncs[kind] = self.syncs.get(kind, 0) + 1
        if kind not in self.sync_sites:
            self.sync_sites[kind] = _caller()

    def describe(self) -> str:
        """One line: the forward's copies and syncs, its operations, and the step's copies."""
        from overdrive.core.report import format_bytes

        syncs = ", ".join(f"{n} {kind}" + (f" at {self.sync_sites[kind]}" if self.sync_sites.get(kind) else "")
                          for kind, n in sorted(self.syncs.items())) or "none"
        parts = [f"inside the forward: {self.h2d_copies} host→device copies ({format_bytes(self.h2d_bytes)}), "
                 f"{self.d2h_copies} device→host ({format_bytes(self.d2h_bytes)}), syncs: {syncs}"
                 + (" (as a GPU would do them)" if self.device == "cpu" else "")]
        if self.kernel_launches is not None:
            parts.append(f"{self.kernel_launches} kernel launches, {self.graph_launches} CUDA-graph launches, "
                         f"{self.memcpy_calls} memcpy calls, {self.device_syncs} device synchronisations (profiler)")
        parts.append(f"{self.aten_ops} ATen ops eager")
        parts.append(f"the step: {self.input_tensors} input tensors ({format_bytes(self.input_bytes)}) in, "
                     f"{self.output_tensors} out ({format_bytes(self.output_bytes)})")
        line = f"batch {self.batch_size}: " + "; ".join(parts)
        if self.opaque:
            line += "; a runtime outside PyTorch ran the model: its own copies are not counted"
        return line

    def to_dict(self) -> dict:
        return {**asdict(self), "num_syncs": self.num_syncs}


_INTERNAL = (f"{os.sep}torch{os.sep}", f"{os.sep}overdrive{os.sep}core{os.sep}audit.py", f"{os.sep}contextlib.py")


def _caller() -> str:
    """"file:line in function" of the innermost frame outside torch and this module: the model's line."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if not any(part in frame.filename for part in _INTERNAL):
            return f"{os.path.basename(frame.filename)}:{frame.lineno} in {frame.name}"
    return ""


def _count_tensors(values) -> int:
    if isinstance(values, torch.Tensor):
        return 1
    if isinstance(values, dict):
        return sum(_count_tensors(v) for v in values.values())
    if isinstance(values, (tuple, list)):
        return sum(_count_tensors(v) for v in values)
    return 0


class _Transfers(TorchFunctionMode):
    """Counts the Python-level transfers of one forward into `audit` (see the module docstring)."""

    def __init__(self, audit: Audit):
        super().__init__()
        self.audit = audit

    def _d2h(self, tensor: torch.Tensor, kind: str) -> None:
        self.audit.d2h_copies += 1
        self.audit.d2h_bytes += tensor.numel() * tensor.element_size()
        self.audit._sync(kind)

    def _h2d(self, nbytes: int) -> None:
        self.audit.h2d_copies += 1
        self.audit.h2d_bytes += nbytes

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        this = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if this is not None and name in ("cpu", "numpy", "tolist"):
            if this.device.type != "cpu" or name == "cpu" or self.audit.device == "cpu":
                self._d2h(this, f".{name}()")
        elif this is not None and name == "cuda":
            if this.device.type == "cpu":
                self._h2d(this.numel() * this.element_size())
        elif this is not None and name == "to" and isinstance(out, torch.Tensor):
            target = torch._C._nn._parse_to(*args[1:], **kwargs)[0]
            if target is not None and target.type != this.device.type:
                if target.type == "cpu":
                    self._d2h(this, ".to('cpu')")
                else:
                    self._h2d(this.numel() * this.element_size())
        elif this is not None and name == "copy_" and len(args) > 1 and isinstance(args[1], torch.Tensor):
            src = args[1]
            if src.device.type != this.device.type:
                if this.device.type == "cpu":
                    self._d2h(src, "copy_ to host")
                else:
                    self._h2d(src.numel() * src.element_size())
        elif name in ("tensor", "as_tensor", "from_numpy") and isinstance(out, torch.Tensor):
            source = args[0] if args else kwargs.get("data")
            device = kwargs.get("device")
            if not isinstance(source, torch.Tensor) and (device is None or torch.device(device).type != "cpu"):
                self._h2d(out.numel() * out.element_size())  # host data made a tensor: a copy to a GPU
        return out


class _Operations(TorchDispatchMode):
    """Counts ATen operations, scalar reads and data-dependent shapes into `audit`."""

    def __init__(self, audit: Audit):
        super().__init__()
        self.audit = audit

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _aten._local_scalar_dense.default:
            self.audit._sync("scalar read (.item(), bool(), int(), float())")
        elif func in _DATA_DEPENDENT:
            self.audit._sync(f"data-dependent shape ({_DATA_DEPENDENT[func]})")
        elif func is _aten.index.Tensor and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                                 for i in (args[1] if len(args) > 1 else [])):
            self.audit._sync("data-dependent shape (boolean-mask indexing)")
        if not (torch.Tag.view_copy in func.tags or func.is_view or func._overloadpacket.__name__ in _METADATA):
            self.audit.aten_ops += 1
        return func(*args, **kwargs)


_METADATA = {"detach", "alias", "view", "_unsafe_view", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset",
             "lift_fresh", "_local_scalar_dense", "empty_strided", "empty", "new_empty", "new_empty_strided"}


def _force_eager():
    """torch.compile's "force_eager" stance where this torch has it (≥ 2.6), else nothing."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()


def _profile_cuda(model: nn.Module, inputs: tuple, audit: Audit) -> None:
    """Fill the profiler's counts (CUDA): launches, CUDA-graph launches, memcpy calls, synchronisations."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        model(*inputs)
        torch.cuda.synchronize()
    counts: dict[str, int] = {}
    for event in prof.events():
        counts[event.name] = counts.get(event.name, 0) + 1
    audit.kernel_launches = sum(n for name, n in counts.items() if name in _LAUNCH_EVENTS)
    audit.graph_launches = counts.get("cudaGraphLaunch", 0)
    audit.memcpy_calls = sum(n for name, n in counts.items() if name.startswith("cudaMemcpy"))
    # The profiler's own final torch.cuda.synchronize() is one; it is not the model's.
    audit.device_syncs = max(0, sum(n for name, n in counts.items() if name in _SYNC_EVENTS) - 1)


@torch.no_grad()
def audit_forward(model: nn.Module, inputs: tuple, *, device: torch.device, opaque: bool = False) -> Audit:
    """Audit one call `model(*inputs)` (see the module docstring). The model runs two or three times
    (eager under the counting modes; on CUDA once more under the profiler, as it is).

    Args:
        model: the model as it will run (compiled or not), on `device`.
        inputs: one batch, already on `device` (a tuple of tensors [B, ...] and other values).
        device: where it runs.
        opaque: a runtime outside PyTorch runs the model (its own copies cannot be seen).

    Returns:
        The Audit. Raises what the model raises.
    """
    device = torch.device(device)
    first = next((t for t in inputs if isinstance(t, torch.Tensor)), None)
    audit = Audit(device=device.type, batch_size=int(first.shape[0]) if first is not None and first.dim() else 1,
                  opaque=opaque, input_bytes=tensors_bytes(inputs), input_tensors=_count_tensors(inputs))
    with _force_eager(), _Transfers(audit), _Operations(audit):
        outputs = model(*inputs)
    audit.output_bytes, audit.output_tensors = tensors_bytes(outputs), _count_tensors(outputs)
    if device.type == "cuda":
        _profile_cuda(model, inputs, audit)
    return audit
