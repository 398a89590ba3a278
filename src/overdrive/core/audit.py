"""The copy and sync audit: what one forward does besides computing.

On a GPU, small and medium batches are bound by what surrounds the kernels: host↔device copies,
host synchronisations (a `.item()` waits for every kernel queued before it) and the launches
themselves. `audit_forward` counts them for one call of a model on one batch:

- **Copies inside the forward**, host→device and device→host, with their bytes, seen at the
  Python level through a `TorchFunctionMode` (`Tensor.to` / `.cuda()` / `.cpu()` / `.numpy()` /
  `.tolist()`, `Tensor.copy_` across devices, `torch.tensor` / `as_tensor` on a device) and at the
  ATen level (a host tensor, not a scalar, used with device tensors). On the CPU they are counted as
  a GPU would do them: which tensors would be on the host is tracked (`_Transfers`), so a `.cpu()` is
  one device→host copy and sync, and the `.numpy()` after it none.
- **Synchronisations**, by kind, through a `TorchDispatchMode`: scalar reads
  (`aten._local_scalar_dense`: `.item()`, `bool(t)`, `int(t)`, `float(t)`), data-dependent output
  shapes (`nonzero`, `masked_select`, `unique`, boolean-mask indexing, `repeat_interleave` without
  `output_size`), and every device→host copy.
- **Operations**: ATen operations dispatched (views and metadata excluded), the launch count an
  eager GPU run would roughly have; on CUDA also the kernel launches, CUDA-graph launches, memcpy
  calls and synchronisations the PyTorch profiler records (`torch.profiler`, CUPTI), which see
  inside compiled code.
- **Fast paths**: the counting modes switch off PyTorch's fused inference paths
  (nn.TransformerEncoder with nested tensors, nn.MultiheadAttention's fused kernel), so the model
  also runs once as it is under the profiler; scalar reads and data-dependent ops it records beyond
  the modes' count are reported as syncs of their own kind (`FAST_PATH`).
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
from dataclasses import asdict, dataclass, field, fields

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

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

    @classmethod
    def from_dict(cls, data: dict) -> Audit:
        """`to_dict`'s inverse (results.json, bench.json)."""
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})


_INTERNAL = (f"{os.sep}torch{os.sep}", f"{os.sep}overdrive{os.sep}core{os.sep}", f"{os.sep}overdrive{os.sep}techniques{os.sep}",
             f"{os.sep}contextlib.py")


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


# Factories that make a tensor on `device=` (the host when not given), from no tensor.
_FACTORIES = {"zeros", "ones", "empty", "full", "arange", "linspace", "logspace", "eye", "rand", "randn", "randint",
              "randperm", "empty_strided", "tril_indices", "triu_indices"}


