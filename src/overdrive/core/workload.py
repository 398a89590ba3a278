"""The Workload: a model plus the real samples, batching and metrics that judge it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

Inputs = tuple[torch.Tensor, ...]

# Where a workload's evaluation rows come from, and how the table says it.
ROWS_SOURCES = {
    "samples": "fidelity on the workload's {n} real sample{s}",
    "data": "fidelity on your data ({n} row{s})",
    "example": "fidelity on the {n} row{s} of your example input (pass data for more)",
    "random": "fidelity on random inputs: shape only ({n} seeded row{s} of the example's shape; not your accuracy)",
}


PADDING = "padding"  # BatchDependence kinds
BATCH_MATES = "batch-mates"


@dataclass(frozen=True, kw_only=True)
class BatchDependence:
    """How a model's answer for a row depends on the rows batched with it, measured on its fp32 model
    (`overdrive.core.row_dependence`).

    Attributes:
        kind: PADDING: a row padded to a longer batch-mate's length gets another answer, and rows of
            one length may share a batch (none is padded); BATCH_MATES: a row's answer changes beside
            other rows even where nothing is padded, so each row runs alone.
        detail: what was measured, e.g. "cosine 0.879 between a row alone and the same row padded
            next to a longer one".
    """

    kind: str
    detail: str

    def __post_init__(self):
        if self.kind not in (PADDING, BATCH_MATES):
            raise ValueError(f"BatchDependence.kind {self.kind!r}: expected {PADDING!r} or {BATCH_MATES!r}")

    def to_dict(self) -> dict[str, str]:
        return {"kind": self.kind, "detail": self.detail}

    @classmethod
    def from_dict(cls, data: dict[str, str]) -> BatchDependence:
        return cls(kind=data["kind"], detail=data["detail"])

    def describe(self) -> str:
        """What run, serve and optimize say about it: the dependence, and how rows are batched for it."""
        if self.kind == PADDING:
            return (f"the model's answer for a row depends on its padding ({self.detail}): rows are batched only with "
                    "rows of the same token length, so none is padded")
        return f"the model's answer for a row depends on its batch-mates ({self.detail}): each row runs alone"


@dataclass(kw_only=True)
class Workload:
    """A model with the data that measures it.

    Attributes:
        name: registry or user name, used for the output folder.
        model: fp32 module in eval mode on the CPU; `model(*inputs)` returns one tensor
            whose first dimension is the batch, e.g. embeddings [B, 384] or logits [B, C].
        samples: the evaluation samples, in a fixed order (sentences, image tensors [C, H, W]).
        collate: turns a list of samples into the model's positional inputs (padding, masks).
        fidelity: `fidelity(output, reference) -> {figure: value}`; both [N, ...] float32 in
            sample order; higher is better for `fidelity_key`.
        fidelity_key: the figure the `min_fidelity` floor applies to.
        default_batch_size: rows per batch when the user gives none.
        labels: int64 [N] class labels aligned with `samples`: the task metric is top-1 accuracy (%).
        metric: another task metric, `metric(outputs) -> float` on the outputs of all samples
            (float32 [N, ...] in sample order), higher is better, in its own units (points);
            used when there are no labels.
        train_samples: samples for fine-tuning (pruning's recovery, `train`), disjoint from
            `samples`; None when the workload has no training data.
        train_labels: int64 [M] labels of `train_samples` (classification); None means the
            objective is distillation toward the unmodified model's outputs.
        sample_length: token count of a sample, for length bucketing (text workloads only).
        row_length: for tensor rows with `dynamic_dims`: a row's size along its first varying
            dimension (the real token count of a right-padded row cut at its attention mask), for
            length bucketing; None otherwise.
        input_names: the keyword of each of the model's positional inputs (a Hugging Face model's
            `input_ids`, `attention_mask`), as the user's model takes them; None: unnamed.
        output_names: the paths of the user's model outputs the model returns (`logits`, or several
            flattened per row and concatenated; `overdrive.workloads.signature`); None: its one tensor.
        dynamic_dims: input index -> the dimensions of that input (of the batched tensor, ≥ 1) whose
            size varies from row to row (a sequence length); rows are zero-padded to the batch's
            largest there (`pad_stack`), which leaves the model's answers unchanged (checked when
            the workload is built). Empty: every row has the example's shape.
        fixed_batch_size: the only batch size the model accepts (e.g. a torch.export program
            exported without a dynamic batch dimension); None when any batch size works.
        batch_dependence: how the model's answer for a row depends on the rows batched with it, when
            it does (measured: `overdrive.core.row_dependence`); None when it was found not to, or not
            checked yet (`row_dependence.checked_dependence`).
        real_weights: False for random weights: speed figures only, no accuracy claims.
        rows_source: where `samples` come from, which says what fidelity on them means (see
            `ROWS_SOURCES`): "samples" (the workload's own real samples), "data" (rows the user
            passed), "example" (the rows of the user's example batch), "random" (seeded random rows
            of the example's shape and dtype: fidelity on them is not the user's accuracy).
        notes: what overdrive changed or found about the model while building the workload (e.g.
            training-mode ops switched to eval mode), shown with the results.
        description: one line for `overdrive list`.
        extra: workload-specific objects (tokenizer, training split, model path). Read by
            `overdrive run`: "image_transform" (PIL image -> sample tensor, picklable) and
            "classifier" (True: outputs are logits, and outputs get a `prediction` column),
            "normalize_embeddings" (True: output rows are L2-normalised before they are written).
    """

    name: str
    model: nn.Module
    samples: Sequence[Any]
    collate: Callable[[list[Any]], Inputs]
    fidelity: Callable[[torch.Tensor, torch.Tensor], dict[str, float]]
    fidelity_key: str
    default_batch_size: int
    labels: torch.Tensor | None = None
    metric: Callable[[torch.Tensor], float] | None = None
    train_samples: Sequence[Any] | None = None
    train_labels: torch.Tensor | None = None
    sample_length: Callable[[Any], int] | None = None
    row_length: Callable[[Any], int] | None = None
    input_names: list[str] | None = None
    output_names: list[str] | None = None
    dynamic_dims: dict[int, tuple[int, ...]] = field(default_factory=dict)
    fixed_batch_size: int | None = None
    batch_dependence: BatchDependence | None = None
    real_weights: bool = True
    rows_source: str = "samples"
    notes: list[str] = field(default_factory=list)
    description: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if self.rows_source not in ROWS_SOURCES:
            raise ValueError(f"rows_source {self.rows_source!r}: expected one of {', '.join(ROWS_SOURCES)}")

    def describe_rows(self, num_rows: int | None = None) -> str:
        """What the evaluation rows are, for the table's caption: e.g. "fidelity on your data (300 rows)"."""
        n = len(self.samples) if num_rows is None else num_rows
        return ROWS_SOURCES[self.rows_source].format(n=n, s="" if n == 1 else "s")

    @property
    def has_task_metric(self) -> bool:
        return self.labels is not None or self.metric is not None

    @property
    def task_metric_name(self) -> str:
        """The key of the task metric in `task_metric`'s result: "accuracy_pct" (labels) or "metric"."""
        return "accuracy_pct" if self.labels is not None else "metric"

    @property
    def is_torchscript(self) -> bool:
        return isinstance(self.model, torch.jit.ScriptModule)

    @property
    def is_text(self) -> bool:
        return self.sample_length is not None

    @property
    def equal_lengths_only(self) -> bool:
        """Whether batches may hold only rows of one length (a text model whose answer depends on padding)."""
        return self.is_text and self.batch_dependence is not None and self.batch_dependence.kind == PADDING

    @property
    def bucket_length(self) -> Callable[[Any], int] | None:
        """How long a sample is, for length bucketing: its token count (text) or its size along the
        varying dimension (tensor rows with `dynamic_dims`); None when every row has one shape."""
        return self.sample_length or self.row_length

    @property
    def has_conv(self) -> bool:
        return any(isinstance(m, nn.modules.conv._ConvNd) for m in self.model.modules())

    def task_metric(self, output: torch.Tensor, indices: Sequence[int] | None = None) -> dict[str, float]:
        """The task metric of `output` [N, ...], the outputs of samples `indices` (default: all, in
        order): {"accuracy_pct": top-1 accuracy of logits against the labels}, or {"metric": the
        workload's `metric` on the outputs of every sample, in sample order}.

        Raises:
            ValueError: the workload has no task metric, or `metric` is asked about a subset of samples.
        """
        if self.labels is None and self.metric is None:
            raise ValueError(f"workload {self.name!r} has no task metric")
        if self.labels is None:
            positions = {}
            for position, index in enumerate(range(len(output)) if indices is None else indices):
                positions.setdefault(index, position)
            if set(positions) != set(range(len(self.samples))):
                raise ValueError(f"workload {self.name!r}: its metric scores all {len(self.samples)} samples, not "
                                 f"{len(positions)} of them")
            return {"metric": float(self.metric(output[[positions[i] for i in range(len(self.samples))]]))}
        labels = self.labels if indices is None else self.labels[list(indices)]
        correct = (output.argmax(dim=-1).cpu() == labels).float().mean().item()
        return {"accuracy_pct": 100.0 * correct}


