"""CUDA graphs: the whole forward captured once per input shape and replayed as one launch.

At small and medium batches a GPU forward is bound by its kernel launches: hundreds of kernels of
a few microseconds each, each launched by the host. A CUDA graph records them once and replays
them with a single launch (https://pytorch.org/docs/stable/notes/cuda.html#cuda-graphs; the same
mechanism as torch.compile's mode="reduce-overhead" and TensorRT's / vLLM's graph capture).

How `CUDAGraphModule` keeps the answers right:
- **One graph per input shape** (batch size, and length for text, with dtype and device): a
  graph replays fixed addresses and shapes. A shape is captured the first time it is seen, up to
  `max_graphs`; later new shapes run eagerly and are counted (`stats`), never replayed wrongly.
- **Static inputs filled by copy**: each call's tensors (positional or keyword, nested in tuples,
  lists, dicts) are copied into the graph's own input buffers before the replay. Other arguments
  are part of the key by type and value (1, 1.0 and True are three graphs). A model that writes
  into its inputs is not captured (a replay could not write into the caller's tensors).
- **Outputs copied out before the next replay**: a replay overwrites the graph's output buffers,
  so every call returns tensors of its own (the overwrite-on-replay trap), in the same structure
  (tuples, named tuples, lists, dicts and their subclasses, dataclasses); a model whose outputs
  hold tensors in another kind of object is not captured.
- **One memory pool shared by the graphs** (`torch.cuda.graph_pool_handle`): the graphs of
  different shapes reuse each other's intermediate memory. That is safe because every graph's
  static outputs stay alive and replays are serialised (one lock per module), so no two graphs'
  intermediates are ever in use at once.
- **Warm-up before capture**: three eager calls on a side stream (lazy initialisation, cuDNN /
  cuBLAS autotuning, torch.compile's compilation of that shape) before the capture, as PyTorch
  documents. A model that cannot be captured (a host sync such as `.item()` in its forward) runs
  eagerly for that shape, and the reason is kept in `stats`; a call that fails eagerly too (a bad
  input) raises its error and marks nothing.
- Capture uses `capture_error_mode="thread_local"`, so serve's and run's other threads may keep
  using CUDA while one captures.

The capture itself is pluggable (`capture=`) so the bookkeeping is tested on the CPU with
`FakeCapture`, whose replay recomputes into the same static buffers as a real graph would.
"""

from __future__ import annotations

