"""A workload's model behind the Open Inference Protocol: named tensors in, validated, batched,
run, and split back per request. Implements the batcher's `BatchModel`.

Inputs: text workloads take one BYTES tensor `text` of shape [N] (or [N, 1]) of UTF-8
sentences, tokenized on the server and padded per batch with an attention mask. Tensor
workloads take their inputs by the model's keyword names (`input_ids`, `attention_mask`) when it
has them, else `input` (or `input__0`, `input__1`, ... for several), of shape [N, *row shape] in
the workload's dtype, -1 where sizes vary from row to row (`Workload.dynamic_dims`: zero-padded
per batch). Output: `output`, FP32 [N, *output row shape]; a model with several outputs
(`Workload.output_names`) answers each by its name, FP32 [N, its numbers per row].

A model whose answer for a row depends on the rows batched with it (`Workload.batch_dependence`: a
plan's record, or measured for a text model) is never given rows whose answers would change: text
rows of different token counts in one batch run as separate calls of one length each (no row is
padded; the batcher also buckets by exact length then), and a model whose rows depend on their
batch-mates runs each row alone. The server says so when it loads the model.

Validation (HTTP 400, before a request joins a batch): names, datatypes and shapes, then the
values against `overdrive.core.input_limits`: an integer input that the model looks up in an
embedding must hold ids within its rows (text: the tokenized ids, when the tokenizer can give
ids the model has no rows for), and floating-point inputs must be finite (no NaN or ±inf).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from overdrive.core.input_limits import InputLimits, workload_input_limits
from overdrive.core.measure import compiled_graphs
from overdrive.core.memory import owned_host_float32, to_device
from overdrive.core.row_dependence import checked_dependence
from overdrive.core.workload import BATCH_MATES, Workload, pad_stack, row_size_problem
from overdrive.run.replica import text_lengths
from overdrive.serve.protocol import DATATYPES, InferRequest, Tensor, datatype_of

OUTPUT = "output"
log = logging.getLogger("overdrive.cli.serve")


class ValidationError(ValueError):
    """The request does not match the model's inputs; the message names what was expected (HTTP 400)."""


@dataclass
class TensorSpec:
    name: str
    datatype: str
    shape: list[int]  # -1 for a variable dimension

    def to_dict(self) -> dict:
        return {"name": self.name, "datatype": self.datatype, "shape": self.shape}


@dataclass
class TextPayload:
    texts: list[str]
    lengths: list[int]  # tokens per row


def _columns(sample) -> tuple:
    """A tensor sample as a 1-tuple; a tuple sample (several model inputs) as itself."""
    return (sample,) if isinstance(sample, torch.Tensor) else tuple(sample)


def _tokenizer_fits(workload: Workload, limits: InputLimits) -> bool:
    """Whether every id the workload's tokenizer (`extra["tokenizer"]`) can give is within every id range."""
    tokenizer = workload.extra.get("tokenizer")
    try:
        return tokenizer is not None and len(tokenizer) <= limits.lowest_high()
    except TypeError:  # a tokenizer without a length
        return False


