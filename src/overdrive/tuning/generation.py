"""`optimize` for a causal LM, shared by `overdrive.optimize(...)` and `overdrive optimize ...`: the workload built
(the built-in pydoc-lm, a `package.module:factory` returning (model, tokenizer), or a model and tokenizer passed in
Python), `generate.tune.optimize_generation` run, the plan, results and report written."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from torch import nn

from overdrive.core import devices
from overdrive.core.errors import ConfigError, arg
from overdrive.core.report import environment, write_results
from overdrive.generate.workload import GenerationWorkload


def output_folder(out: str | Path, spec: str) -> Path:
    """OUT/<name>: the built-in's name, or a factory's as `overdrive optimize` names any factory's folder."""
    from overdrive.workloads.user import factory_name

    return Path(out) / (factory_name(spec) if ":" in spec and not spec.startswith("<") else spec)


def optimize_named_lm(spec: str, *, out: str | Path | None = None, log: Callable[[str], None] | None = None, **kwargs):
    """`optimize_lm` on the generation workload `spec` names ("pydoc-lm", or "package.module:factory"), its files
    written to `output_folder(out, spec)`.

    Raises:
        ConfigError, WorkloadError: as `create_generation_workload` and `optimize_lm`."""
    from overdrive.generate.tune import check_techniques
    from overdrive.workloads.generation import create_generation_workload

    check_techniques(kwargs.get("techniques"))  # before the model is built
    return optimize_lm(create_generation_workload(spec, log=log),
                       folder=output_folder(out, spec) if out is not None else None, **kwargs)


def optimize_lm(workload: GenerationWorkload, *, folder: Path | None = None, device="auto", lossless: bool = False,
                techniques: list[str] | None = None, batch_size: int | None = None, min_gain: float = 1.02,
                max_new_tokens: int | None = None, progress: Callable[[str], None] = lambda _: None,
                command: str | None = None):
    """Runs `optimize_generation` on `workload` (batch 1 and 32 new tokens unless given; `lossless`: the exact
    techniques only) and writes FOLDER/plan.json and results.json when `folder` is given. Returns the
    `GenerationResult`.

    Raises:
        ConfigError: an unknown technique, a batch size above the prompts."""
    from overdrive.generate.tune import EXACT, TECHNIQUES, check_techniques, optimize_generation

    check_techniques(techniques)
    if max_new_tokens is not None and (not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool)
                                       or max_new_tokens < 1):
        raise ConfigError(f"{arg('max_new_tokens', max_new_tokens)}: expected a positive integer")
    if lossless:
        techniques = [t for t in (techniques or TECHNIQUES) if t in EXACT]
    result = optimize_generation(workload, device=str(devices.resolve_device(str(device))), batch_size=batch_size or 1,
                                 new_tokens=max_new_tokens or 32, techniques=techniques, min_gain=min_gain,
                                 progress=progress)
    if folder is not None:
        result.plan.save(folder / "plan.json")
        write_results(folder / "results.json", {**result.to_dict(), "environment": environment(),
                                                **({"command": command} if command else {})})
        write_generation_report(folder / "report.md", result, device=devices.describe(result.generator.device),
                                command=command)
    return result


def describe_figures(figures: dict) -> str:
    """One batch size's line of the plan's figures (`GenerationPlan.measured["batch_sizes"][b]`)."""
    text = f"{figures['tokens_per_s']:,.1f} tokens/s"
    if "describe" in figures:
        text += (f" against the baseline's {figures['baseline_tokens_per_s']:,.1f}: {figures['describe']}; time to "
                 f"first token {figures['ttft_ms_p50']:.1f} ms, inter-token {figures['itl_ms_p50']:.1f} ms (p50)")
    memory = figures.get("memory")
    if isinstance(memory, dict):
        text += (f"; peak memory {memory['peak'] / 1e6:,.1f} MB = {memory['weights'] / 1e6:,.1f} weights + "
                 f"{memory['kv_cache'] / 1e6:,.1f} KV cache + {memory['other'] / 1e6:,.1f} other")
    elif memory:
        text += f"; peak memory not measured: {memory}"
    return text


COLUMNS = ("technique", "status", "tokens/s", "gain [99%]", "greedy changed beyond ties / all", "mean KL", "perplexity",
           "probe", "why / detail")
LEGEND = ("gain: tokens/s against what the step was added to, interleaved, 99% interval; greedy changed: prompts whose "
          "greedy tokens differ from fp32 eager's where fp32's top-2 margin was above the near-tie threshold / "
          "anywhere; KL: mean KL(fp32 ‖ candidate) along fp32's own path, nats per token; probe: prompts whose tokens differ "
          "alone and in a batch")