class _Transfers(TorchFunctionMode):
    """Counts the Python-level transfers of one forward into `audit` (see the module docstring).

    Which tensors are on the host: on a GPU, those whose device is the CPU. On the CPU, where every
    tensor is, the ones a GPU run would keep on the host: made from host data without a device
    (`torch.tensor(data)`), made by `.cpu()` / `.numpy()` / `.to("cpu")`, or `torch.from_numpy`.
    A device named as a string ("cpu") is taken literally; a `torch.device` object (as `x.device` gives)
    is taken as the model's device, i.e. the GPU's there."""

    def __init__(self, audit: Audit):
        super().__init__()
        self.audit = audit
        self.on_cpu = audit.device == "cpu"
        self.host: dict[int, torch.Tensor] = {}  # on the CPU: tensors a GPU run keeps on the host (kept alive: ids stay unique)

    def is_host(self, tensor: torch.Tensor) -> bool:
        return id(tensor) in self.host if self.on_cpu else tensor.device.type == "cpu"

    def _mark_host(self, value) -> None:
        if self.on_cpu and isinstance(value, torch.Tensor):
            self.host[id(value)] = value

    def _moved(self, this: torch.Tensor, out, *, to_host: bool):
        """On the CPU, `.cpu()` / `.to(device)` return the tensor itself where a GPU returns a new one
        on the other side: an alias (same storage, a Python object of its own) stands for it, so the
        original keeps its side."""
        if self.on_cpu and out is this:
            out = this.detach()
        if to_host:
            self._mark_host(out)
        else:
            self.host.pop(id(out), None)  # the alias's detach was seen as a host-only op
        return out

    def _to_host(self, target) -> bool:
        """Whether a device argument sends a tensor to the host (see the class docstring)."""
        if target is None:
            return False
        if self.on_cpu:
            return isinstance(target, str) and torch.device(target).type == "cpu"
        return torch.device(target).type == "cpu"

    def _d2h(self, tensor: torch.Tensor, kind: str) -> None:
        self.audit.d2h_copies += 1
        self.audit.d2h_bytes += tensor.numel() * tensor.element_size()
        self.audit._sync(kind)

    def _h2d(self, tensor: torch.Tensor) -> None:
        self.audit.h2d_copies += 1
        self.audit.h2d_bytes += tensor.numel() * tensor.element_size()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        this = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if this is not None and name in ("cpu", "numpy", "tolist"):
            if not self.is_host(this):
                self._d2h(this, f".{name}()")
            out = self._moved(this, out, to_host=True) if name == "cpu" else out
        elif this is not None and name == "cuda":
            if self.is_host(this):
                self._h2d(this)
                out = self._moved(this, out, to_host=False)
        elif this is not None and name == "to" and isinstance(out, torch.Tensor):
            raw = kwargs.get("device", args[1] if len(args) > 1 and isinstance(args[1], (str, torch.device)) else None)
            if raw is not None:
                if self._to_host(raw):
                    if not self.is_host(this):
                        self._d2h(this, ".to('cpu')")
                    out = self._moved(this, out, to_host=True)
                elif self.is_host(this):
                    self._h2d(this)
                    out = self._moved(this, out, to_host=False)
            elif self.is_host(this):  # .to(dtype) of a host tensor stays on the host
                self._mark_host(out)
        elif this is not None and name == "copy_" and len(args) > 1 and isinstance(args[1], torch.Tensor):
            src_host, dst_host = self.is_host(args[1]), self.is_host(this)
            if dst_host and not src_host:
                self._d2h(args[1], "copy_ to host")
            elif src_host and not dst_host:
                self._h2d(args[1])
        elif name in _FACTORIES and isinstance(out, torch.Tensor) and not self._to_host(kwargs.get("device", "cpu")):
            pass  # made on the model's device (device=x.device): no copy, not on the host
        elif name in _FACTORIES and isinstance(out, torch.Tensor):
            self._mark_host(out)  # torch.zeros(8), torch.arange(n): made on the host, as on a GPU run
        elif this is not None and name == "new_tensor" and isinstance(out, torch.Tensor):
            if not self.is_host(this):
                self._h2d(out)  # host data to the tensor's device
            else:
                self._mark_host(out)
        elif name in ("tensor", "as_tensor", "from_numpy") and isinstance(out, torch.Tensor):
            source = args[0] if args else kwargs.get("data")
            if isinstance(source, torch.Tensor):
                if self.is_host(source):
                    self._mark_host(out)
            elif name == "from_numpy" or self._to_host(kwargs.get("device")) or kwargs.get("device") is None:
                self._mark_host(out)  # host data, and it stays on the host
            else:
                self._h2d(out)  # host data made a tensor on the device: a copy
        return out