import copy as copy_module
import dataclasses
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

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

    def __call__(self, fn: Callable[[], Any]) -> tuple[Callable[[], None], Any]:
        """(replay, static outputs) of `fn()` (which reads the static inputs), after `WARMUP_CALLS` warm-up calls."""
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            for _ in range(WARMUP_CALLS):
                fn()
        current.wait_stream(self.stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
            static_outputs = fn()
        return graph.replay, static_outputs


class FakeCapture:
    """A stand-in for `CudaCapture` on the CPU (tests): the "graph" is `fn` run again, its results
    written into the first call's output tensors, which every replay overwrites as a real graph's do."""

    def __init__(self):
        self.captures = 0

    def __call__(self, fn: Callable[[], Any]) -> tuple[Callable[[], None], Any]:
        self.captures += 1
        for _ in range(WARMUP_CALLS):
            fn()
        static_outputs = owned(fn())
        buffers = tensors_in(static_outputs)

        def replay() -> None:
            for buffer, value in zip(buffers, tensors_in(fn())):
                buffer.copy_(value)

        return replay, static_outputs


def owned(value: Any) -> Any:
    """`value` with every tensor in it cloned: tensors, tuples (named too), lists, dicts (and their
    subclasses, e.g. transformers' ModelOutput), dataclasses; other values as they are.

    Raises:
        TypeError: an object of another kind that holds tensors (its outputs could not be copied out).
    """
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        copy = copy_module.copy(value)
        for key in value:
            copy[key] = owned(value[key])
        return copy
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(owned(v) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(owned(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        copy = copy_module.copy(value)  # every field, `init=False` ones too
        for f in dataclasses.fields(value):
            object.__setattr__(copy, f.name, owned(getattr(value, f.name)))
        return copy
    held = vars(value).values() if hasattr(value, "__dict__") else ()
    if any(isinstance(v, torch.Tensor) for v in held):
        raise TypeError(f"outputs of type {type(value).__name__} hold tensors that cannot be copied out")
    return value  # numbers, strings, None, dtypes: nothing a replay overwrites


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors in `value`, in the order `owned` visits them."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors_in(v)]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors_in(v)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [t for f in dataclasses.fields(value) for t in tensors_in(getattr(value, f.name))]
    return []


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


def _leaf_key(leaf: Any):
    """How one argument leaf keys a graph: a tensor by shape, dtype, device (its values are copied in);
    anything else by type and value, so 1, 1.0 and True are three keys."""
    if isinstance(leaf, torch.Tensor):
        return ("tensor", tuple(leaf.shape), leaf.dtype, leaf.device)
    if isinstance(leaf, float):  # by its bits: NaN equals itself here, so it reuses its graph
        return ("float", leaf.hex())
    return (type(leaf).__qualname__, leaf)


def _describe(key: tuple) -> str:
    """A key as the report shows it: each tensor's shape, each other value's repr (short)."""
    parts = []
    for leaf in key[1]:
        parts.append("×".join(map(str, leaf[1])) if leaf[0] == "tensor" else repr(leaf[1])[:20])
    return ", ".join(parts)


class CUDAGraphModule(ForwardWrapper):
    """`inner` replayed from CUDA graphs, one per input shape (see the module docstring).

    Arguments (positional and keyword, nested in tuples, lists and dicts) are flattened with
    torch.utils._pytree: tensors are copied into the graph's static inputs; every other leaf is
    part of the graph's key by type and value.

    Args:
        inner: the model (eval mode, on the device).
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

    def forward(self, *args, **kwargs):
        leaves, spec = tree_flatten((args, kwargs))
        key = (str(spec), tuple(_leaf_key(leaf) for leaf in leaves))
        try:
            hash(key)
        except TypeError:  # an unhashable non-tensor argument: no graph can be keyed by it
            with self._lock:
                return self._eager(args, kwargs, "an unhashable argument", "")
        with self._lock:
            graph = self.graphs.get(key)
            if graph is None:
                if key in self._uncapturable:
                    return self._eager(args, kwargs, None, "")
                if len(self.graphs) >= self.max_graphs:
                    return self._eager(args, kwargs, f"beyond the {self.max_graphs} shapes captured", _describe(key))
                try:
                    graph = self._capture(leaves, spec)
                except Exception as exc:  # noqa: BLE001 - this shape runs eagerly (unless the inputs are at fault)
                    out = self.inner(*args, **kwargs)  # raises when the call itself is wrong: nothing is marked then
                    self._uncapturable.add(key)
                    self.stats.eager_calls += 1
                    self.stats.eager_reasons.setdefault(_describe(key), f"capture failed: {one_line(exc)}")
                    return out
                self.graphs[key] = graph
                self.stats.captured += 1
            for static, value in zip(graph.static_inputs, (leaf for leaf in leaves if isinstance(leaf, torch.Tensor))):
                static.copy_(value)
            graph.replay()
            self.stats.replays += 1
            return owned(graph.static_outputs)  # the next replay overwrites the static outputs

    def overdrive_fallbacks(self) -> str | None:
        """What ran eagerly instead of replaying (`registry.fallbacks`), or None."""
        return f"cuda-graphs: {self.stats.describe()}" if self.stats.eager_calls else None

    def _capture(self, leaves: list, spec) -> _Graph:
        static_inputs = [leaf.clone() for leaf in leaves if isinstance(leaf, torch.Tensor)]
        tensors = iter(static_inputs)
        args, kwargs = tree_unflatten([next(tensors) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves], spec)
        versions = [t._version for t in static_inputs]
        replay, static_outputs = self.capture(lambda: self.inner(*args, **kwargs))
        if [t._version for t in static_inputs] != versions:
            raise RuntimeError("the model writes into its inputs; a replay could not write into the caller's tensors")
        owned(static_outputs)  # raises now, not at the first replay, for outputs that cannot be copied out
        return _Graph(static_inputs=static_inputs, replay=replay, static_outputs=static_outputs)

    def _eager(self, args: tuple, kwargs: dict, reason: str | None, shape: str):
        self.stats.eager_calls += 1
        if reason:
            self.stats.eager_reasons.setdefault(shape or "?", reason)
        return self.inner(*args, **kwargs)


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
    setup_cost = "compile"  # `tuning.budget`: what building it costs before its first timed pass

    config_cls = CudaGraphsConfig
    stage = Stage.RUNTIME
    lossless = True
    devices = ("cuda",)
    description = "CUDA graphs: one capture per input shape, replayed as a single launch; outputs copied out"

    def apply(self, model, config, *, workload, device):
        capture = CudaCapture(device) if device.type == "cuda" else FakeCapture()
        return CUDAGraphModule(model, capture=capture, max_graphs=config.max_graphs)
