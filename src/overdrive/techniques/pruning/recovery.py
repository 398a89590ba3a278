"""Prune → check → recover: the flow every structural pruning technique shares.

A pruning technique subclasses `PruningTechnique` and implements two methods:
`prune(model, config, ...)` removes structure in place (channels, heads, FFN width), and
`shrink_to(model, state_dict)` reshapes an unpruned model's layers to the shapes in a pruned
state dict (so pruned weights can be loaded back into the original architecture).

`apply` then does, in order:
1. records parameters, FLOPs per sample and the metric of the incoming model;
2. prunes, and checks that the model still runs and returns outputs of the original shape
   (RuntimeError otherwise: the tuner reports it and keeps the model unpruned);
3. measures the metric right after pruning;
4. recovers with a short fine-tune on the workload's training data (`overdrive.train.fine_tune`:
   cross-entropy with labels, else distillation toward the unpruned model);
5. measures the metric after recovery and keeps the better of the weights before and after it,
   judged on the workload's task metric when it has one, else its fidelity figure (a fine-tune
   that lowers it is undone, and the report says so: `judge_recovery`);
6. attaches the whole report to the model as `overdrive_report` (`plan.build` collects it for
   the table).

Pruning plus fine-tuning takes seconds to minutes, and the tuner builds the same candidate
several times (alone, composed, batch-size sweep), so the recovered weights are kept in a
small in-process cache keyed by the technique, workload, device, config and the incoming
weights. `optimize` writes them to a checkpoint next to the plan (`config.checkpoint`), which
`apply` loads instead of pruning again, so `bench`, `serve` and `run` reuse the same model.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from overdrive.core.workload import Workload
from overdrive.techniques.registry import Stage, Technique, TechniqueConfig
from overdrive.train.fine_tune import fine_tune
from overdrive.train.objective import frozen_copy

EVAL_SAMPLES = 512  # evaluation samples for the metric before / after pruning / after recovery
_CACHE_SIZE = 6
CHECKPOINT_FORMAT = "overdrive-pruned/1"
_CACHE: OrderedDict[tuple, tuple[dict[str, torch.Tensor], dict[str, Any]]] = OrderedDict()


@dataclass(frozen=True, kw_only=True)
class PruningConfig(TechniqueConfig):
    """Fields every pruning technique has.

    Attributes:
        finetune_steps: optimizer steps of recovery fine-tuning; 0 skips recovery.
        learning_rate: peak learning rate of the fine-tune; None: 1e-3 with labels
            (cross-entropy), 5e-4 for distillation.
        finetune_batch_size: training rows per step.
        checkpoint: a file of pruned, recovered weights (written by `optimize` next to the
            plan); when set, `apply` reshapes the model to it and loads it instead of pruning.
    """

    finetune_steps: int = 300
    learning_rate: float | None = None
    finetune_batch_size: int = 32
    checkpoint: str | None = None

    def __post_init__(self):
        if self.finetune_steps < 0:
            raise ValueError(f"{type(self).__name__}.finetune_steps must be ≥ 0, got {self.finetune_steps}")
        if self.learning_rate is not None and not self.learning_rate > 0:
            raise ValueError(f"{type(self).__name__}.learning_rate must be > 0, got {self.learning_rate}")
        if self.finetune_batch_size < 1:
            raise ValueError(f"{type(self).__name__}.finetune_batch_size must be ≥ 1, got {self.finetune_batch_size}")


def _number(value: float | None) -> str:
    return "–" if value is None else f"{value:.4f}" if abs(value) < 10 else f"{value:.2f}"


def num_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def example_inputs(workload: Workload, device: torch.device, n: int = 2) -> tuple[torch.Tensor, ...]:
    return tuple(t.to(device) for t in workload.collate(list(workload.samples[:n])))


def fingerprint(model: nn.Module) -> tuple:
    """Names, shapes and checksums of the state: equal for equal weights (cache key)."""
    with torch.no_grad():
        return tuple((name, tuple(t.shape), round(float(t.double().sum()), 6), round(float(t.double().abs().sum()), 6))
                     for name, t in model.state_dict().items())


def evaluate(model: nn.Module, workload: Workload, device: torch.device,
             reference: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Outputs on the first EVAL_SAMPLES evaluation samples, and their figures.

    Returns:
        (float32 outputs [N, ...] on the CPU, {fidelity figures vs `reference`, task metric}).
    """
    from overdrive.core.memory import owned_host_float32  # not at import: core.measure imports the technique registry

    n = len(workload.samples) if workload.metric is not None else min(len(workload.samples), EVAL_SAMPLES)  # a metric scores all
    outputs = []
    with torch.no_grad():
        for start in range(0, n, workload.default_batch_size):
            batch = [workload.samples[i] for i in range(start, min(n, start + workload.default_batch_size))]
            outputs.append(owned_host_float32(model(*(t.to(device) for t in workload.collate(batch)))))
    out = torch.cat(outputs)
    figures: dict[str, float] = {}
    if reference is not None:
        figures.update(workload.fidelity(out, reference))
    if workload.has_task_metric:
        figures.update(workload.task_metric(out, range(n)))
    return out, figures


