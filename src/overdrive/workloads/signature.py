"""Models as users have them: keyword inputs, structured outputs, a tokenizer.

Inside overdrive a workload's model takes its inputs positionally and returns one floating tensor
[B, ...] (every technique, the guard, `run` and `serve` rely on that). `SignatureModel` puts a
user's model behind that form without changing it:

- inputs: a dict example `{"input_ids": ..., "attention_mask": ...}` fixes the input names, in the
  dict's order; the model is called with them as keywords (a Hugging Face model's `forward`);
- outputs: a tensor, a tuple or list, a dict, a dataclass or a `transformers.utils.ModelOutput`
  (both dict and dataclass), nested. Each floating tensor in it whose first dimension is the
  batch is a candidate, named by its path ("logits", "0", "hidden_states.2"). The user may name
  the ones to judge (`output=`); by default every candidate is kept, except outputs that carry a
  dimension of a variable input length (a token-level output of a text model depends on how its
  batch was padded, so a row's answer would depend on its batch-mates). Several outputs are
  flattened per row and concatenated, [B, Σ numel per row], and `outputs_fidelity` judges each
  one apart and reports the worst, so a small output's error is not averaged away by a large one.

A factory may also return a tokenizer (`(model, tokenizer)` or `(model, example, tokenizer)`): any
`transformers.PreTrainedTokenizerBase`, or a callable `list[str] -> dict of tensors`. The model
then becomes a text workload like `minilm`: evaluated on real English sentences (CPython's
reference documentation, or the user's `data`), length-bucketed, compiled with dynamic shapes,
and `run` / `serve` take text. Whether the model's answer for a sentence depends on its padding is
measured when it is built (`overdrive.core.row_dependence`: a model that never receives the mask does).
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn

from overdrive.core.errors import WorkloadError, one_line
from overdrive.core.row_dependence import checked_dependence
from overdrive.core.workload import Workload, judged_figure, logits_fidelity

MAX_TEXT_LENGTH = 512  # tokens, when neither the tokenizer nor the model's config says


# -- outputs ---------------------------------------------------------------------------------------

def output_tensors(out: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """Every tensor in a model output with its path: "" for a lone tensor, "0" for a tuple's first
    element, "logits" for a dict key or dataclass field; nested paths joined by ".". None entries
    (a ModelOutput's absent loss) are skipped."""
    join = (lambda key: f"{prefix}.{key}" if prefix else str(key))
    if isinstance(out, torch.Tensor):
        return [(prefix, out)]
    if isinstance(out, Mapping):  # dict and transformers' ModelOutput (an OrderedDict of its non-None fields)
        return [item for key, value in out.items() for item in output_tensors(value, join(key))]
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        return [item for f in dataclasses.fields(out) for item in output_tensors(getattr(out, f.name), join(f.name))]
    if isinstance(out, (tuple, list)):
        return [item for i, value in enumerate(out) for item in output_tensors(value, join(i))]
    return []


def pick_output(out: Any, path: str) -> torch.Tensor:
    """The tensor at `path` (as `output_tensors` names it) in a model output."""
    for key in path.split(".") if path else []:
        if isinstance(out, Mapping):
            out = out[key]
        elif isinstance(out, (tuple, list)):
            out = out[int(key)]
        else:
            out = getattr(out, key)
    return out


class SignatureModel(nn.Module):
    """The user's model as overdrive calls it: inputs by position, one floating tensor out.

    forward(*inputs) -> model(**{name: input}, **call_kwargs) (or model(*inputs) without names); the
    selected output, or several flattened per row and concatenated: [B, Σ numel per row]. Keyword
    calls `forward(input_ids=..., attention_mask=...)` work too. What users get back
    (`result.model`, `overdrive.load`) is the plan's model behind `structured.UserFacingModel`, which
    returns the user's own output structure from `layout`.

    Args:
        model: the user's module (kept as the submodule `model`; techniques rewrite inside it).
        input_names: the keyword of each positional input, in order; None: positional.
        output_paths: the outputs returned, as `output_tensors` names them ("" for a lone tensor).
        layout: the user's output structure (`structured.OutputLayout`), when known.
        call_kwargs: keywords passed on every call (`model_call_kwargs`: no KV cache nothing reads).
    """

    def __init__(self, model: nn.Module, input_names: Sequence[str] | None, output_paths: Sequence[str],
                 layout: Any = None, call_kwargs: Mapping[str, Any] | None = None):
        super().__init__()
        self.model = model
        self.input_names = tuple(input_names) if input_names else None
        self.output_paths = tuple(output_paths)
        self.layout = layout
        self.call_kwargs = dict(call_kwargs or {})

    def forward(self, *inputs: torch.Tensor, **named: torch.Tensor) -> torch.Tensor:
        if named:
            if self.input_names is None:
                raise TypeError("this model takes its inputs by position")
            unknown = set(named) - set(self.input_names[len(inputs):])
            if unknown:  # an input overdrive does not pass on would be dropped without a word
                raise TypeError(f"unexpected inputs {sorted(unknown)}; this model takes {list(self.input_names)}")
            inputs = (*inputs, *(named[n] for n in self.input_names[len(inputs):] if n in named))
        if self.input_names:
            out = self.model(**dict(zip(self.input_names, inputs)), **self.call_kwargs)
        else:
            out = self.model(*inputs)
        parts = [pick_output(out, p) for p in self.output_paths]
        return parts[0] if len(parts) == 1 else torch.cat([p.reshape(p.shape[0], -1) for p in parts], dim=1)


def model_call_kwargs(model: nn.Module, output_paths: Sequence[str]) -> dict[str, Any]:
    """Keywords overdrive adds to every call of a keyword-input model: `use_cache=False` for a
    Hugging Face model whose forward takes it (GPT-2) when no judged output is its KV cache: the
    cache is not returned, and building it costs time and keeps OpenVINO from converting the model."""
    try:
        takes = "use_cache" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}
    return {"use_cache": False} if takes and not any(p.startswith("past_key_values") for p in output_paths) else {}


