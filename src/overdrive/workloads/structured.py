"""The plan's model as the user calls theirs: the same arguments in, the same structure out.

Inside overdrive a workload's model takes its inputs by position and returns one tensor [B, ...]
(`SignatureModel`: several outputs flattened per row and concatenated, [B, Σ]); every technique,
the guard, `run` and `serve` rely on that form. What `optimize` hands back (`result.model`) and
what `overdrive.load(plan, model)` rebuilds are that model behind `UserFacingModel`:

- inputs: bound as the user's `forward` binds them (by keyword, `model(**inputs)`, or by position
  in the forward's own order); the inputs the plan was measured with are required, and any other
  argument must be None or its default (the plan's model runs as it was measured, and says so
  instead of dropping an argument);
- outputs: the judged outputs, each reshaped to its own shape and dtype, in the container the user's
  model returned: the same `ModelOutput` class (attribute access), dataclass, dict, tuple or
  namedtuple. What the plan does not carry is None (absent from a plain dict): outputs that are not
  judged (token-level outputs that follow the input length, a KV cache, non-tensor values). A
  `ModelOutput` skips None fields when indexed by position, so `out[0]` may name another field
  than the user's model's `out[0]`: read them by name.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

_ABSENT = object()


def _join(prefix: str, key: Any) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


def skeleton(out: Any, prefix: str = "") -> tuple:
    """The containers of a model output with each tensor replaced by its path (as
    `signature.output_tensors` names it): ("tensor", path), ("mapping", type, [(key, node)]),
    ("fields", type, [(name, node)]) for a dataclass (a `ModelOutput` too), ("sequence", type,
    [node]), or ("other",) for anything else (None, a cache object, a number)."""
    if isinstance(out, torch.Tensor):
        return ("tensor", prefix)
    if dataclasses.is_dataclass(out) and not isinstance(out, type) and isinstance(out, Mapping):
        # a ModelOutput: its fields as a mapping holds them (None fields are not in it)
        return ("fields", type(out), [(k, skeleton(v, _join(prefix, k))) for k, v in out.items()])
    if isinstance(out, Mapping):
        return ("mapping", type(out), [(k, skeleton(v, _join(prefix, k))) for k, v in out.items()])
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        return ("fields", type(out), [(f.name, skeleton(getattr(out, f.name), _join(prefix, f.name)))
                                      for f in dataclasses.fields(out)])
    if isinstance(out, (tuple, list)):
        return ("sequence", type(out), [skeleton(v, _join(prefix, i)) for i, v in enumerate(out)])
    return ("other",)


def rebuild(node: tuple, values: Mapping[str, torch.Tensor]) -> Any:
    """The output `node` describes, with the tensors of `values` by path and None for the rest."""
    kind = node[0]
    if kind == "tensor":
        return values.get(node[1])
    if kind == "other":
        return None
    if kind == "sequence":
        cls, items = node[1], [rebuild(child, values) for child in node[2]]
        if hasattr(cls, "_fields"):  # a namedtuple
            return cls(*items)
        return items if issubclass(cls, list) else tuple(items) if cls is tuple else _construct(cls, items, tuple)
    items = {key: rebuild(child, values) for key, child in node[2]}
    cls = node[1]
    if kind == "fields":
        init = {f.name for f in dataclasses.fields(cls) if f.init}
        made = cls(**{k: v for k, v in items.items() if k in init})
        for k, v in items.items():
            if k not in init:
                object.__setattr__(made, k, v)
        return made
    items = {k: v for k, v in items.items() if v is not None}  # a plain mapping: what is not carried is absent
    return items if cls is dict else _construct(cls, items, dict)


def _construct(cls: type, items: Any, fallback: type) -> Any:
    try:
        return cls(items)
    except Exception:  # noqa: BLE001 - a container type that takes other arguments
        return fallback(items)


@dataclasses.dataclass(frozen=True)
class OutputLayout:
    """How the user's model returned its outputs: `skeleton`, and per judged output (in the order the
    concatenated tensor holds them) its path, row shape and dtype.

    Raises (from `split`):
        RuntimeError: the concatenated tensor's width is not the sum of the recorded row sizes.
    """

    skeleton: tuple
    paths: tuple[str, ...]
    row_shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]

    @classmethod
    def of(cls, out: Any, paths: Sequence[str]) -> OutputLayout:
        """The layout of the user's model output `out` (one batch) for the judged `paths`."""
        from overdrive.workloads.signature import pick_output

        tensors = [pick_output(out, p) for p in paths]
        return cls(skeleton=skeleton(out), paths=tuple(paths), row_shapes=tuple(tuple(t.shape[1:]) for t in tensors),
                   dtypes=tuple(t.dtype for t in tensors))

    def split(self, output: torch.Tensor) -> dict[str, torch.Tensor]:
        """The one tensor overdrive's model returns -> {path: tensor [B, *row shape]} in each output's dtype.
        A single output is returned whole (its shape may follow the input's)."""
        if len(self.paths) == 1:
            return {self.paths[0]: output.to(self.dtypes[0])}
        widths = [math.prod(shape) for shape in self.row_shapes]
        if output.dim() != 2 or output.shape[1] != sum(widths):
            raise RuntimeError(f"the optimized model returned {list(output.shape)}, not [B, {sum(widths)}] "
                               f"({', '.join(self.paths)} side by side): outputs whose shapes follow the input's cannot "
                               "be told apart; judge one of them (output=)")
        parts = torch.split(output, widths, dim=1)
        return {p: part.reshape(part.shape[0], *shape).to(dtype)
                for p, part, shape, dtype in zip(self.paths, parts, self.row_shapes, self.dtypes)}

    def rebuild(self, output: torch.Tensor) -> Any:
        return rebuild(self.skeleton, self.split(output))