def row_cells(row) -> list[str]:
    """A `GenerationRow`'s cells under `COLUMNS` (its reason and detail in full)."""
    fid, change = row.fidelity or {}, (row.fidelity or {}).get("perplexity_change")
    return [row.technique, row.status, f"{row.tokens_per_s:,.1f}" if row.tokens_per_s else "",
            row.gain.describe() if row.gain else "",
            f"{fid['diverged_beyond_ties']} / {fid['diverged']} of {fid['prompts']}" if fid else "",
            f"{fid['mean_kl']:.1e}" if fid else "", f"{change:+.2%}" if change is not None else "",
            f"{len(row.probe['differ_beyond_ties'])} / {len(row.probe['differ'])} of {row.probe['prompts']}"
            if row.probe else "", "; ".join(x for x in (row.reason, row.detail) if x)]


def write_generation_report(path: Path, result, *, device: str, command: str | None = None) -> None:
    """report.md for a causal LM's `optimize`: the table (every reason in full), the plan and its figures per
    batch size, and the command."""
    lines = [f"# overdrive optimize {result.workload.name} — {device}", ""]
    if command:
        lines += [f"`{command}`", ""]
    lines += ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|").replace("\n", " ") for cell in row_cells(row)) + " |"
              for row in result.rows]
    lines += ["", LEGEND, "", f"**plan: {' + '.join(result.plan.names) or 'baseline'}**", ""]
    lines += [f"- batch {size}: {describe_figures(figures)}" for size, figures in
              result.plan.measured["batch_sizes"].items()]
    lines += [f"- warning: {warning}" for warning in result.warnings]
    path.write_text("\n".join(lines) + "\n")


def optimize_lm_from_python(model, *, one_pass: dict, tokenizer=None, prompts: list[str] | None = None, progress=None,
                            techniques: list[str] | None = None, out: str | Path | None = None, **kwargs):
    """`overdrive.optimize(...)` for a causal LM: `model` a generation workload's name, or a Hugging Face causal LM
    passed with its `tokenizer` (and your `prompts`, judged and timed); `one_pass` holds `optimize`'s arguments
    that mean nothing for one (refused when given; `min_fidelity` when not its default 0.99); `progress(description,
    done, expected)` as `optimize` calls it; the rest as `optimize_lm`.

    Raises:
        ConfigError: a one-pass argument given, a tokenizer without a causal LM or the reverse, or as `optimize_lm`.
        WorkloadError: a model overdrive's decoder does not take."""
    from overdrive.generate.tune import TECHNIQUES, check_techniques
    from overdrive.workloads.generation import PYTHON_LM_PREFIX, is_causal_lm, lm_workload

    given = [n for n, value in one_pass.items() if value is not None and (n != "min_fidelity" or value != 0.99)]
    if given:
        raise ConfigError(f"{', '.join(arg(n) for n in given)}: for a one-pass model, not a causal LM (one is judged "
                          "by its prompts: greedy tokens, KL and perplexity against fp32; and timed at its batch size "
                          "and at 8, `overdrive bench --batch-sizes` times others)")
    check_techniques(techniques)
    done = [0]

    def step(description: str) -> None:  # each technique reports twice (judged, then timed); the plan at two sizes
        if progress is not None:
            progress(description, done[0], max(1 + 2 * len(techniques or TECHNIQUES) + 2, done[0] + 1))
            done[0] += 1

    if isinstance(model, str):
        if tokenizer is not None or prompts is not None:
            raise ConfigError(f"{arg('tokenizer')} and {arg('prompts')} go with a model passed in Python; {model!r} "
                              "brings its own")
        return optimize_named_lm(model, techniques=techniques, progress=step, out=out, **kwargs)
    if not (isinstance(model, nn.Module) and is_causal_lm(model)):
        raise ConfigError(f"{arg('tokenizer')} and {arg('prompts')} are for a Hugging Face causal LM (one that "
                          f"generates); got {type(model).__name__}")
    if tokenizer is None:
        raise ConfigError(f"{arg('tokenizer')}: a causal LM needs its tokenizer (overdrive.optimize(model, "
                          "tokenizer=tok, prompts=...))")
    name = type(model).__name__
    workload = lm_workload(f"{PYTHON_LM_PREFIX}{name}>", model, tokenizer, prompts)
    return optimize_lm(workload, folder=Path(out) / name if out is not None else None, techniques=techniques,
                       progress=step, **kwargs)