def outputs_fidelity(widths: Sequence[int],
                     base: Callable[[torch.Tensor, torch.Tensor], dict[str, float]] = logits_fidelity):
    """A fidelity over several outputs concatenated per row ([N, Σ widths]): `base` on each output
    apart, and for each figure the worst over the outputs that have it (the largest `max_rel_error`,
    the smallest of the others)."""
    bounds = [0]
    for w in widths:
        bounds.append(bounds[-1] + w)

    def fidelity(output: torch.Tensor, reference: torch.Tensor) -> dict[str, float]:
        per = [base(output[:, a:b], reference[:, a:b]) for a, b in zip(bounds, bounds[1:])]
        keys = dict.fromkeys(key for p in per for key in p)  # r2 is absent for an output whose rows do not vary
        worst = {key: [p[key] for p in per if key in p] for key in keys}
        return {key: max(values) if key == "max_rel_error" else min(values) for key, values in worst.items()}

    return fidelity


def _candidates(out: Any, batch: int) -> list[tuple[str, torch.Tensor]]:
    return [(p, t) for p, t in output_tensors(out) if t.dtype.is_floating_point and t.dim() >= 1 and t.shape[0] == batch]


def choose_outputs(name: str, out: Any, batch: int, output: str | Sequence[str] | None,
                   varying: set[str] = frozenset()) -> tuple[list[str], list[str]]:
    """The output paths a workload judges, and notes on what was left out.

    Args:
        out: the model's output on a batch of `batch` rows.
        output: the path(s) the user named; None: every candidate not in `varying`.
        varying: paths of outputs whose shape follows a variable input length.

    Raises:
        WorkloadError: a named output that is not a floating [B, ...] tensor, or none to judge.
    """
    candidates = dict(_candidates(out, batch))
    found = ", ".join(f"{p or '(the output)'} {list(t.shape)}" for p, t in output_tensors(out)) or type(out).__name__
    if output is not None:
        paths = [output] if isinstance(output, str) else list(output)
        missing = [p for p in paths if p not in candidates]
        if missing:
            raise WorkloadError(f"{name}: output {missing[0]!r} is not a floating tensor [B, ...] of the model's output; "
                                f"it returned {found}")
        return paths, []
    paths = [p for p in candidates if p not in varying]
    notes = []
    if varying & set(candidates):
        left = sorted(varying & set(candidates))
        notes.append(f"output(s) {', '.join(left)} follow the input length (token-level), so a row's values would depend "
                     "on its batch-mates' padding: they are not judged or served; the other outputs are")
    others = [f"{p or '(the output)'} ({t.dtype})" for p, t in output_tensors(out)
              if p not in candidates and not t.dtype.is_floating_point and t.dim() >= 1 and t.shape[0] == batch]
    if others and paths:
        notes.append(f"output(s) {', '.join(others)} are not floating point: they are not judged, and result.model, "
                     "load and serve return None for them (compute them from the judged outputs)")
    if not paths:
        raise WorkloadError(f"{name}: the model returned no floating tensor [B, ...] with B = {batch} rows that overdrive "
                            f"can judge (it returned {found}); return or name (output=) one with a batch dimension")
    return paths, notes


