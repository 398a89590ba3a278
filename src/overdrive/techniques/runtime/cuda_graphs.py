"""CUDA graphs: the whole forward captured once per input shape and replayed as one launch.

At small and medium batches a GPU forward is bound by its kernel launches: hundreds of kernels of
a few microseconds each, each launched by the host. A CUDA graph records them once and replays
them with a single launch (https://pytorch.org/docs/stable/notes/cuda.html#cuda-graphs; the same
mechanism as torch.compile's mode="reduce-overhead" and TensorRT's / vLLM's graph capture).

How `CUDAGraphModule` keeps the answers right:
- **One graph per input shape** (batch size, and length for text, with dtype and device): a
  graph replays fixed addresses and shapes. A shape is captured the first time it is seen, up to
  `max_graphs`; later new shapes run eagerly and are counted (`stats`), never replayed wrongly.
- **Static inputs filled by copy**: each call's tensors are copied into the graph's own input
  buffers before the replay. Non-tensor arguments are part of the shape key, by value.
- **Outputs copied out before the next replay**: a replay overwrites the graph's output buffers,
  so every call returns tensors of its own (the overwrite-on-replay trap); a caller can keep them.
- **One memory pool shared by the graphs** (`torch.cuda.graph_pool_handle`): the graphs of
  different shapes reuse each other's intermediate memory. That is safe because every graph's
  static outputs stay alive and replays are serialised (one lock per module), so no two graphs'
  intermediates are ever in use at once.
- **Warm-up before capture**: three eager calls on a side stream (lazy initialisation, cuDNN /
  cuBLAS autotuning, torch.compile's compilation of that shape) before the capture, as PyTorch
  documents. A model that cannot be captured (a host sync such as `.item()` in its forward) runs
  eagerly for that shape, and the reason is kept in `stats`.
- Capture uses `capture_error_mode="thread_local"`, so serve's and run's other threads may keep
  using CUDA while one captures.

The capture itself is pluggable (`capture=`) so the bookkeeping is tested on the CPU with
`FakeCapture`, whose replay recomputes into the same static buffers as a real graph would.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from overdrive.core.errors import one_line
from overdrive.core.workload import Workload
from overdrive.techniques.registry import ForwardWrapper, Stage, Technique, TechniqueConfig, register

WARMUP_CALLS = 3


class CudaCapture:
    """Captures with `torch.cuda.CUDAGraph`, all graphs in one memory pool."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device=self.device)

    def __call__(self, fn: Callable, static_inputs: tuple) -> tuple[Callable[[], None], Any]:
        """(replay, static outputs) of `fn(*static_inputs)`, after `WARMUP_CALLS` warm-up calls."""
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            for _ in range(WARMUP_CALLS):
                fn(*static_inputs)
        current.wait_stream(self.stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
            static_outputs = fn(*static_inputs)
        return graph.replay, static_outputs


class FakeCapture:
    """A stand-in for `CudaCapture` on the CPU (tests): the "graph" is `fn` run again on the static
    inputs, its results written into the first call's output tensors, which every replay overwrites
    as a real graph's do."""

    def __init__(self):
        self.captures = 0

    def __call__(self, fn: Callable, static_inputs: tuple) -> tuple[Callable[[], None], Any]:
        self.captures += 1
        static_outputs = tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, fn(*static_inputs))
        buffers = [t for t in tree_flatten(static_outputs)[0] if isinstance(t, torch.Tensor)]

        def replay() -> None:
            fresh = [t for t in tree_flatten(fn(*static_inputs))[0] if isinstance(t, torch.Tensor)]
            for buffer, value in zip(buffers, fresh):
                buffer.copy_(value)

        return replay, static_outputs


@dataclass
class _Graph:
    static_inputs: list[torch.Tensor]
    replay: Callable[[], None]
    static_outputs: Any


@dataclass
class GraphStats:
    """What a `CUDAGraphModule` did: shapes captured, replays, eager calls and why."""

    captured: int = 0
    replays: int = 0
    eager_calls: int = 0
    eager_reasons: dict[str, str] = field(default_factory=dict)  # shape → why it runs eagerly

    def describe(self) -> str:
        line = f"{self.captured} shapes captured, {self.replays} replays, {self.eager_calls} eager calls"
        if self.eager_reasons:
            line += " (" + "; ".join(f"{shape}: {why}" for shape, why in list(self.eager_reasons.items())[:3]) + ")"
        return line