def warm_up_rows(rows: Sequence[Any], size: int, *, equal_lengths_only: bool = False) -> list[list[Any]]:
    """The batches of `size` rows a job warms a model up with before its records run (`run`, `serve`, and
    `optimize` measuring what they will see): `size` rows around the middle of `rows` (sorted by length
    for text: lengths that differ, padded to the longest), and the middle row `size` times (nothing
    padded). A compiled model may take another path for each (remove-padding skips its packing when no
    row is padded), each a graph of its own to build before the records run, not in the middle of them.
    A model that must not see padding (`equal_lengths_only`) gets the second only."""
    mid = max(0, len(rows) // 2 - size // 2)
    mixed = [rows[(mid + j) % len(rows)] for j in range(size)]
    same = [rows[len(rows) // 2]] * size
    return [same] if equal_lengths_only or size == 1 else [mixed, same]


def equal_length_batches(order: Sequence[int], length: Callable[[int], int], batch_size: int) -> list[list[int]]:
    """`order` cut into batches of at most `batch_size` whose rows all have one `length(row)`, so that
    collating a batch pads none of them: longest first, ties in `order`'s order."""
    batches: list[list[int]] = []
    last = None
    for row, n in sorted(((row, length(row)) for row in order), key=lambda pair: -pair[1]):
        if batches and n == last and len(batches[-1]) < batch_size:
            batches[-1].append(row)
        else:
            batches.append([row])
        last = n
    return batches


def row_size_problem(dims: dict[int, tuple[int, ...]], row: tuple[torch.Tensor, ...],
                     max_size: int | None = None, names: list[str] | None = None) -> str | None:
    """Why one row (a tensor per input, without the batch dimension) cannot be padded with others,
    or None: inputs that vary at one dimension must have one size there (input_ids and its
    attention_mask), of at least 1 and at most `max_size` (a model's max_position_embeddings)."""
    for d in sorted({d for ds in dims.values() for d in ds}):
        sizes = [(i, row[i].shape[d - 1]) for i, ds in sorted(dims.items()) if d in ds and row[i].dim() >= d]
        name = (lambda i: repr(names[i]) if names else f"input {i}")
        if len({n for _, n in sizes}) > 1:
            return (f"inputs {', '.join(name(i) for i, _ in sizes)} must have one size at dimension {d} (they vary "
                    f"together); got {', '.join(f'{name(i)}: {n}' for i, n in sizes)}")
        if sizes and sizes[0][1] < 1:
            return f"input {name(sizes[0][0])} has size 0 at dimension {d}; expected at least 1"
        if sizes and max_size and sizes[0][1] > max_size:
            return (f"input {name(sizes[0][0])} has size {sizes[0][1]} at dimension {d}; the model takes at most "
                    f"{max_size} (its max_position_embeddings)")
    return None


def pad_stack(dims: dict[int, tuple[int, ...]], rows: list[tuple[torch.Tensor, ...]],
              max_size: int | None = None) -> tuple[torch.Tensor, ...]:
    """Samples that are tuples of row tensors -> the model's inputs [B, ...]; input i is zero-padded
    at the end of its dimensions `dims[i]` (of the batched tensor, ≥ 1) to the batch's largest.
    A zero in an attention mask marks a pad, and 0 is the pad id of BERT-family vocabularies.

    Raises:
        ValueError: a row whose inputs cannot be padded (`row_size_problem`): a mask shorter than its
            ids would otherwise be padded into a different answer without a word.
    """
    for r, row in enumerate(rows):
        problem = row_size_problem(dims, row, max_size)
        if problem:
            raise ValueError(f"row {r}: {problem}")
    columns = []
    for i, column in enumerate(zip(*rows)):
        padded_dims = dims.get(i, ())
        if padded_dims:
            size = [max(r.shape[d - 1] for r in column) if d in padded_dims else s
                    for d, s in enumerate(column[0].shape, start=1)]
            out = column[0].new_zeros((len(column), *size))
            for b, r in enumerate(column):
                out[(b, *(slice(0, n) for n in r.shape))] = r
            columns.append(out)
        else:
            columns.append(torch.stack(column))
    return tuple(columns)


def pad_token_ids(rows: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad token-id lists to the longest: (input_ids, attention_mask), both int64 [B, S]."""
    length = max(len(r) for r in rows)
    ids = torch.full((len(rows), length), pad_id, dtype=torch.int64)
    mask = torch.zeros(len(rows), length, dtype=torch.int64)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.int64)
        mask[i, : len(r)] = 1
    return ids, mask


def eval_mode(model: nn.Module) -> nn.Module:
    """`model.eval()`, except for modules that refuse it (torch.export's `.module()` raises
    NotImplementedError; its graph is already fixed in the mode it was exported in)."""
    try:
        return model.eval()
    except NotImplementedError:
        return model


def explained_variance(output: torch.Tensor, reference: torch.Tensor) -> float | None:
    """R², the coefficient of determination of `output` against `reference` (both [N, ...]):
    1 − Σ(output − reference)² / Σ(reference − its per-column mean over rows)².

    Cosine per row cannot see an error that is small next to what all rows share: logits on a
    common offset of 500 whose bf16 rounding flips a third of the argmaxes, or a one-column
    regression output whose rows all become the same number, keep a cosine of 1. R² measures the
    error against how much the outputs vary from row to row, so it sees both. 1.0: identical.

    Returns:
        R², or None when the reference does not vary over rows (one row, or every row the same).
    """
    out = output.double().reshape(output.shape[0], -1)
    ref = reference.double().reshape(reference.shape[0], -1)
    spread = (ref - ref.mean(dim=0, keepdim=True)).pow(2).sum()
    if ref.shape[0] < 2 or not spread > 0:
        return None
    return float(1.0 - (out - ref).pow(2).sum() / spread)


def embedding_fidelity(output: torch.Tensor, reference: torch.Tensor, *, k: int = 10) -> dict[str, float]:
    """Agreement of sentence embeddings with the fp32 reference.

    Args:
        output: float [N, D] embeddings from the candidate.
        reference: float [N, D] embeddings from eager fp32.
        k: neighbours compared per row.

    Returns:
        min_cosine, mean_cosine: cosine similarity of each row to its reference row;
        top10_agreement: mean overlap fraction of each row's k nearest neighbours by cosine
        (self excluded) between candidate and reference (1.0 = identical retrieval);
        r2: `explained_variance` (absent when the reference rows do not vary).
        One value per row ([N] or [N, 1]) gives r2 and max_rel_error only: a cosine of one value is its sign.
    """
    if _one_wide(output):
        return _one_wide_fidelity(output, reference)
    out = nn.functional.normalize(output.float(), dim=-1)
    ref = nn.functional.normalize(reference.float(), dim=-1)
    cos = (out * ref).sum(dim=-1)
    result = {"min_cosine": cos.min().item(), "mean_cosine": cos.mean().item()}
    n = out.shape[0]
    k = min(k, n - 1)
    if k >= 1:
        eye = torch.eye(n, dtype=torch.bool)
        nn_out = (out @ out.T).masked_fill(eye, -2).topk(k, dim=-1).indices  # [N, k]
        nn_ref = (ref @ ref.T).masked_fill(eye, -2).topk(k, dim=-1).indices
        overlap = (nn_out.unsqueeze(-1) == nn_ref.unsqueeze(-2)).any(-1).float().sum(-1) / k
        result[f"top{k}_agreement"] = overlap.mean().item()
    return _with_r2(result, output, reference)


def _one_wide(output: torch.Tensor) -> bool:
    return output.dim() >= 1 and output.shape[0] > 0 and output[0].numel() == 1


def _one_wide_fidelity(output: torch.Tensor, reference: torch.Tensor) -> dict[str, float]:
    out, ref = output.float().reshape(-1), reference.float().reshape(-1)
    result = {"max_rel_error": ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()}
    return _with_r2(result, output, reference)


def judged_figure(widths) -> str:
    """The fidelity figure a workload whose judged outputs have `widths` values per row is guarded by:
    `min_cosine`, or `r2` when every output holds one value per row (a score, a regression target),
    where a row's cosine is only its sign."""
    return "r2" if widths and all(w == 1 for w in widths) else "min_cosine"


def _with_r2(result: dict[str, float], output: torch.Tensor, reference: torch.Tensor) -> dict[str, float]:
    r2 = explained_variance(output, reference)
    return result if r2 is None else {**result, "r2": r2}


def logits_fidelity(output: torch.Tensor, reference: torch.Tensor) -> dict[str, float]:
    """Agreement of classifier outputs with the fp32 reference.

    Args:
        output: float [N, C] (or [N, ...], flattened per row) from the candidate.
        reference: the same from eager fp32.

    Returns:
        top1_agreement: fraction of rows whose argmax matches the reference (for [N, C]);
        max_rel_error: max |output − reference| / max |reference|;
        min_cosine: the smallest per-row cosine similarity;
        r2: `explained_variance` (absent when the reference rows do not vary).
        One value per row ([N] or [N, 1]) gives r2 and max_rel_error only: a cosine of one value is its
        sign (−1 for a value near zero that rounding moved across it), and an argmax over one column is 0.
    """
    if _one_wide(output):
        return _one_wide_fidelity(output, reference)
    out = output.float().reshape(output.shape[0], -1)
    ref = reference.float().reshape(reference.shape[0], -1)
    result = {
        "top1_agreement": (out.argmax(-1) == ref.argmax(-1)).float().mean().item(),
        "max_rel_error": ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item(),
        "min_cosine": nn.functional.cosine_similarity(out, ref, dim=-1).min().item(),
    }
    return _with_r2(result, output, reference)


@dataclass(frozen=True, kw_only=True)
class BatchingPolicy:
    """How evaluation samples are grouped into batches.

    Attributes:
        sort_by_length: order samples by `workload.bucket_length` before cutting batches,
            so each batch pads to a similar length (length bucketing). Outputs are restored to
            the input order by the caller.
    """

    sort_by_length: bool = False

    @classmethod
    def deployed(cls, workload: Workload) -> BatchingPolicy:
        """How `run` and `serve` batch this workload's rows whatever the plan holds, which is what a
        plan is measured against: text sorted by token length (`run` sorts each chunk of records,
        `serve` batches requests of one length bucket), anything else in arrival order. Timing text
        in data order would credit the plan with padding that no deployment of it pads."""
        return cls(sort_by_length=workload.is_text)

    def order(self, workload: Workload, indices: list[int]) -> list[int]:
        """Positions 0..len(indices)-1 in the order they are cut into batches (indices may repeat)."""
        positions = list(range(len(indices)))
        length = workload.bucket_length
        if self.sort_by_length and length is not None:  # longest first, ties in order: as `run` cuts a chunk
            positions.sort(key=lambda p: -length(workload.samples[indices[p]]))
        return positions