# -- inputs ----------------------------------------------------------------------------------------

def split_example(name: str, example: Any) -> tuple[tuple[torch.Tensor, ...], list[str] | None]:
    """A tensor, tuple/list of tensors, or dict of keyword tensors -> (positional tensors, their
    keywords or None).

    Raises:
        WorkloadError: anything else, or a tensor without a batch dimension.
    """
    if isinstance(example, Mapping):
        names = [str(k) for k in example]
        tensors = tuple(example[k] for k in example)
    else:
        names = None
        tensors = (example,) if isinstance(example, torch.Tensor) else tuple(example) if isinstance(example, (tuple, list)) else ()
    if not tensors or not all(isinstance(t, torch.Tensor) and t.dim() >= 1 for t in tensors):
        raise WorkloadError(f"{name}: the example input must be a tensor, a tuple of tensors or a dict of keyword tensors, "
                            "each with a batch dimension")
    if len({t.shape[0] for t in tensors}) != 1:
        raise WorkloadError(f"{name}: the example's tensors have different first (batch) dimensions "
                            f"{[list(t.shape) for t in tensors]}")
    return tensors, names


# -- dynamic dimensions ----------------------------------------------------------------------------

def call_model(model: nn.Module, names: Sequence[str] | None, inputs: Sequence[torch.Tensor]) -> Any:
    """`model(**{name: input})`, or `model(*inputs)` without names."""
    return model(**dict(zip(names, inputs))) if names else model(*inputs)


def normalize_dims(name: str, dynamic_dims: Mapping[Any, Any] | None, example: Sequence[torch.Tensor],
                   names: Sequence[str] | None) -> dict[int, tuple[int, ...]]:
    """The user's `dynamic_dims` ({"input_ids": {1: "seq"}}, {"input_ids": [1]}, {0: 1}) as
    {input index: dims of the batched tensor}.

    Raises:
        ConfigError: an input that is not the model's, or a dimension it does not have (0 is the batch).
    """
    from overdrive.core.errors import ConfigError, arg

    out: dict[int, tuple[int, ...]] = {}
    for key, value in (dynamic_dims or {}).items():
        index = key if isinstance(key, int) else (list(names).index(key) if names and key in names else None)
        if index is None and isinstance(key, str) and key.isdigit():
            index = int(key)
        if index is None or not 0 <= index < len(example):
            known = list(names) if names else list(range(len(example)))
            raise ConfigError(f"{arg('dynamic_dims')}: {name} has no input {key!r}; its inputs are {known}")
        dims = [value] if isinstance(value, int) else list(value)  # a mapping's keys are its dims
        for d in dims:
            if not isinstance(d, int) or not 1 <= d < example[index].dim():
                raise ConfigError(f"{arg('dynamic_dims')}: input {key!r} is {list(example[index].shape)}; dimension {d!r} "
                                  f"cannot vary (0 is the batch; expected 1..{example[index].dim() - 1})")
        out[index] = tuple(sorted({*out.get(index, ()), *dims}))
    return out