def _shape_key(args: tuple) -> tuple:
    return tuple((tuple(a.shape), a.dtype, a.device) if isinstance(a, torch.Tensor) else ("value", a) for a in args)


class CUDAGraphModule(ForwardWrapper):
    """`inner` replayed from CUDA graphs, one per input shape (see the module docstring).

    Args:
        inner: the model (eval mode, on the device), called positionally.
        capture: `CudaCapture(device)` or `FakeCapture()`.
        max_graphs: shapes captured at most; later new shapes run eagerly and are counted.
    """

    def __init__(self, inner: nn.Module, *, capture: Callable, max_graphs: int):
        super().__init__(inner)
        self.capture = capture
        self.max_graphs = max_graphs
        self.graphs: dict[tuple, _Graph] = {}
        self.stats = GraphStats()
        self._uncapturable: set[tuple] = set()  # shapes whose capture failed: eager, never retried
        self._lock = threading.Lock()

    def forward(self, *args):
        key = _shape_key(args)
        try:
            hash(key)
        except TypeError:  # an unhashable argument: no graph can be keyed by it
            with self._lock:
                return self._eager(args, "an unhashable argument")
        with self._lock:
            graph = self.graphs.get(key)
            if graph is None:
                if key in self._uncapturable:
                    return self._eager(args, None)
                if len(self.graphs) >= self.max_graphs:
                    return self._eager(args, f"beyond the {self.max_graphs} shapes captured", key)
                try:
                    graph = self._capture(args)
                except Exception as exc:  # noqa: BLE001 - e.g. a host sync in the forward: this shape runs eagerly
                    self._uncapturable.add(key)
                    return self._eager(args, f"capture failed: {one_line(exc)}", key)
                self.graphs[key] = graph
                self.stats.captured += 1
            for static, value in zip(graph.static_inputs, (a for a in args if isinstance(a, torch.Tensor))):
                static.copy_(value)
            graph.replay()
            self.stats.replays += 1
            # Owned copies: the next replay overwrites the static outputs.
            return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, graph.static_outputs)

    def overdrive_fallbacks(self) -> str | None:
        """What ran eagerly instead of replaying (`registry.fallbacks`), or None."""
        return f"cuda-graphs: {self.stats.describe()}" if self.stats.eager_calls else None

    def _capture(self, args: tuple) -> _Graph:
        static_inputs = [a.clone() for a in args if isinstance(a, torch.Tensor)]
        tensors = iter(static_inputs)
        call_args = tuple(next(tensors) if isinstance(a, torch.Tensor) else a for a in args)
        replay, static_outputs = self.capture(lambda *a: self.inner(*a), call_args)
        return _Graph(static_inputs=static_inputs, replay=replay, static_outputs=static_outputs)

    def _eager(self, args: tuple, reason: str | None, key: tuple | None = None):
        self.stats.eager_calls += 1
        if reason:
            self.stats.eager_reasons.setdefault(_describe_key(key) if key is not None else "?", reason)
        return self.inner(*args)


def _describe_key(key: tuple) -> str:
    return "×".join(",".join(map(str, k[0])) if k[0] != "value" else repr(k[1]) for k in key)


@dataclass(frozen=True, kw_only=True)
class CudaGraphsConfig(TechniqueConfig):
    """Attributes:
    max_graphs: input shapes captured at most (each holds its own static buffers); later new shapes
        run eagerly and are counted.
    """

    name: ClassVar[str] = "cuda-graphs"

    max_graphs: int = 64

    def __post_init__(self):
        if not isinstance(self.max_graphs, int) or self.max_graphs < 1:
            raise ValueError(f"CudaGraphsConfig.max_graphs must be a positive integer, not {self.max_graphs!r}")


@register
class CudaGraphs(Technique):
    """The forward captured as CUDA graphs, one per input shape (see the module docstring)."""

    config_cls = CudaGraphsConfig
    stage = Stage.RUNTIME
    lossless = True
    devices = ("cuda",)
    description = "CUDA graphs: one capture per input shape, replayed as a single launch; outputs copied out"

    def apply(self, model, config, *, workload, device):
        capture = CudaCapture(device) if device.type == "cuda" else FakeCapture()
        return CUDAGraphModule(model, capture=capture, max_graphs=config.max_graphs)