class _Operations(TorchDispatchMode):
    """Counts ATen operations, scalar reads of device tensors and data-dependent shapes into `audit`."""

    def __init__(self, audit: Audit, transfers: _Transfers):
        super().__init__()
        self.audit = audit
        self.transfers = transfers
        self.dispatched_syncs = 0  # scalar reads (of host tensors too) and data-dependent ops, as the profiler counts them

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _aten._local_scalar_dense.default or func in _DATA_DEPENDENT and func is not _aten.repeat_interleave.Tensor:
            self.dispatched_syncs += 1
        elif func in (_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default) and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else [])):
            self.dispatched_syncs += 1  # a nonzero inside, which the profiler records
        if func is _aten._local_scalar_dense.default:
            if not self.transfers.is_host(args[0]):  # reading a host tensor's value waits for nothing
                self.audit._sync("scalar read (.item(), bool(), int(), float())")
        elif func in _DATA_DEPENDENT:
            self.audit._sync(f"data-dependent shape ({_DATA_DEPENDENT[func]})")
        elif func in (_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default) and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else [])):
            kind = "boolean-mask indexing" if func is _aten.index.Tensor else "boolean-mask assignment"
            self.audit._sync(f"data-dependent shape ({kind})")
        if not (torch.Tag.view_copy in func.tags or func.is_view or func._overloadpacket.__name__ in _METADATA):
            self.audit.aten_ops += 1
        out = func(*args, **kwargs)
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        host = [t for t in tensors if self.transfers.is_host(t)]
        if tensors and len(host) == len(tensors):  # made from host tensors only: on the host too
            for t in tree_flatten(out)[0]:
                self.transfers._mark_host(t)
        else:  # a host tensor (not a scalar) used with device tensors: a GPU copies it over first
            for t in host:
                if t.dim() > 0 and func is not _aten.copy_.default:
                    self.transfers._h2d(t)
        return out


_METADATA = {"detach", "alias", "view", "_unsafe_view", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset",
             "lift_fresh", "_local_scalar_dense", "empty_strided", "empty", "new_empty", "new_empty_strided"}


def _force_eager():
    """torch.compile's "force_eager" stance where this torch has it (≥ 2.6), else nothing."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()


_PROFILED_SYNCS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::_unique2",
                   "aten::unique_dim", "aten::unique_consecutive"}
FAST_PATH = ("in the model as it runs, beyond the eager count (fused fast paths, compiled code; the profiler, on this "
             "device's own kernels)")


def _inside_sync(event) -> bool:
    """Whether a profiler event runs inside another event counted as a sync."""
    parent = getattr(event, "cpu_parent", None)
    while parent is not None:
        if parent.name in _PROFILED_SYNCS:
            return True
        parent = getattr(parent, "cpu_parent", None)
    return False


@contextlib.contextmanager
def _quiet_native_stderr():
    """The profiler's native library logs its start and stop (and, without a GPU, a device-count
    error) straight to file descriptor 2; those lines are not the user's business. Python-level
    errors are unaffected (they are raised, not printed)."""
    import sys

    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _profile(model: nn.Module, inputs: tuple, audit: Audit, seen_by_modes: int, device: torch.device) -> None:
    """The model run as it is (no counting modes; once unprofiled first) under the PyTorch profiler:
    scalar reads and data-dependent ops beyond `seen_by_modes` are syncs of a path the modes did not
    see (a fused fast path they switch off, such as nn.TransformerEncoder's nested tensors, or compiled
    code); on CUDA also the kernel launches, CUDA-graph launches, memcpy calls and device synchronisations."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    model(*inputs)  # after the eager pass under the modes: anything lazy happens here, not in the profile
    if cuda:
        torch.cuda.synchronize(device)
    with _quiet_native_stderr(), profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        model(*inputs)
        if cuda:
            torch.cuda.synchronize(device)
    counts: dict[str, int] = {}
    syncs = 0
    for event in prof.events():
        counts[event.name] = counts.get(event.name, 0) + 1
        if event.name in _PROFILED_SYNCS and not _inside_sync(event):
            syncs += 1  # a masked_select's own scalar read is part of it, not a second sync
    hidden = syncs - seen_by_modes
    if hidden > 0:
        audit.syncs[FAST_PATH] = hidden
    if cuda:
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
    transfers = _Transfers(audit)
    operations = _Operations(audit, transfers)
    with _force_eager(), transfers, operations:
        outputs = model(*inputs)
    audit.output_bytes, audit.output_tensors = tensors_bytes(outputs), _count_tensors(outputs)
    _profile(model, inputs, audit, operations.dispatched_syncs, device)
    return audit