class ServedModel:
    """One workload model, on one or more devices, as the batcher's `BatchModel`.

    Args:
        name: the model name in URLs.
        workload: gives the samples' structure, the collate (tokenizer) and the row length.
        models: one ready-to-call model per device (from `plan.build`), in eval mode.
        devices: the devices of `models`; instance i runs on models[i % len(models)].

    Raises:
        ValueError: the workload's samples are neither strings nor tensors / tuples of tensors,
            or the model does not return one tensor with a batch dimension.
    """

    def __init__(self, name: str, workload: Workload, models: list[nn.Module], devices: list[torch.device]):
        self.name = name
        self.workload = workload
        self.models = models
        self.devices = devices
        self.fixed_batch_size = workload.fixed_batch_size
        self.threads_per_instance: int | None = None  # intra-op threads each instance thread sets (None: leave)
        self.recompiles = 0  # graphs torch.compile compiled for live batches, after the warm-up
        self.on_cold_batch = None  # called (instance thread) the first time a batch size the warm-up skipped runs
        self._warm_sizes: set[int] = set()
        self._graphs_seen: int | None = None  # compiled_graphs() once warm; None: still warming up
        # Token counts for the length buckets, computed in the request handler: the tokenizer reads
        # at most 128 × max_seq_length characters of a text (a string of megabytes tokenised whole
        # would block every other request on the event loop meanwhile).
        self._token_counts = (text_lengths(workload) or (lambda texts: [len(t) for t in texts])) if workload.is_text else None
        sample = workload.samples[0]
        if workload.is_text:
            self.inputs = [TensorSpec("text", "BYTES", [-1])]
        else:
            columns = _columns(sample)
            if not columns or not all(isinstance(c, torch.Tensor) for c in columns):
                raise ValueError(f"workload {workload.name!r}: serve needs samples that are strings or tensors")
            names = workload.input_names or (["input"] if len(columns) == 1 else [f"input__{i}" for i in range(len(columns))])
            dims = workload.dynamic_dims  # sizes that vary from row to row: -1, padded per batch
            self.inputs = [TensorSpec(n, datatype_of(np.dtype(str(c.dtype).removeprefix("torch."))),
                                      [-1, *(-1 if d in dims.get(i, ()) else s for d, s in enumerate(c.shape, start=1))])
                           for i, (n, c) in enumerate(zip(names, columns))]
        # What the inputs may hold (ids within the embeddings' rows, finite floats), from the fp32
        # model: a bad value gets a 400 here instead of reaching compiled code, which can abort the process.
        self.limits = workload_input_limits(workload)
        self._check_text_ids = workload.is_text and bool(self.limits.ranges) and not _tokenizer_fits(workload, self.limits)
        self.dependence = checked_dependence(workload)  # a plan's record, or measured now for text
        if self.dependence is not None:
            log.warning("%s: %s", name, self.dependence.describe())
        probe = self.execute([self._example()], 0)[0]  # also warms every instance up below
        for i in range(1, len(models)):
            self.execute([self._example()], i)
        names, widths = workload.output_names or [], workload.extra.get("output_widths") or []
        if len(names) > 1 and len(widths) == len(names) and sum(widths) == int(np.prod(probe.shape[1:])):
            self.outputs = [TensorSpec(n, "FP32", [-1, w]) for n, w in zip(names, widths)]  # each flattened per row
        else:
            self.outputs = [TensorSpec(OUTPUT, "FP32", [-1, *probe.shape[1:]])]

    def _example(self, index: int = 0):
        sample = self.workload.samples[index % len(self.workload.samples)]
        if self.workload.is_text:
            return TextPayload([sample], self._token_counts([sample]))
        return tuple(c.unsqueeze(0) for c in _columns(sample))

    def _warm_payloads(self, size: int) -> list:
        """The payloads the warm-up runs at batch size `size`: one row repeated (nothing padded) and, for rows
        whose length varies, `size` different rows padded to the longest: a compiled model may take another
        path for each (remove-padding skips its packing when no row is padded), a graph of its own to build
        now rather than while requests wait (`run.replica.warm_up_batches`)."""
        payloads = [self.concat_payloads([self._example()] * size)]
        varies = self.workload.is_text or self.workload.dynamic_dims
        if size > 1 and varies and not self.workload.equal_lengths_only:
            payloads.append(self.concat_payloads([self._example(i) for i in range(size)]))
        return payloads

    def start_instance(self, instance: int) -> None:
        """Thread set-up, called once in instance `instance`'s own thread: its intra-op threads."""
        if self.threads_per_instance:
            torch.set_num_threads(self.threads_per_instance)

    def warmup(self, max_batch_size: int, budget_s: float,
               instance: int | None = None) -> tuple[list[int], float, list[tuple[int, float, int]]]:
        """Run the batch sizes the server warms, 1, 2, 4, ... and `max_batch_size`, once each on
        instance `instance`'s model (every instance's when None), until `budget_s` seconds have
        passed. The server calls it in each instance's own thread.

        Kernel libraries build and cache per-shape state on first use (oneDNN primitives on
        CPU, cuDNN/cuBLAS plans on GPU): without this, the first batch of each size a server
        sees is tens of ms slower, which shows up as its p99 (Triton's `model_warmup`). The
        other sizes are cold once: each is counted (`on_cold_batch`) the first time it runs.

        Returns:
            (batch sizes warmed, seconds taken, [(rows, seconds of the second run, row length)]:
            the adaptive batcher's first cost curve).
        """
        start = time.perf_counter()
        sizes = sorted({2 ** i for i in range(max_batch_size.bit_length())} | {max_batch_size})
        done, timings = [], []
        example = self._example()
        length = self.length(example)
        for size in sizes:
            if time.perf_counter() - start > budget_s:
                break
            payload, *others = self._warm_payloads(size)
            for i in range(len(self.models)) if instance is None else [instance]:
                for warm in (payload, *others):
                    self.execute([warm], i)  # the first run at a shape pays its set-up
                t0 = time.perf_counter()
                self.execute([payload], i)
                timings.append((size, time.perf_counter() - t0, length))
            done.append(size)
        self._warm_sizes.update(done)
        return done, time.perf_counter() - start, timings

    def watch_recompiles(self) -> None:
        """From now on (the warm-up is done), a batch that makes torch.compile compile a new graph
        is logged and counted in `recompiles`: its requests waited for the compilation."""
        self._graphs_seen = compiled_graphs()

    def _check_recompiles(self, inputs: tuple) -> None:
        if self._graphs_seen is None:
            return
        now = compiled_graphs()
        if now > self._graphs_seen:
            self.recompiles += now - self._graphs_seen
            shapes = ", ".join(str(list(t.shape)) for t in inputs)
            log.warning("torch.compile compiled a new graph for a batch of shape %s after the warm-up (%d so far): its "
                        "requests waited for the compilation", shapes, self.recompiles)
        self._graphs_seen = now

    def concat_payloads(self, payloads: list):
        if isinstance(payloads[0], TextPayload):
            return TextPayload([t for p in payloads for t in p.texts], [n for p in payloads for n in p.lengths])
        if self.workload.dynamic_dims and len(payloads) > 1:  # rows of other sizes: zero-padded to the largest
            rows = [tuple(t[r] for t in p) for p in payloads for r in range(p[0].shape[0])]
            return pad_stack(self.workload.dynamic_dims, rows, self.workload.extra.get("max_dynamic_size"))
        return tuple(torch.cat(col) for col in zip(*payloads))

    def split_output(self, output: np.ndarray) -> list[tuple[str, np.ndarray]]:
        """A request's rows of the model's output as (name, array) per output of the metadata: the
        concatenated columns of several outputs split back, each [rows, width]."""
        if len(self.outputs) == 1:
            return [(self.outputs[0].name, output)]
        bounds = np.cumsum([0, *(s.shape[1] for s in self.outputs)])
        flat = output.reshape(output.shape[0], -1)
        return [(s.name, flat[:, a:b]) for s, a, b in zip(self.outputs, bounds, bounds[1:])]

    # -- metadata --------------------------------------------------------------------------------

    def metadata(self) -> dict:
        """`$metadata_model_response` of the Open Inference Protocol."""
        return {"name": self.name, "versions": ["1"], "platform": "pytorch_overdrive",
                "inputs": [s.to_dict() for s in self.inputs], "outputs": [s.to_dict() for s in self.outputs]}

    # -- validation (on the event loop, before a request joins a batch) --------------------------

    def validate(self, request: InferRequest):
        """Check names, datatypes and shapes, and turn the tensors into a payload.

        Raises:
            ValidationError: naming the expected inputs, datatypes, shapes or outputs.
        """
        expected = {s.name: s for s in self.inputs}
        if set(request.inputs) != set(expected):
            raise ValidationError(f"model {self.name!r} takes inputs {self._describe(self.inputs)}; "
                                  f"got {sorted(request.inputs)}")
        unknown = set(request.outputs) - {s.name for s in self.outputs}
        if unknown:
            raise ValidationError(f"model {self.name!r} has outputs {[s.name for s in self.outputs]}; unknown requested "
                                  f"outputs {sorted(unknown)}")
        if self.workload.is_text:
            return self._validate_text(request.inputs["text"])
        tensors = [self._validate_tensor(request.inputs[s.name], s) for s in self.inputs]
        rows = {t.shape[0] for t in tensors}
        if len(rows) != 1:
            raise ValidationError(f"all inputs must have the same first (batch) dimension; got {sorted(rows)}")
        if self.workload.dynamic_dims:  # inputs that vary together agree, within the model's positions
            problem = row_size_problem(self.workload.dynamic_dims, tuple(t[0] for t in tensors),
                                       self.workload.extra.get("max_dynamic_size"), [s.name for s in self.inputs])
            if problem:
                raise ValidationError(problem)
        self._check_limits(tuple(tensors), [f"input {s.name!r}" for s in self.inputs], "row")
        return tuple(tensors)

    def _check_limits(self, inputs: tuple[torch.Tensor, ...], names: list[str], row_word: str) -> None:
        problems = self.limits.row_problems(inputs, names)
        if problems:
            row, reason = min(problems.items())
            more = f" ({len(problems) - 1} more {row_word}s of the request too)" if len(problems) > 1 else ""
            raise ValidationError(f"{row_word} {row}: {reason}{more}")

    @staticmethod
    def _describe(specs: list[TensorSpec]) -> str:
        return ", ".join(f"{s.name} {s.datatype} {s.shape}" for s in specs)

    def _validate_text(self, tensor: Tensor) -> TextPayload:
        if tensor.datatype != "BYTES":
            raise ValidationError(f"input 'text' must be BYTES (UTF-8 strings), got {tensor.datatype}")
        if len(tensor.shape) not in (1, 2) or (len(tensor.shape) == 2 and tensor.shape[1] != 1) or tensor.shape[0] < 1:
            raise ValidationError(f"input 'text' must have shape [N] or [N, 1] with N ≥ 1, got {list(tensor.shape)}")
        texts = []
        for i, raw in enumerate(tensor.data.reshape(-1)):
            try:
                texts.append(raw.decode("utf-8"))
            except UnicodeDecodeError as exc:
                raise ValidationError(f"input 'text' element {i} is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
        if self._check_text_ids:  # the tokenizer can give ids the model has no rows for
            try:
                inputs = self.workload.collate(texts)
            except Exception:  # noqa: BLE001 - it fails again in `execute`, which answers for it
                inputs = None
            if inputs is not None:
                self._check_limits(tuple(inputs), [f"model input {i} (tokenized)" for i in range(len(inputs))],
                                   "input 'text' element")
        return TextPayload(texts, self._token_counts(texts))

    def _validate_tensor(self, tensor: Tensor, spec: TensorSpec) -> torch.Tensor:
        if tensor.datatype != spec.datatype:
            raise ValidationError(f"input {spec.name!r} must be {spec.datatype}, got {tensor.datatype}")
        row = spec.shape[1:]
        if len(tensor.shape) != len(spec.shape) or tensor.shape[0] < 1 or \
                any(want not in (-1, got) or got < 1 for want, got in zip(row, tensor.shape[1:])):
            sizes = ", ".join("any ≥ 1" if n == -1 else str(n) for n in row)
            raise ValidationError(f"input {spec.name!r} must have shape [N, {sizes}] with N ≥ 1, got {list(tensor.shape)}")
        return torch.from_numpy(np.ascontiguousarray(tensor.data, dtype=DATATYPES[spec.datatype]))

    # -- BatchModel ----------------------------------------------------------------------------------

    def rows(self, payload) -> int:
        return len(payload.texts) if isinstance(payload, TextPayload) else payload[0].shape[0]

    def length(self, payload) -> int:
        """Longest row in tokens (text), the bucketing key; 0 for fixed-shape tensors."""
        return max(payload.lengths) if isinstance(payload, TextPayload) else 0

    def slice(self, payload, start: int, stop: int):
        if isinstance(payload, TextPayload):
            return TextPayload(payload.texts[start:stop], payload.lengths[start:stop])
        return tuple(t[start:stop] for t in payload)

    def concat(self, results: list[np.ndarray]) -> np.ndarray:
        return np.concatenate(results)

    @torch.inference_mode()
    def execute(self, payloads: list, instance: int) -> list[np.ndarray]:
        """Run one batch: collate (pad text to the batch's longest row, with masks), run, split
        the FP32 output [rows, ...] back per payload."""
        model, device = self.models[instance % len(self.models)], self.devices[instance % len(self.devices)]
        sizes = [self.rows(p) for p in payloads]
        if isinstance(payloads[0], TextPayload):
            texts = [t for p in payloads for t in p.texts]
            groups = self._groups([n for p in payloads for n in p.lengths])

            def inputs_of(group: list[int]) -> tuple:
                return self._text_inputs([texts[i] for i in group])
        else:
            inputs = self.concat_payloads(payloads)
            groups = self._groups([0] * inputs[0].shape[0])

            def inputs_of(group: list[int]) -> tuple:
                return inputs if len(groups) == 1 else tuple(t[group] for t in inputs)
        if len(groups) == 1:
            output = self._call(model, device, inputs_of(groups[0]), sum(sizes))
        else:  # rows that may not share a call: one call per group, the rows put back in order
            parts = [self._call(model, device, inputs_of(group), len(group)) for group in groups]
            output = np.empty((sum(sizes), *parts[0].shape[1:]), dtype=np.float32)
            for group, part in zip(groups, parts):
                output[group] = part
        return np.split(output, np.cumsum(sizes)[:-1])

    def _groups(self, lengths: list[int]) -> list[list[int]]:
        """The rows of a batch (by their token counts) that may share a model call: all of them, or those of
        one length each for a model whose answer depends on padding, or each alone where it depends on
        its batch-mates."""
        if self.dependence is not None and self.dependence.kind == BATCH_MATES:
            return [[i] for i in range(len(lengths))]
        if self.workload.equal_lengths_only:
            groups: dict[int, list[int]] = {}
            for i, n in enumerate(lengths):
                groups.setdefault(n, []).append(i)
            return list(groups.values())
        return [list(range(len(lengths)))]

    def _text_inputs(self, texts: list[str]) -> tuple:
        """Texts collated (tokenized, padded to the longest with masks), filled up with copies of the
        first for a model that takes one batch size only."""
        return self.workload.collate(texts + texts[:1] * ((self.fixed_batch_size or len(texts)) - len(texts)))

    def _call(self, model: nn.Module, device: torch.device, inputs: tuple, rows: int) -> np.ndarray:
        """One model call on `inputs` holding `rows` rows (a model that takes one batch size gets them filled up
        with copies of the first): the float32 output of those rows [rows, ...], owned."""
        pad = (self.fixed_batch_size or inputs[0].shape[0]) - inputs[0].shape[0]
        if pad > 0:
            inputs = tuple(torch.cat([t, t[:1].expand(pad, *t.shape[1:])]) for t in inputs)
        output = model(*to_device(inputs, device))
        self._check_recompiles(inputs)
        size = inputs[0].shape[0]
        if self._graphs_seen is not None and size not in self._warm_sizes:  # warm from now on
            self._warm_sizes.add(size)
            if self.on_cold_batch is not None:
                self.on_cold_batch()
        if not isinstance(output, torch.Tensor) or output.dim() == 0 or output.shape[0] != size:
            shape = list(output.shape) if isinstance(output, torch.Tensor) else type(output).__name__
            raise ValueError(f"the model returned {shape} for a batch of {rows} rows; expected [rows, ...]")
        return owned_host_float32(output[:rows]).numpy()  # responses are encoded after the next call
