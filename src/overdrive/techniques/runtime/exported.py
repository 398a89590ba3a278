"""What the runtimes outside PyTorch share (ONNX Runtime, OpenVINO, TensorRT): one runtime per plan,
only steps that survive export before it, and a session per thread count.

A runtime technique exports the model built so far (pruned and folded in PyTorch) and hands it
to another runtime; its `apply` returns a `RuntimeModule`, an nn.Module with no parameters whose
forward takes and returns torch tensors like the model it replaced. Steps whose effect lives in
PyTorch's own execution (autocast, torch.compile, torch.ao int8, inference_mode) cannot come
before it: the registry's `conflict` says so, `build` refuses such a plan, and the tuner tries
the runtime instead of them (measured), never on top of them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from overdrive.core.workload import Workload
from overdrive.techniques.registry import Stage, Technique

RUNTIME_GROUP = "runtime"


class RuntimeModule(nn.Module):
    """A model run by another runtime behind the nn.Module call convention.

    forward(*inputs: torch.Tensor [B, ...]) -> torch.Tensor [B, ...] (float32, owned by the
    caller: the runtime's output buffer is copied before the next call can overwrite it).

    Sessions are made by `make_session(threads)` and kept per calling thread and intra-op thread
    count: `serve` and `run` set `torch.set_num_threads` in each instance/replica thread before its
    first call, and that thread count is the one its session uses; a session (an OpenVINO infer
    request holds its output buffer) is never shared by two threads at once.
    """

    def __init__(self, make_session: Callable[[int], Any], run: Callable[[Any, tuple[torch.Tensor, ...]], torch.Tensor],
                 *, runtime: str, keep: Any = None):
        super().__init__()
        self._make_session, self._run, self.runtime = make_session, run, runtime
        self._sessions: dict[tuple[int, int], Any] = {}
        self._lock = threading.Lock()
        self._keep = keep  # e.g. the temporary folder holding the exported file
        self.signature: list[tuple[str, torch.dtype, tuple[int | None, ...]]] | None = None  # `input_signature`
        self.session()  # fail at build time, not at the first request

    def session(self) -> Any:
        key = (threading.get_ident(), torch.get_num_threads())
        with self._lock:
            if key not in self._sessions:
                self._sessions[key] = self._make_session(key[1])
            return self._sessions[key]

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        if self.signature is not None:
            inputs = self._conform(inputs)
        return self._run(self.session(), inputs)

    def _conform(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """The inputs in the dtypes the exported graph takes (an int32 id tensor widened to int64, as
        PyTorch's embedding takes either), after checking their shapes against it.

        Raises:
            ValueError: an input's rank or a fixed size differs from the exported graph's (the message
                names the input and the shape it takes).
            TypeError: the number of inputs differs, or a float given where integers are taken.
        """
        if len(inputs) != len(self.signature):
            raise TypeError(f"{self.runtime}: the exported graph takes {len(self.signature)} inputs "
                            f"({', '.join(n for n, _, _ in self.signature)}), not {len(inputs)}")
        conformed = []
        for t, (name, dtype, shape) in zip(inputs, self.signature):
            if t.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape)):
                wanted = ", ".join("*" if s is None else str(s) for s in shape)
                raise ValueError(f"{self.runtime}: input {name!r} has shape {list(t.shape)}; the exported graph takes "
                                 f"[{wanted}] (* varies; a fixed size was fixed by the example optimize measured: name "
                                 "the dimensions that vary with dynamic_dims / --dynamic-dim)")
            if t.dtype != dtype:
                if dtype.is_floating_point != t.dtype.is_floating_point and dtype != torch.bool:
                    raise TypeError(f"{self.runtime}: input {name!r} is {t.dtype}; the exported graph takes {dtype}")
                t = t.to(dtype)
            conformed.append(t)
        return tuple(conformed)

    def extra_repr(self) -> str:
        return self.runtime


class ExportedRuntime(Technique):
    """Base of the runtime techniques that take the model out of PyTorch."""
    setup_cost = "export"  # `tuning.budget`: what building it costs before its first timed pass

    stage = Stage.RUNTIME
    group = RUNTIME_GROUP
    leaves_pytorch = True
    package: str = ""  # the Python package it needs
    install_hint: str = ""

    def applicability(self, workload: Workload, device: torch.device) -> str | None:
        import importlib.util

        if self.package and importlib.util.find_spec(self.package) is None:
            return f"{self.package} is not installed{f' ({self.install_hint})' if self.install_hint else ''}"
        return None


def input_signature(workload: Workload, names: list[str] | None = None) -> list[tuple[str, torch.dtype, tuple]]:
    """(name, dtype, shape) of each input the exported graph takes, a varying size (the batch unless
    the model takes one, the dynamic dimensions) as None: from the example it was exported with."""
    from overdrive.files.onnx import axes_for, example_inputs, input_names

    inputs = example_inputs(workload)
    names = names or input_names(workload, len(inputs))
    axes = axes_for(workload, inputs)
    return [(name, t.dtype, tuple(None if d in axes.get(name, {}) else size for d, size in enumerate(t.shape)))
            for name, t in zip(names, inputs)]


def cpu_model(model: nn.Module) -> nn.Module:
    """The model on the CPU in eval mode, for export (the caller's copy is private)."""
    return model.cpu().eval()