def _crop_pad(inputs: Sequence[torch.Tensor], dims: dict[int, tuple[int, ...]]) -> tuple[tuple, tuple]:
    """(each dynamic dimension cropped to half, the same zero-padded back to the full size)."""
    cropped = list(inputs)
    for i, ds in dims.items():
        for d in ds:
            cropped[i] = cropped[i].narrow(d, 0, max(1, inputs[i].shape[d] // 2))
    padded = list(cropped)
    for i in dims:
        padded[i] = inputs[i].new_zeros(inputs[i].shape)
        padded[i][tuple(slice(0, n) for n in cropped[i].shape)] = cropped[i]
    return tuple(cropped), tuple(padded)


def padding_check(model: nn.Module, names: Sequence[str] | None, example: Sequence[torch.Tensor],
                  dims: dict[int, tuple[int, ...]]) -> tuple[set[str], str | None]:
    """Whether rows of other sizes along `dims` can share a batch: the model runs on the example
    cropped to half along them, and zero-padding that back to full size leaves every output that
    does not follow the size unchanged (rtol 1e-4 of the output's scale).

    Returns:
        (paths of outputs whose shape follows the size, None or what went wrong).
    """
    cropped, padded = _crop_pad(example, dims)
    try:
        with torch.no_grad():
            short, long_ = output_tensors(call_model(model, names, cropped)), output_tensors(call_model(model, names, padded))
    except Exception as exc:  # noqa: BLE001 - the user's model refuses other sizes
        return set(), f"the model fails on shorter rows ({one_line(exc)})"
    short, long_ = dict(short), dict(long_)
    varying = {p for p, t in short.items() if p in long_ and t.shape != long_[p].shape}
    for path, t in short.items():
        if path in varying or path not in long_ or not t.dtype.is_floating_point:
            continue
        diff = float((t.float() - long_[path].float()).abs().max()) if t.numel() else 0.0
        scale = float(long_[path].float().abs().max()) if t.numel() else 0.0
        if not diff <= 1e-4 * scale + 1e-6:
            return varying, (f"zero padding changes output {path or '(the output)'} by up to {diff:.3g} (of {scale:.3g}): "
                             "rows of different sizes cannot share a batch")
    return varying, None


def detect_dynamic_dims(model: nn.Module, names: Sequence[str] | None, example: Sequence[torch.Tensor],
                        out: Any) -> tuple[dict[int, tuple[int, ...]], set[str], list[str]]:
    """Dimensions that may vary, found by calling the model at two sizes: for each size shared at
    one dimension by inputs that include an integer one (token ids, masks; images are never
    guessed), the dimension is dynamic when `padding_check` passes and some output does not
    follow the size.

    Args:
        out: the model's output on `example`.

    Returns:
        ({input index: dims}, paths of outputs that follow the sizes, notes on sizes the model takes
        but whose padding changes its answers, so rows must keep the example's size).
    """
    found: dict[int, tuple[int, ...]] = {}
    varying: set[str] = set()
    notes: list[str] = []
    groups = {(d, t.shape[d]) for t in example if not t.dtype.is_floating_point and t.dtype != torch.bool
              for d in range(1, t.dim()) if t.shape[d] >= 2}
    for d, size in sorted(groups):
        group = {i: (d,) for i, t in enumerate(example) if t.dim() > d and t.shape[d] == size}
        paths, problem = padding_check(model, names, example, group)
        if problem is None and {p for p, _ in output_tensors(out)} - paths:
            for i, ds in group.items():
                found[i] = tuple(sorted({*found.get(i, ()), *ds}))
            varying |= paths
        elif problem and problem.startswith("zero padding"):
            notes.append(f"{describe_dims(group, names)} could vary (the model runs at another size), but {problem}: rows "
                         f"must have size {size} there")
    return found, varying, notes


MASK_NAME = "attention_mask"  # the input whose zeros mark padding (Hugging Face's keyword)


def cut_padding(rows: list[tuple[torch.Tensor, ...]], dims: dict[int, tuple[int, ...]],
                names: Sequence[str] | None) -> tuple[list[tuple[torch.Tensor, ...]], int]:
    """Rows right-padded along their varying dimension, cut to their real length: the count of ones
    in their `attention_mask` row (ones, then zeros). `pad_stack` pads each batch back to its
    longest row, so length bucketing can group rows of similar length. Rows that are not
    right-padded (a mask with a zero inside, all zeros, left padding) are kept whole.

    Args:
        rows: samples, tuples of row tensors (no batch dimension).
        dims: the workload's dynamic dimensions (of the batched tensors).

    Returns:
        (the rows, how many were cut).
    """
    if not names or MASK_NAME not in names or dims.get(list(names).index(MASK_NAME)) != (1,):
        return rows, 0
    m = list(names).index(MASK_NAME)
    out, cut = [], 0
    for row in rows:
        mask = row[m]
        size = mask.shape[0] if mask.dim() == 1 else 0
        n = int((mask != 0).sum()) if size else 0
        if not 0 < n < size or not bool((mask[:n] != 0).all()):
            out.append(row)
            continue
        out.append(tuple(_narrow(t, dims.get(i, ()), size, n) for i, t in enumerate(row)))
        cut += 1
    return out, cut


def _narrow(row: torch.Tensor, dims: tuple[int, ...], size: int, n: int) -> torch.Tensor:
    for d in dims:  # d counts the batch dimension; the row has none
        if row.dim() >= d and row.shape[d - 1] == size:
            row = row.narrow(d - 1, 0, n).clone()  # its own storage: not a view that keeps the full row alive
    return row


def row_size(index: int, dim: int, row: tuple[torch.Tensor, ...]) -> int:
    """The size of `row[index]` along `dim` of the batched tensor (a row's length, `Workload.row_length`)."""
    return int(row[index].shape[dim - 1])


def describe_dims(dims: dict[int, tuple[int, ...]], names: Sequence[str] | None) -> str:
    return ", ".join(f"{names[i] if names else f'input {i}'} dim {', '.join(map(str, ds))}" for i, ds in sorted(dims.items()))


# -- a tokenizer -----------------------------------------------------------------------------------

def is_tokenizer(obj: Any) -> bool:
    """A transformers tokenizer, or a plain callable (not a module or tensor) taken as `list[str] -> dict`."""
    # An instance of transformers' class exists only once transformers is imported (1.3 s to import for nothing)
    base = sys.modules.get("transformers.tokenization_utils_base")
    if base is not None and isinstance(obj, base.PreTrainedTokenizerBase):
        return True
    return callable(obj) and not isinstance(obj, (nn.Module, torch.Tensor, type))


def _max_length(tokenizer: Any, model: nn.Module) -> int:
    limits = [getattr(tokenizer, "model_max_length", None),
              getattr(getattr(model, "config", None), "max_position_embeddings", None)]
    limits = [int(x) for x in limits if isinstance(x, int) and 0 < x < 100_000]
    return min(limits) if limits else MAX_TEXT_LENGTH


def _tokenize(tokenizer: Any, names: list[str], max_length: int, hf: bool, texts: list[str]) -> tuple[torch.Tensor, ...]:
    if hf:
        encoded = tokenizer(list(texts), padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    else:
        encoded = tokenizer(list(texts))
    return tuple(torch.as_tensor(encoded[n]) for n in names)


def _forward_parameters(model: nn.Module) -> set[str] | None:
    try:
        parameters = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind == p.VAR_KEYWORD for p in parameters):
        return None
    return {p.name for p in parameters}


def text_workload(name: str, model: nn.Module, tokenizer: Any, *, output: str | Sequence[str] | None = None) -> Workload:
    """A model with its tokenizer as a text workload, evaluated on CPython's reference sentences
    (real English; `data` replaces them), with distillation sentences from standard-library
    docstrings for pruning's recovery.

    Args:
        model: takes the tokenizer's outputs as keywords (those its forward names; all of them when
            it takes **kwargs).
        tokenizer: a `transformers.PreTrainedTokenizerBase` (padded to the batch's longest, truncated
            at the smaller of its `model_max_length` and the model config's `max_position_embeddings`)
            or a callable `list[str] -> {name: int tensor [B, S]}` that pads itself.

    Raises:
        WorkloadError: the tokenizer fails on a sentence, or the model on its output.
    """
    from overdrive.files.sentences import python_doc_sentences, python_docstring_sentences
    from overdrive.workloads.structured import OutputLayout

    try:
        from transformers import PreTrainedTokenizerBase
        hf = isinstance(tokenizer, PreTrainedTokenizerBase)
    except ImportError:
        hf = False
    sentences = list(python_doc_sentences()[:2048])
    max_length = _max_length(tokenizer, model)
    try:
        encoded = tokenizer(sentences[:2], **({"padding": True, "truncation": True, "max_length": max_length,
                                               "return_tensors": "pt"} if hf else {}))
        keys = list(encoded.keys())
    except Exception as exc:  # noqa: BLE001 - the user's tokenizer
        raise WorkloadError(f"{name}: the tokenizer failed on two sentences, or returned no dict of tensors: "
                            f"{one_line(exc)}") from None
    accepted = _forward_parameters(model)
    names = [k for k in keys if accepted is None or k in accepted]
    if not names:
        raise WorkloadError(f"{name}: the model's forward takes none of the tokenizer's outputs {keys}")
    collate = partial(_tokenize, tokenizer, names, max_length, hf)
    model = model.eval()
    short, long_ = collate(sentences[:2]), collate([sentences[0], sentences[0] + " " + sentences[1]])
    outputs = []
    for inputs in (short, long_):
        try:
            with torch.no_grad():
                outputs.append(model(**dict(zip(names, inputs))))
        except Exception as exc:  # noqa: BLE001
            raise WorkloadError(f"{name}: the model failed on its tokenizer's output "
                                f"({', '.join(f'{n} {list(t.shape)}' for n, t in zip(names, inputs))}): {one_line(exc)}") from None
    shapes = [dict(output_tensors(o)) for o in outputs]
    varying = {p for p, t in shapes[0].items() if p in shapes[1] and t.shape != shapes[1][p].shape}
    paths, notes = choose_outputs(name, outputs[0], 2, output, varying)
    widths = [shapes[0][p][0].numel() for p in paths]
    lengths: dict[str, int] = {}
    if hf:  # one call for the evaluation sentences: length bucketing asks for each
        lengths.update(zip(sentences, (min(len(ids), max_length) for ids in tokenizer(sentences, truncation=True, max_length=max_length)["input_ids"])))

    def sample_length(text: str) -> int:
        if text not in lengths:
            lengths[text] = int(collate([text])[0].shape[-1])
        return lengths[text]

    workload = Workload(
        name=name,
        model=SignatureModel(model, names, paths, layout=OutputLayout.of(outputs[0], paths),
                             call_kwargs=model_call_kwargs(model, paths)).eval(),
        samples=sentences,
        collate=collate,
        fidelity=logits_fidelity if len(paths) == 1 else outputs_fidelity(widths),
        fidelity_key=judged_figure(widths),
        default_batch_size=32,
        train_samples=python_docstring_sentences(),
        sample_length=sample_length,
        notes=notes,
        input_names=names,
        output_names=paths,
        description="your model with its tokenizer, on Python reference sentences",
        extra={"tokenizer": tokenizer if hf else None, "max_seq_length": max_length, "classifier": paths == ["logits"],
               "output_widths": widths},
    )
    checked_dependence(workload)  # a model that pools over its pads answers a sentence by its batch-mates' lengths
    return workload