def _signature(model: nn.Module) -> inspect.Signature | None:
    try:
        return inspect.signature(model.forward)
    except (TypeError, ValueError):
        return None


class UserFacingModel(nn.Module):
    """A plan's model (positional inputs, one tensor out) called as the user's model is.

    forward(*args, **kwargs): bound as the user's forward binds them; the inputs `input_names` (the
    example's keywords) are required, other arguments must be None or their default. Returns the
    judged outputs in the user's output structure (module docstring); float outputs keep the dtype
    the user's model gave them.

    Args:
        model: the plan's model (`techniques.compose.build`), kept as the submodule `model`.
        input_names: the keyword of each positional input of `model`; None: inputs by position.
        layout: the user's output structure (`OutputLayout.of`).
        signature: the user's forward's signature; None: keywords matched by name, positional
            arguments taken in `input_names` order.
    """

    def __init__(self, model: nn.Module, input_names: Sequence[str] | None, layout: OutputLayout,
                 signature: inspect.Signature | None = None):
        super().__init__()
        self.model = model
        self.input_names = tuple(input_names) if input_names else None
        self.layout = layout
        self.signature = signature

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.layout.rebuild(self.model(*self.inputs(args, kwargs)))

    def inputs(self, args: tuple, kwargs: dict) -> tuple[torch.Tensor, ...]:
        """The positional inputs of the plan's model for a call as the user's model takes it.

        Raises:
            TypeError: an input the plan takes is missing, or another argument is given (not None
                and not its default); Python's own message for a call the user's forward refuses.
        """
        if self.input_names is None:
            if kwargs:
                raise TypeError(f"this model takes its inputs by position; got keyword(s) {sorted(kwargs)}")
            return args
        given: dict[str, Any] = {}
        defaults: dict[str, Any] = {}
        if self.signature is not None:
            bound = self.signature.bind_partial(*args, **kwargs)
            for name, value in bound.arguments.items():
                parameter = self.signature.parameters[name]
                if parameter.kind == parameter.VAR_KEYWORD:
                    given.update(value)
                elif parameter.kind == parameter.VAR_POSITIONAL:
                    given.update({f"*{name}[{i}]": v for i, v in enumerate(value)})
                else:
                    given[name] = value
                    defaults[name] = parameter.default
        else:
            if len(args) > len(self.input_names):
                raise TypeError(f"this model takes {len(self.input_names)} inputs ({', '.join(self.input_names)}); "
                                f"got {len(args)} by position")
            given = {**dict(zip(self.input_names, args)), **kwargs}
        missing = [n for n in self.input_names if given.get(n) is None]
        if missing:
            raise TypeError(f"missing input(s) {', '.join(missing)}: the optimized model takes "
                            f"{', '.join(self.input_names)}, as its plan was measured")
        other = sorted(k for k, v in given.items() if k not in self.input_names and v is not None
                       and not _same(v, defaults.get(k, _ABSENT)))
        if other:
            raise TypeError(f"argument(s) {', '.join(other)}: the optimized model runs as its plan was measured, with "
                            f"{', '.join(self.input_names)} only; call your own model for other arguments")
        return tuple(given[n] for n in self.input_names)


def _same(value: Any, default: Any) -> bool:
    if default is _ABSENT or default is inspect.Parameter.empty or isinstance(value, torch.Tensor):
        return False
    try:
        return bool(value == default)
    except Exception:  # noqa: BLE001 - a value that does not compare
        return False


def user_facing(model: nn.Module, reference: nn.Module) -> nn.Module:
    """`model` (built from a workload whose model is `reference`) as the user calls theirs: behind
    `UserFacingModel` when `reference` is a `SignatureModel` that recorded the user's output layout;
    `model` itself for a model already in overdrive's form (positional tensors in, one tensor out)."""
    from overdrive.workloads.signature import SignatureModel

    if not isinstance(reference, SignatureModel) or reference.layout is None:
        return model
    return UserFacingModel(model, reference.input_names, reference.layout, _signature(reference.model))
