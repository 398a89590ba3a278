"""`optimize` for a built-in causal LM, shared by `overdrive.optimize("pydoc-lm")` and `overdrive optimize pydoc-lm`:
the workload built, `generate.tune.optimize_generation` run, the plan and results written."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from overdrive.core import devices
from overdrive.core.errors import ConfigError, arg
from overdrive.core.report import environment, write_results


def optimize_builtin_lm(name: str, *, device="auto", lossless: bool = False, techniques: list[str] | None = None,
                        batch_size: int | None = None, min_gain: float = 1.02, max_new_tokens: int | None = None,
                        out: str | Path | None = None, progress: Callable[[str], None] = lambda _: None,
                        log: Callable[[str], None] | None = None, command: str | None = None):
    """Runs `optimize_generation` on the built-in generation workload `name` (batch 1 and 32 new tokens unless
    given; `lossless`: the exact techniques only) and writes OUT/<name>/plan.json and results.json when `out` is
    given. Returns the `GenerationResult`.

    Raises:
        ConfigError: an unknown technique (before the model is built), a batch size above the prompts."""
    from overdrive.generate.tune import EXACT, TECHNIQUES, check_techniques, optimize_generation
    from overdrive.workloads.generation import create_generation_workload

    check_techniques(techniques)
    if lossless:
        techniques = [t for t in (techniques or TECHNIQUES) if t in EXACT]
    workload = create_generation_workload(name, log=log)
    result = optimize_generation(workload, device=str(devices.resolve_device(str(device))), batch_size=batch_size or 1,
                                 new_tokens=max_new_tokens or 32, techniques=techniques, min_gain=min_gain,
                                 progress=progress)
    if out is not None:
        folder = Path(out) / name
        result.plan.save(folder / "plan.json")
        write_results(folder / "results.json", {**result.to_dict(), "environment": environment(),
                                                **({"command": command} if command else {})})
    return result


def optimize_lm_from_python(name: str, *, one_pass: dict, progress=None, techniques: list[str] | None = None, **kwargs):
    """`overdrive.optimize(name)` for a built-in causal LM: `one_pass` holds `optimize`'s arguments that mean nothing
    for one (refused when given; `min_fidelity` when not its default 0.99); `progress(description, done, expected)`
    as `optimize` calls it; the rest as `optimize_builtin_lm`.

    Raises:
        ConfigError: a one-pass argument given, or as `optimize_builtin_lm`."""
    from overdrive.generate.tune import TECHNIQUES

    given = [n for n, value in one_pass.items() if value is not None and (n != "min_fidelity" or value != 0.99)]
    if given:
        raise ConfigError(f"{', '.join(arg(n) for n in given)}: not for a causal LM ({name} is judged by its held-out "
                          f"prompts: greedy tokens, KL and perplexity)")
    done = [0]

    def step(description: str) -> None:
        if progress is not None:
            progress(description, done[0], len(techniques or TECHNIQUES) + 2)
            done[0] += 1

    return optimize_builtin_lm(name, techniques=techniques, progress=step, **kwargs)