def importance_gradients(model: nn.Module, workload: Workload, device: torch.device, *, batches: int = 4,
                         batch_size: int = 32) -> None:
    """Accumulate ∂loss/∂weight on training batches for first-order Taylor importance
    (Molchanov et al., "Importance Estimation for Neural Network Pruning", CVPR 2019).

    Raises:
        ValueError: the workload has no labelled training samples (the Taylor criterion needs a task loss).
    """
    if not workload.train_samples or workload.train_labels is None:
        raise ValueError("taylor importance needs labelled training samples (a task loss); use l1 or l2 here")
    model.zero_grad(set_to_none=True)
    generator = torch.Generator().manual_seed(0)
    order = torch.randperm(len(workload.train_samples), generator=generator).tolist()
    for b in range(batches):
        idx = order[b * batch_size:(b + 1) * batch_size]
        if not idx:
            break
        inputs = tuple(t.to(device) for t in workload.collate([workload.train_samples[i] for i in idx]))
        nn.functional.cross_entropy(model(*inputs), workload.train_labels[idx].to(device)).backward()


def _figure(figures: dict[str, float], key: str) -> float:
    value = figures.get(key, math.nan)
    return value if value == value else -math.inf  # NaN (a diverged fine-tune) is the worst


def judge_recovery(after_pruning: dict[str, float], after_recovery: dict[str, float], workload: Workload) -> dict[str, Any]:
    """Whether the recovery fine-tune's weights are kept: only when they are not worse than the
    weights before it on the figure the workload is judged by: its task metric when it has one
    (ties go to its fidelity figure), else its fidelity figure (`fidelity_key`).

    Returns:
        {"kept": bool, "figure": the deciding figure, "before": its value right after pruning,
        "after": its value after recovery}.
    """
    keys = ([workload.task_metric_name] if workload.has_task_metric else []) + [workload.fidelity_key]
    keys = [k for k in keys if k in after_pruning or k in after_recovery]
    decided = keys[0] if keys else workload.fidelity_key
    kept = True
    for key in keys:
        before, after = _figure(after_pruning, key), _figure(after_recovery, key)
        if after != before:
            decided, kept = key, after > before
            break
    return {"kept": kept, "figure": decided, "before": after_pruning.get(decided), "after": after_recovery.get(decided)}


def default_learning_rate(workload: Workload) -> float:
    return 1e-3 if workload.train_labels is not None else 5e-4


