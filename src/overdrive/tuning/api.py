"""The Python API of the optimize flow: `optimize` (exported by `overdrive`; `load` and `bench`,
which use a plan once it is made, are in `overdrive.tuning.reuse`).

`optimize` is `OptimizeJob.prepare(...)` (every argument checked, the workload built, nothing
measured yet) followed by `job.run()` (baseline, each technique alone, composition, the
batch-size sweep); the command line uses the two halves to print its header in between.
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from overdrive.core.errors import ConfigError, arg
from overdrive.core.workload import Workload
from overdrive.core.digest import weights_fingerprint
from overdrive.techniques import TechniqueConfig, get_technique, list_techniques
from overdrive.tuning.sweep import Session, open_session, sweep
from overdrive.tuning.budget import DEFAULT_TIME_BUDGET_S, Budget, resolve_budget
from overdrive.tuning.guard import Guard
from overdrive.tuning.result import OptimizeResult, record_workload
from overdrive.tuning.tuner import Tuner

Progress = Callable[[str, int, int], None]  # (what is measured next, measurements done, expected in all)
SWEEP_MAX_ROWS = 256  # rows per pass of the report's latency-vs-batch-size curve (the plan's figures use every row)
BASELINE_LABEL = "baseline (eager fp32)"
PYTHON_MODEL_PREFIX = "<python "  # the workload of a plan made from a module passed in Python


def default_sweep(batch_size: int) -> list[int]:
    """The report's batch sizes: 1, B/4, B and 2B."""
    return sorted({1, max(1, batch_size // 4), batch_size, 2 * batch_size})


def pruning_configs(techniques: list[str] | None, *, prune_ratio: float | None = None,
                    finetune_steps: int | None = None) -> dict[str, TechniqueConfig]:
    """The configs of the named pruning techniques with `prune_ratio` / `finetune_steps` applied.

    Raises:
        ConfigError: an unknown technique, or a pruning option with no pruning technique named.
    """
    from overdrive.techniques.pruning.recovery import PruningTechnique

    for name in techniques or []:
        try:
            get_technique(name)
        except KeyError as exc:
            raise ConfigError(f"{arg('techniques')}: {exc.args[0]}") from None
    overrides = {k: v for k, v in {"ratio": prune_ratio, "finetune_steps": finetune_steps}.items() if v is not None}
    if not overrides:
        return {}
    pruning = [n for n in techniques or [] if isinstance(get_technique(n), PruningTechnique)]
    if not pruning:
        named = [arg({"ratio": "prune_ratio"}.get(k, k)) for k in overrides]
        known = ", ".join(t.name for t in list_techniques() if isinstance(t, PruningTechnique))
        raise ConfigError(f"{' and '.join(named)} appl{'y' if len(named) > 1 else 'ies'} to pruning techniques; "
                          f"name one in {arg('techniques')} ({known})")
    configs = {}
    for name in pruning:
        config_cls = get_technique(name).config_cls
        configs[name] = config_cls(**{k: v for k, v in overrides.items() if k in config_cls.__dataclass_fields__})
    return configs


def as_workload(model: str | nn.Module | Workload, example_inputs=None, *, data: Iterable | str | Path | None = None,
                metric: Callable[[torch.Tensor], float] | None = None, output: str | list[str] | None = None,
                dynamic_dims: dict | None = None) -> str | Workload:
    """What `open_session` takes: a workload spec as it is, a Workload, or a module made into one
    (judged on the batches of `data`, else on its example's rows). A data file (a path) is read by
    `open_session`, for modules and workloads alike.

    Raises:
        ConfigError: a module without `example_inputs`, or a `metric` for a workload that is not a module.
        WorkloadError: the module does not run on its example (see `workload_from_model`).
    """
    if isinstance(model, nn.Module):
        from overdrive.workloads.user import workload_from_model

        if example_inputs is None:
            raise ConfigError(f"{arg('example_inputs')} is needed with a module: a tensor, a tuple of tensors or a dict "
                              "of keyword tensors [B, ...] it runs on")
        batches = None if isinstance(data, (str, Path)) else data
        return workload_from_model(type(model).__name__, model, example_inputs, data=batches, metric=metric, output=output,
                                   dynamic_dims=dynamic_dims)
    if metric is not None:
        raise ConfigError(f"{arg('metric')} goes with a module, its {arg('example_inputs')} and the {arg('data')} it scores; "
                          f"workload {getattr(model, 'name', model)!r} brings its own")
    return model


def data_left(model, data):
    """The `data` `open_session` still has to read: all of it for a workload, a file for a module."""
    return data if not isinstance(model, nn.Module) or isinstance(data, (str, Path)) else None


@dataclass(kw_only=True)
class OptimizeJob:
    """An optimize run with every argument checked and the workload built, not yet measured."""

    session: Session
    guard: Guard
    techniques: list[str] | None
    configs: dict[str, TechniqueConfig]
    sweep_batch_sizes: list[int]
    command: str
    time_budget_s: float | None = DEFAULT_TIME_BUDGET_S  # None: no limit
    tuner: Tuner | None = None
    budget: Budget | None = None

    @classmethod
    def prepare(cls, model: str | nn.Module | Workload, example_inputs=None, *, device: str | torch.device = "auto",
                data: Iterable | str | Path | None = None, metric: Callable[[torch.Tensor], float] | None = None,
                max_accuracy_drop: float | None = None, min_fidelity: float = 0.99, min_gain: float = 1.02,
                lossless: bool = False, techniques: list[str] | None = None, batch_size: int | None = None,
                num_samples: int | None = None, prune_ratio: float | None = None, finetune_steps: int | None = None,
                sweep_batch_sizes: list[int] | None = None, out: str | Path | None = None,
                input_shape: tuple[int, ...] | None = None, input_dtype: str | torch.dtype = "float32",
                text_field: str | None = None, weights: str | Path | None = None,
                output: str | list[str] | None = None, dynamic_dims: dict | None = None,
                time_budget_s: float | None = None, command: str | None = None) -> OptimizeJob:
        """Check the arguments and build the workload (see `optimize` for them)."""
        if isinstance(techniques, str):  # "bf16" or "bf16,compile", as the command line spells them
            techniques = [name.strip() for name in techniques.split(",") if name.strip()]
        if techniques is not None and not techniques:
            raise ConfigError(f"{arg('techniques')} is empty; name techniques (see `overdrive list`) or pass None for all")
        configs = pruning_configs(techniques, prune_ratio=prune_ratio, finetune_steps=finetune_steps)
        try:
            budget_s = resolve_budget(time_budget_s)
        except ValueError as exc:
            raise ConfigError(f"{arg('time_budget_s', time_budget_s)}: {exc}") from None
        for value, name in ((batch_size, "batch_size"), (num_samples, "num_samples")):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigError(f"{arg(name, value)}: expected a positive integer")
        guard = Guard(min_fidelity=min_fidelity, max_accuracy_drop=max_accuracy_drop, min_gain=min_gain, lossless=lossless)
        session = open_session(as_workload(model, example_inputs, data=data, metric=metric, output=output,
                                           dynamic_dims=dynamic_dims), device=device,
                               batch_size=batch_size, num_samples=num_samples, out=out, input_shape=input_shape,
                               input_dtype=input_dtype, data=data_left(model, data), text_field=text_field,
                               weights=weights, dynamic_dims=dynamic_dims if isinstance(model, str) else None)
        workload = session.workload
        if max_accuracy_drop and not workload.has_task_metric:  # 0 is a lossless budget, which needs no metric
            raise ConfigError(f"{arg('max_accuracy_drop')}: workload {workload.name!r} has no task metric; "
                              f"use {arg('min_fidelity')}")
        if workload.metric is not None and session.num_distinct_samples < len(workload.samples):
            raise ConfigError(f"{arg('num_samples', num_samples)}: a {arg('metric')} scores every row of "
                              f"{arg('data')} ({len(workload.samples)}); leave {arg('num_samples')} unset")
        sizes = sweep_batch_sizes if sweep_batch_sizes is not None else default_sweep(session.batch_size)
        if any(not isinstance(b, int) or b < 1 for b in sizes):
            raise ConfigError(f"{arg('sweep_batch_sizes', sizes)}: expected positive integers")
        if not isinstance(model, str):  # a plan of a Python object can only be rebuilt with that object: `load(plan, model)`
            session.spec = f"{PYTHON_MODEL_PREFIX}{workload.name}>"
        spec = session.spec
        return cls(session=session, guard=guard, techniques=techniques, configs=configs,
                   sweep_batch_sizes=session.sweep_sizes(sizes), time_budget_s=budget_s,
                   command=command or f"overdrive.optimize({shlex.quote(spec)})")

    def eta_s(self) -> float | None:
        """Seconds this run expects to need from now (what is left to try, the plan's own
        measurement, the sweep), never more than the time budget has left; None before it starts
        (or, with no budget, before anything was estimated)."""
        if self.tuner is None or self.budget is None:
            return None
        sweep_s = len(self.sweep_batch_sizes) * self.tuner.schedule.compare_estimate()  # a point: about one comparison
        eta = max(0.0, min(self.budget.left(), self.tuner.eta_s() + sweep_s))
        return eta if math.isfinite(eta) else None  # no budget and nothing estimated yet

    def run(self, progress: Progress | None = None) -> OptimizeResult:
        """Measure: the baseline, each technique alone, the composition, then the sweep. When the
        session has an output folder, plan.json is written as soon as it is known (before the
        sweep) and everything else at the end."""
        s = self.session
        self.budget = Budget(self.time_budget_s)
        tuner = Tuner(workload=s.workload, device=s.device, batch_size=s.batch_size, techniques=self.techniques,
                      guard=self.guard, num_samples=s.num_distinct_samples, workload_spec=s.spec, configs=self.configs,
                      budget=self.budget)
        self.tuner = tuner
        count = {"done": 0, "total": 2 + 2 * len(tuner.techniques) + len(self.configs) + 2 * len(self.sweep_batch_sizes)}

        def step(description: str) -> None:
            if progress is not None:
                progress(description, count["done"], count["total"])
            count["done"] += 1

        tuner.progress = step
        tune = tuner.run()
        record_workload(tune.plan, s.workload)
        tune.plan.weights = s.workload.extra.get("weights")
        tune.plan.model_sha256 = weights_fingerprint(s.workload.model)
        warnings: list[str] = []
        result = OptimizeResult(rows=tune.rows, plan=tune.plan, baseline=tune.baseline, sweep={}, sweep_warnings=warnings,
                                session=s, guard=self.guard, flops_per_sample=tune.flops_per_sample, command=self.command,
                                warnings=tune.warnings, rule=tune.rule, peaks=tune.peaks)
        if s.out_dir is not None:
            result.save_plan(s.out_dir)  # before the sweep: the plan is the main result
        count["total"] = count["done"] + 2 * len(self.sweep_batch_sizes)
        result.sweep = sweep(s, {BASELINE_LABEL: [], "plan": result.plan.steps}, self.sweep_batch_sizes,
                             progress=step, warn=warnings.append, max_rows=SWEEP_MAX_ROWS, rounds=3,
                             stop=lambda last_s: not self.budget.affords(last_s))
        if self.budget.seconds is not None and self.budget.left() < -0.1 * self.budget.seconds:
            result.warnings.append(f"optimize took {self.budget.seconds - self.budget.left():.0f} s, over "
                                   f"{self.budget.describe()}: a step took longer than estimated")
        result.time_budget_s = self.budget.seconds
        if s.out_dir is not None:
            result.save(s.out_dir)
        return result


def optimize(model: str | nn.Module | Workload, example_inputs=None, *, device: str | torch.device = "auto",
             data: Iterable | str | Path | None = None, metric: Callable[[torch.Tensor], float] | None = None,
             max_accuracy_drop: float | None = None, min_fidelity: float = 0.99, min_gain: float = 1.02,
             lossless: bool = False, techniques: list[str] | None = None, batch_size: int | None = None,
             num_samples: int | None = None, prune_ratio: float | None = None, finetune_steps: int | None = None,
             sweep_batch_sizes: list[int] | None = None, out: str | Path | None = None,
             input_shape: tuple[int, ...] | None = None, input_dtype: str | torch.dtype = "float32",
             text_field: str | None = None, weights: str | Path | None = None, output: str | list[str] | None = None,
             dynamic_dims: dict | None = None, time_budget_s: float | None = None,
             progress: Progress | None = None, max_new_tokens: int | None = None, tokenizer=None,
             prompts: list[str] | None = None) -> OptimizeResult:
    """Measure `model` eager in fp32, then with each technique alone, compose the winners in
    canonical order (batching → prune → precision → graph → compile → runtime), roll back any
    step that is not faster or breaks the accuracy budget, and return the plan with the table.

    Args:
        model: an `nn.Module` (with `example_inputs`), a built-in workload name (`"minilm"`,
            `"digits-cnn"`, a torchvision name such as `"resnet50"`), `"package.module:factory"`,
            a `.pt2` / TorchScript file path, or a `Workload`. A module is measured in eval mode (on
            copies: your module is not changed).
        example_inputs: for a module: a tensor, a tuple of tensors, or a dict of keyword tensors
            (a Hugging Face model's `input_ids`, `attention_mask`), each [B, ...]; B is the default
            batch size. The module may return a tensor, tuple, dict, dataclass or `ModelOutput`
            (`overdrive.workloads.signature`).
        device: "auto" (CUDA when present), "cpu", "cuda", "cuda:N" or a torch.device.
        data: your evaluation rows, on which candidates are judged: for a module, batches shaped
            like `example_inputs` (dicts with its keys for a dict example, as a tokenizer returns them);
            for any model, a file (`.npy` [N, *row], a folder of images,
            `.txt` / `.jsonl` / `.csv` text for text models; see `overdrive.workloads.data`).
            Without it a module is judged on its example's rows, a built-in on its own samples.
        metric: for a module with `data`: `metric(outputs) -> float`, a task score of the outputs
            on all rows of `data` (float32 [N, ...] in order), higher is better.
        max_accuracy_drop: task-metric points (accuracy %, or `metric`'s units) a technique may
            lose; None: only the fidelity floor applies; 0: lossless techniques only.
        min_fidelity: floor on the workload's fidelity figure against fp32 (cosine or top-1
            agreement), in [0, 1].
        min_gain: throughput ratio a step needs over what it is added to, at the low end of the
            99% confidence interval of interleaved measurements, to be kept (0: every step within
            the budget is kept, whatever its speed).
        lossless: keep lossless techniques only (as `max_accuracy_drop=0`).
        techniques: names to try (see `overdrive list`); None: every one that is not opt-in.
        batch_size: rows per call; None: the workload's.
        num_samples: distinct evaluation samples; None: 512 for text, all otherwise.
        prune_ratio, finetune_steps: for the pruning techniques named in `techniques`.
        sweep_batch_sizes: batch sizes of the latency-vs-batch-size sweep; None: 1, B/4, B, 2B;
            []: no sweep.
        out: a folder to write plan.json, results.json, report.md and the plot into (OUT/<name>/);
            None: nothing is written until `result.save(folder)`.
        input_shape, input_dtype: for a TorchScript file, which stores no input shape.
        text_field: the JSONL field / CSV column of a text `data` file (default "text").
        weights: a checkpoint loaded into the model first: a DCP folder `overdrive train --save`
            wrote, or a torch.save state dict; the plan records it, so `serve` and `run` load it too.
        output: for a module: the output(s) judged, by path ("logits", "0"); None: every floating
            [B, ...] output, each judged apart (the worst counts).
        dynamic_dims: for a module, a factory or a model file: dimensions whose size varies from
            row to row, e.g. {"input_ids": {1: "seq"}, "attention_mask": {1: "seq"}}; rows are
            zero-padded there per batch once padding is shown not to change the answers. None:
            found by calling the model at two sizes (integer inputs only); {}: none.
        time_budget_s: seconds optimize may take (`overdrive.tuning.budget`): candidates are tried
            by the gain cheap signals predict per second of trying, and one that cannot finish in
            what is left is reported untried with its estimate. None: the default
            (`DEFAULT_TIME_BUDGET_S`); 0: no limit, everything is tried.
        progress: called before each measurement as progress(description, done, expected).
        max_new_tokens: for a causal LM: greedy tokens per sequence in the timings (default 32).
        tokenizer, prompts: a Hugging Face causal LM (Llama, Mistral, Qwen2, Phi-3, GPT-2) passed as `model` is
            optimized for generation with its tokenizer, judged and timed on `prompts` (a list of strings; None:
            CPython text).

    Returns:
        An OptimizeResult: `.table` (the per-technique rows), `.model` (the optimized module),
        `.plan`, `.save(folder)`. For a causal LM (`"pydoc-lm"`, a factory of one, a model with `tokenizer`),
        a `generate.tune.GenerationResult`:
        `.rows` (`.table` as dicts), `.plan` (a `GenerationPlan`), `.generator` (`gen.generate(prompts)`, as the
        plan was timed, or with `SamplingParams`), `.warnings`; of
        the arguments above it takes device, lossless, techniques, batch_size (default 1),
        min_gain, out and progress.

    Raises:
        ConfigError: an argument that cannot work (unknown technique, batch size, device, ...).
        WorkloadError: the model cannot be built, fails at the batch size in eager fp32, or cannot
            be judged (its outputs change between two runs on the same rows, or its fidelity figure
            fails the floor against itself).
        DataError: `data` cannot be read or does not suit the model.
    """
    from overdrive.workloads.generation import is_generation_workload

    if is_generation_workload(model) or tokenizer is not None or prompts is not None:
        from overdrive.tuning.generation import optimize_lm_from_python

        return optimize_lm_from_python(
            model, tokenizer=tokenizer, prompts=prompts, one_pass={"example_inputs": example_inputs, "data": data, "metric": metric,
                             "max_accuracy_drop": max_accuracy_drop, "num_samples": num_samples,
                             "prune_ratio": prune_ratio, "finetune_steps": finetune_steps,
                             "sweep_batch_sizes": sweep_batch_sizes, "input_shape": input_shape,
                             "text_field": text_field, "weights": weights, "output": output,
                             "dynamic_dims": dynamic_dims, "time_budget_s": time_budget_s, "min_fidelity": min_fidelity},
            device=device, lossless=lossless, techniques=techniques, batch_size=batch_size, min_gain=min_gain,
            max_new_tokens=max_new_tokens, out=out, progress=progress)
    if max_new_tokens is not None:
        raise ConfigError(f"{arg('max_new_tokens', max_new_tokens)}: only for a causal LM (\"pydoc-lm\", a factory of one, or a model with its tokenizer)")
    return OptimizeJob.prepare(
        model, example_inputs, device=device, data=data, metric=metric, max_accuracy_drop=max_accuracy_drop,
        min_fidelity=min_fidelity, min_gain=min_gain, lossless=lossless, techniques=techniques, batch_size=batch_size,
        num_samples=num_samples, prune_ratio=prune_ratio, finetune_steps=finetune_steps,
        sweep_batch_sizes=sweep_batch_sizes, out=out, input_shape=input_shape, input_dtype=input_dtype,
        text_field=text_field, weights=weights, output=output, dynamic_dims=dynamic_dims, time_budget_s=time_budget_s,
    ).run(progress)