class PruningTechnique(Technique):
    """Base of structural pruning techniques: opt-in, lossy until recovered, rewrites modules."""
    setup_cost = "train"  # `tuning.budget`: what building it costs before its first timed pass

    exportable = True  # survives export to ONNX / OpenVINO
    stage = Stage.PRUNE
    lossless = False
    opt_in = True
    rewrites_modules = True
    group = None
    shrinks_layers: bool = True  # False: weights are zeroed in place (unstructured), shapes stay

    def distillation_hints(self, model: nn.Module, teacher: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
        """(student, teacher) module pairs whose outputs distillation also matches (none by default)."""
        return []

    def finalize(self, model: nn.Module) -> dict[str, Any] | None:
        """After recovery: make the pruning permanent (e.g. remove re-masking hooks); may return
        figures for the report."""

    def prune(self, model: nn.Module, config: TechniqueConfig, *, workload: Workload,
              device: torch.device) -> dict[str, Any] | None:
        """Remove structure in place; may return notes for the report (layers left alone).
        Raises RuntimeError (said plainly) when it cannot."""
        raise NotImplementedError

    def shrink_to(self, model: nn.Module, state: dict[str, torch.Tensor], *, workload: Workload,
                  device: torch.device) -> None:
        """Reshape `model`'s pruned layers to the shapes in `state` (any kept indices; the
        weights are loaded afterwards)."""
        raise NotImplementedError

    def check_files(self, step):
        if step.checkpoint:
            load_checkpoint(step.checkpoint, step.name)

    def resolve(self, step, before, *, workload, device, folder):
        """The step with `checkpoint` set to its pruned, recovered weights, written to `folder/<technique>.pt`."""
        if step.checkpoint:
            return step
        from overdrive.techniques.compose import build

        model, _ = build(workload, before + [step], device)  # cached: reshapes and loads, no new fine-tune
        path = Path(folder) / f"{step.name}.pt"
        save_checkpoint(model, path, step.name)
        return dataclasses.replace(step, checkpoint=str(path))

    def describe_report(self, report: dict[str, Any], fidelity_key: str) -> str:
        """One line: the structure before → after (`report_parts`), then the metric before, right
        after pruning and after recovery, with the fine-tune's steps, learning rate and time."""
        if "params_before" not in report:
            return f"{self.name}: weights loaded from {report.get('source', 'cache')}"

        def metric(figures: dict[str, float] | None) -> str:
            if not figures:
                return "–"
            if "accuracy_pct" in figures or "metric" in figures:
                task = (f"accuracy {figures['accuracy_pct']:.2f}%" if "accuracy_pct" in figures
                        else f"metric {figures['metric']:.4g}")
                return task + (f" ({fidelity_key} {figures[fidelity_key]:.4f})" if fidelity_key in figures else "")
            return ", ".join(f"{k} {figures[k]:.4f}" for k in (fidelity_key, "mean_cosine") if k in figures)

        parts = self.report_parts(report)
        if report["before"]:
            parts.append(f"before: {metric(report['before'])}")
        parts.append(f"after pruning: {metric(report['after_pruning'])}")
        if report.get("fine_tune"):
            ft = report["fine_tune"]
            parts.append(f"after recovery: {metric(report['after_recovery'])} ({ft['steps']} steps, lr {ft['learning_rate']:g}, "
                         f"{ft['precision']}, {ft['seconds']:.1f} s)")
            verdict = report.get("recovery")
            if verdict:
                figure, before, after = verdict["figure"], _number(verdict["before"]), _number(verdict["after"])
                if not verdict["kept"]:
                    parts.append(f"recovery lowered {figure} {before} → {after}; kept the weights before recovery")
                elif before == after:
                    parts.append(f"recovery left {figure} at {after}; kept the recovered weights")
                else:
                    parts.append(f"recovery raised {figure} {before} → {after}; kept the recovered weights")
        else:
            parts.append(report.get("fine_tune_skipped", "no recovery fine-tune"))
        return f"{self.name}: " + "; ".join(parts)

    def report_parts(self, report: dict[str, Any]) -> list[str]:
        """The structure part of the report line: importance, parameters and FLOPs before → after,
        and the layers left alone."""
        parts = [f"params {report['params_before']:,} → {report['params_after']:,} "
                 f"({report['params_after'] / report['params_before']:.2f}×)"]
        if report.get("importance"):
            parts.insert(0, f"{report['importance']} importance")
        fb, fa = report.get("flops_per_sample_before"), report.get("flops_per_sample_after")
        if fb and fa:
            parts.append(f"FLOPs/sample {fb / 1e6:,.2f} → {fa / 1e6:,.2f} M ({fa / fb:.2f}×)")
        if report.get("left_unpruned"):
            parts.append("left unpruned: " + ", ".join(f"{name} ({why})" for name, why in report["left_unpruned"].items()))
        return parts

    def apply(self, model, config, *, workload, device):
        if config.checkpoint:
            state = load_checkpoint(config.checkpoint, self.name, device)
            before = num_parameters(model)
            model = self._load(model, state, {"technique": self.name, "source": f"checkpoint {config.checkpoint}"},
                               workload=workload, device=device)
            if self.shrinks_layers and num_parameters(model) >= before:
                raise RuntimeError(f"{self.name}: checkpoint {config.checkpoint} holds no pruned layer: its weights "
                                   "have the unpruned shapes")
            return model
        key = (self.name, workload.name, id(workload), device.type, dataclasses.replace(config, checkpoint=None),
               fingerprint(model))
        if key in _CACHE:
            _CACHE.move_to_end(key)
            state, report = _CACHE[key]
            return self._load(model, {k: v.to(device) for k, v in state.items()}, report, workload=workload, device=device)
        report = self._prune_and_recover(model, config, workload=workload, device=device)
        _CACHE[key] = ({k: v.detach().cpu().clone() for k, v in model.state_dict().items()}, report)
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
        model.overdrive_report = copy.deepcopy(report)
        return model

    def _load(self, model: nn.Module, state: dict[str, torch.Tensor], report: dict[str, Any], *, workload: Workload,
              device: torch.device) -> nn.Module:
        try:
            self.shrink_to(model, state, workload=workload, device=device)
            model.load_state_dict(state)
        except (RuntimeError, KeyError, ValueError) as exc:
            detail = " ".join(str(exc).split())
            raise RuntimeError(f"{self.name}: the saved pruned weights do not fit this model: "
                               f"{detail[:300]}{'…' if len(detail) > 300 else ''}") from None
        model.eval()
        model.overdrive_report = copy.deepcopy(report)
        return model

    def _prune_and_recover(self, model: nn.Module, config: PruningConfig, *, workload: Workload,
                           device: torch.device) -> dict[str, Any]:
        from overdrive.core.flops import count_flops_per_sample

        flop_indices = list(range(min(len(workload.samples), workload.default_batch_size)))
        # The teacher and the reference are the workload's own unmodified model, also when an
        # earlier pruning step already changed `model`: recovery then pulls toward the model the
        # guard judges against, instead of compounding each step's error.
        teacher = frozen_copy(workload.model).to(device)
        reference, _ = evaluate(teacher, workload, device)
        _, before = evaluate(model, workload, device, reference)
        report: dict[str, Any] = {
            "technique": self.name,
            "params_before": num_parameters(model),
            "flops_per_sample_before": count_flops_per_sample(model, workload, device=device, indices=flop_indices),
            "before": before,
        }
        start = time.perf_counter()
        report.update(self.prune(model, config, workload=workload, device=device) or {})
        model.eval()
        report["prune_s"] = time.perf_counter() - start
        example = example_inputs(workload, device)
        with torch.no_grad():
            shape, expected = tuple(model(*example).shape), tuple(teacher(*example).shape)
        if shape != expected:  # the guard: same output shapes, or no pruning
            raise RuntimeError(f"{self.name}: the pruned model returns shape {shape}, expected {expected}")
        report["params_after"] = num_parameters(model)
        if self.shrinks_layers and report["params_after"] >= report["params_before"]:
            raise RuntimeError(f"{self.name}: nothing could be pruned at ratio {getattr(config, 'ratio', '?')}: the kept "
                               "width rounds back up to the full width, or every prunable layer is coupled to a kept one")
        report["flops_per_sample_after"] = count_flops_per_sample(model, workload, device=device, indices=flop_indices)
        report["after_pruning"] = evaluate(model, workload, device, reference)[1]
        report["fine_tune"] = None
        report["after_recovery"] = None
        if config.finetune_steps and not workload.train_samples:
            report["fine_tune_skipped"] = f"workload {workload.name!r} has no training samples: no recovery"
        elif config.finetune_steps:
            lr = config.learning_rate or default_learning_rate(workload)
            pruned_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            ft = fine_tune(model, workload, device=device, steps=config.finetune_steps, learning_rate=lr,
                           batch_size=config.finetune_batch_size, teacher=teacher,
                           hints=self.distillation_hints(model, teacher))
            report["fine_tune"] = ft.to_dict()
            report["after_recovery"] = evaluate(model, workload, device, reference)[1]
            report["recovery"] = judge_recovery(report["after_pruning"], report["after_recovery"], workload)
            if not report["recovery"]["kept"]:  # the fine-tune made it worse: the weights before it are the result
                model.load_state_dict(pruned_state)
        kept_recovery = report["after_recovery"] is not None and report["recovery"]["kept"]
        report["final"] = report["after_recovery"] if kept_recovery else report["after_pruning"]  # the returned weights'
        report.update(self.finalize(model) or {})
        del teacher
        return report


def save_checkpoint(model: nn.Module, path: Path, technique: str) -> None:
    """Write the (pruned) model's state dict for `PruningConfig.checkpoint`, tagged with the
    technique that produced it: {"format": "overdrive-pruned/1", "technique", "state_dict"}."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    torch.save({"format": CHECKPOINT_FORMAT, "technique": technique, "state_dict": state}, tmp)
    tmp.replace(path)


def load_checkpoint(path: str | Path, technique: str, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """The state dict in a checkpoint written by `save_checkpoint` for `technique`.

    Raises:
        RuntimeError: the file is missing, unreadable, not an overdrive pruning checkpoint, or
            made by another technique (the message names the file and says which).
    """
    try:
        data = torch.load(path, map_location=device, weights_only=True)
    except FileNotFoundError:
        raise RuntimeError(f"{technique}: checkpoint {path} does not exist") from None
    except Exception as exc:  # noqa: BLE001 - unpickling raises many types; all mean "not readable"
        raise RuntimeError(f"{technique}: checkpoint {path} cannot be read as a torch file "
                           f"({type(exc).__name__}: {' '.join(str(exc).split())[:120]})") from None
    if not isinstance(data, dict) or data.get("format") != CHECKPOINT_FORMAT:
        raise RuntimeError(f"{technique}: {path} is not a checkpoint written by `overdrive optimize`")
    if data.get("technique") != technique:
        raise RuntimeError(f"{technique}: checkpoint {path} was written by {data.get('technique')!r}, not {technique!r}")
    return data["state_dict"]
