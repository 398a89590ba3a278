"""The command line for a causal LM (`pydoc-lm`, a generation plan): `optimize`, `bench` and `run` hand over here
when their workload or plan is a generation one (`generate/workload.py`, `generate/plan.py`).

- optimize: `generate.tune.optimize_generation`, its table (tokens/s, the gain against what each step was added to,
  the guard's greedy-token, KL and perplexity figures, the batch probe), plan.json and results.json.
- bench: the baseline and the plan at each batch size, interleaved (`gain.compare`): tokens/s in total and per
  sequence, time to first token, inter-token latency p50/p99, the decode roofline, weights and KV cache bytes.
- run: `cli/generate_run.py`.
"""

from __future__ import annotations

import math
import shlex
import time

from overdrive.core.errors import ConfigError, arg

# Flags of `optimize` / `bench` that mean nothing for a causal LM, with the value that says "not given".
ONE_PASS_ONLY = {"num_samples": None, "input_shape": None, "data": None, "text_field": None, "dynamic_dim": None,
                 "weights": None, "max_accuracy_drop": None, "prune_ratio": None, "finetune_steps": None,
                 "sweep_batch_sizes": None, "time_budget": None, "audit": False}


def refuse_one_pass_flags(args) -> None:
    given = [name for name, unset in ONE_PASS_ONLY.items() if getattr(args, name, unset) != unset]
    if given:
        raise ConfigError(f"{', '.join(arg(n) for n in given)}: not for a causal LM (a generation workload is judged "
                          f"by its own held-out prompts: greedy tokens, KL and perplexity against fp32)")


def optimize_main(args, argv: list[str]) -> int:
    from overdrive.core import devices
    from overdrive.core.report import make_console, print_table
    from overdrive.tuning.generation import LEGEND, describe_figures, optimize_named_lm, output_folder

    refuse_one_pass_flags(args)
    if args.min_fidelity != 0.99:
        raise ConfigError(f"{arg('min_fidelity', args.min_fidelity)}: not for a causal LM (its guard counts greedy "
                          f"tokens changed, KL and perplexity)")
    console = make_console()
    device = devices.resolve_device(args.device)
    out = output_folder(args.out, args.workload)
    if (out / "plan.json").exists() and not args.overwrite:
        raise ConfigError(f"{out / 'plan.json'} exists (a plan optimize wrote before); pass {arg('overwrite')} to "
                          f"replace it, or {arg('out')} for another folder")
    batch = args.batch_size or 1
    console.print(f"[bold]overdrive optimize {args.workload}[/] on {devices.describe(device)}, batch size {batch}, "
                  f"{args.max_new_tokens} new tokens per sequence (greedy); judged on held-out prompts and sentences", highlight=False)
    started = time.perf_counter()
    result = optimize_named_lm(
        args.workload, device=device, lossless=args.lossless, techniques=args.techniques, batch_size=batch,
        min_gain=args.min_gain, max_new_tokens=args.max_new_tokens, out=args.out,
        progress=lambda what: console.print(f"  measuring {what} ({time.perf_counter() - started:.0f} s)", highlight=False),
        log=lambda line: console.print(line, highlight=False), command="overdrive " + shlex.join(argv))
    workload = result.workload
    print_table(console, rows_table(result, title=f"overdrive optimize {workload.name} — {devices.describe(device)}, "
                                                   f"batch {batch}"))
    console.print(LEGEND, style="dim", highlight=False, soft_wrap=True)
    for line in reasons_in_full(result):
        console.print(f"  {line}", highlight=False, soft_wrap=True)
    if "prompts" in workload.facts:  # a user's LM: what it was judged on
        console.print(f"prompts: {workload.facts['prompts']}; calibration and perplexity: CPython reference sentences",
                      highlight=False, soft_wrap=True)
    for warning in result.warnings:
        console.print(f"[yellow]warning: {warning}[/]", highlight=False, soft_wrap=True)
    plan = result.plan
    for size, figures in plan.measured["batch_sizes"].items():
        console.print(f"batch {size}: " + describe_figures(figures), highlight=False, soft_wrap=True)
    console.print(f"plan: [bold]{' + '.join(plan.names) or 'baseline'}[/]", highlight=False)
    console.print(f"wrote {out / 'plan.json'}, {out / 'results.json'}, {out / 'report.md'}")
    sizes = ",".join(str(b) for b in dict.fromkeys((1, batch, 8)))
    console.print(f"next: overdrive bench {workload.name} --plan {out / 'plan.json'} --batch-sizes {sizes}  ·  "
                  f"overdrive run {out / 'plan.json'} --input PROMPTS.jsonl --output OUT.jsonl", highlight=False,
                  soft_wrap=True)
    return 0


def rows_table(result, *, title: str):
    from rich.table import Table

    from overdrive.tuning.generation import COLUMNS, row_cells

    table = Table(title=title)
    for col in COLUMNS:
        table.add_column(col.replace(" beyond", "\nbeyond"),
                         justify="left" if col in ("technique", "status", "why / detail") else "right")
    for row in result.rows:
        cells = row_cells(row)
        table.add_row(*cells[:-1], _short(cells[-1]))
    return table


SHORT = 48  # characters of a reason the table shows; the whole of it is printed below the table


def _short(text: str) -> str:
    return text if len(text) <= SHORT else text[:SHORT - 1].rstrip() + "…"


def reasons_in_full(result) -> list[str]:
    """"why, a, b: reason" for each reason the table cut short, rows with the same reason on one line."""
    grouped: dict[str, list[str]] = {}
    for row in result.rows:
        text = "; ".join(x for x in (row.reason, row.detail) if x)
        if len(text) > SHORT:
            grouped.setdefault(text, []).append(row.technique)
    return [f"why, {', '.join(names)}: {text}" for text, names in grouped.items()]


# ---------------------------------------------------------------------------------------------------- bench


def bench_main(args, plan_path: str) -> int:
    from rich.table import Table

    from overdrive.core import devices
    from overdrive.core.gain import HEADLINE_ROUNDS, RECHECK_ROUNDS, RECHECK_WIDTH, compare
    from overdrive.core.report import environment, make_console, print_table, write_results
    from overdrive.generate.plan import GenerationPlan, build_generator
    from overdrive.generate.roofline import decode_roofline, kv_bytes_per_step, weight_bytes_per_step
    from overdrive.generate.tune import DecodeRunner, pass_memory
    from overdrive.tuning.generation import output_folder
    from overdrive.workloads.generation import create_generation_workload

    refuse_one_pass_flags(args)
    plan = GenerationPlan.load(plan_path)
    if args.workload != plan.workload:
        raise ConfigError(f"{arg('plan', plan_path)} is a plan for {plan.workload}, not {args.workload}")
    console = make_console()
    device = devices.resolve_device(args.device if args.device != "auto" else plan.device)
    sizes = args.batch_sizes or [plan.batch_size]
    new_tokens = args.new_tokens or plan.max_new_tokens
    workload = create_generation_workload(plan.workload, num_prompts=max(32, max(sizes)),
                                          log=lambda line: console.print(line, highlight=False))
    prompts = workload.prompts if not args.prompt_tokens else long_prompts(workload, args.prompt_tokens, max(sizes))
    if len(prompts) < max(sizes):
        raise ConfigError(f"{arg('batch_sizes', max(sizes))}: the workload holds {len(prompts)} prompts")
    context = getattr(workload.model.config, "max_position_embeddings", None)
    longest = max(len(p) for p in prompts[:max(sizes)])
    if context is not None and longest + new_tokens > context:
        raise ConfigError(f"{arg('new_tokens', new_tokens)}: the longest prompt ({longest} tokens) and {new_tokens} new "
                          f"tokens exceed the model's context of {context} positions; give fewer new tokens"
                          + (" or shorter --prompt-tokens" if args.prompt_tokens else ""))
    table = Table(title=f"overdrive bench {workload.name} — {devices.describe(device)}, {new_tokens} new tokens, "
                        f"prompts of {args.prompt_tokens or 'about 10'} tokens")
    for col in ("configuration", "batch", "tokens/s\ntotal", "tokens/s\nper sequence", "TTFT ms\np50",
                "ITL ms\np50 / p99", "% of bandwidth\nlimit (forwards)", "peak MB: weights\n+ KV cache + other",
                "speedup [99%]"):
        table.add_column(col, justify="left" if col == "configuration" else "right")
    results = []
    for b in sizes:
        with console.status(f"measuring batch {b}"):
            base = DecodeRunner(build_generator(workload.model, workload.tokenizer, [], device=device, max_batch_size=b),
                                prompts, batch_size=b, new_tokens=new_tokens)
            ours = DecodeRunner(build_generator(workload.model, workload.tokenizer, plan.steps, device=device,
                                                max_batch_size=b), prompts, batch_size=b, new_tokens=new_tokens)
            base.warm_up()
            ours.warm_up()
            gain = compare(base, ours, min_gain=1.0, min_rounds=RECHECK_ROUNDS, max_rounds=3 * RECHECK_ROUNDS,
                           max_width=RECHECK_WIDTH) if plan.steps else None
            if gain is None:
                base.timed_passes(HEADLINE_ROUNDS // 2)
        for label, runner in (("baseline (eager fp32)", base), (" + ".join(plan.names) or "plan (= baseline)", ours)):
            if runner is ours and not plan.steps:
                continue
            figures = decode_figures(runner, b)
            gen = runner.generator
            slots = gen.timings[-1].slots if gen.timings else 0
            forwards = runner.forwards_per_s()  # not tokens: a speculative forward keeps several per weight read
            roof = decode_roofline(gen.model, batch_size=b, slots=slots, cache_dtype=gen.cache_dtype,
                                   steps_per_s=forwards) if math.isfinite(forwards) else None
            memory = pass_memory(runner)
            figures.update(configuration=label, batch_size=b, roofline=roof.to_dict() if roof else None,
                           weight_bytes=weight_bytes_per_step(gen.model),
                           kv_cache_bytes=kv_bytes_per_step(gen.model, batch_size=b, slots=slots, dtype=gen.cache_dtype),
                           memory=memory if isinstance(memory, dict) else {"unmeasured": memory},
                           gain=gain.to_dict() if gain and runner is ours else None)
            results.append(figures)
            table.add_row(label, str(b), f"{figures['tokens_per_s']:,.1f}", f"{figures['tokens_per_s'] / b:,.1f}",
                          f"{figures['ttft_ms_p50']:.1f}", f"{figures['itl_ms_p50']:.2f} / {figures['itl_ms_p99']:.2f}",
                          f"{roof.share:.0%}" if roof else "",
                          (f"{memory['peak'] / 1e6:,.1f}: {memory['weights'] / 1e6:,.1f} + "
                           f"{memory['kv_cache'] / 1e6:,.1f} + {memory['other'] / 1e6:,.1f}"
                           if isinstance(memory, dict) else "not measured"),
                          gain.describe() if gain and runner is ours else "1.00×")
    print_table(console, table)
    console.print("tokens/s: new tokens over a pass's wall time (prefill included; batch 1 runs two prompts one after "
                  "the other); TTFT: prefill to the first token; ITL: one decode step (one token per sequence); the "
                  "bandwidth limit: decode forwards/s × (weights at their storage dtype + the KV cache each reads) ÷ "
                  "the measured read bandwidth (a speculative forward keeps several tokens for one read); peak memory: one "
                  "more pass, the weights' storage + the most the pass held at once (its KV cache, the rest: "
                  "activations, logits, workspace), from the CPU allocator's reports to the profiler or CUDA's "
                  "allocator; speedup: interleaved with the baseline at the same batch, 99% interval", style="dim",
                  highlight=False, soft_wrap=True)
    for figures in results:
        if "unmeasured" in figures["memory"]:
            console.print(f"[yellow]warning: batch {figures['batch_size']}, {figures['configuration']}: peak memory "
                          f"not measured: {figures['memory']['unmeasured']}[/]", highlight=False, soft_wrap=True)
        if figures["gain"] and figures["gain"]["uncertain"]:
            console.print(f"[yellow]warning: batch {figures['batch_size']}: the speedup is uncertain: "
                          f"{figures['gain']['uncertain']}[/]", highlight=False, soft_wrap=True)
    out = output_folder(args.out, args.workload)
    write_results(out / "bench.json", {"workload": workload.name, "device": devices.describe(device),
                                       "environment": environment(), "plan": plan.to_dict(), "new_tokens": new_tokens,
                                       "prompt_tokens": args.prompt_tokens, "results": results,
                                       "units": {"tokens_per_s": "new tokens per second, all sequences",
                                                 "ttft_ms_p50": "ms", "itl_ms_p50": "ms", "itl_ms_p99": "ms",
                                                 "weight_bytes": "bytes read per decode step",
                                                 "kv_cache_bytes": "bytes of KV cache read per decode step",
                                                 "memory": "bytes: peak = weights + kv_cache + other"}})
    console.print(f"wrote {out / 'bench.json'}")
    return 0


def decode_figures(runner, batch_size: int) -> dict:
    """tokens/s (total), TTFT p50 and ITL p50/p99 in ms, from a `DecodeRunner`'s timed passes and its last pass."""
    steps = sorted(runner.step_s)
    ttft = sorted(runner.ttft_s)

    def q(values: list[float], share: float) -> float:
        return values[min(len(values) - 1, int(share * len(values)))] * 1e3 if values else math.nan

    return {"tokens_per_s": runner.tokens_per_s(), "ttft_ms_p50": q(ttft, 0.5), "itl_ms_p50": q(steps, 0.5),
            "itl_ms_p99": q(steps, 0.99)}


def long_prompts(workload, tokens: int, count: int) -> list[list[int]]:
    """`count` prompts of `tokens` tokens each, from held-out text run together (real text, no padding).

    Raises:
        ConfigError: too few held-out tokens, or prompts that leave no room in the model's context."""
    context = getattr(workload.model.config, "max_position_embeddings", None)
    if context is not None and tokens >= context:
        raise ConfigError(f"{arg('prompt_tokens', tokens)}: the model's context holds {context} tokens")
    stream = [t for ids in workload.held_out + workload.calibration for t in ids]
    prompts = [stream[i * tokens:(i + 1) * tokens] for i in range(count)]
    if len(prompts[-1]) < tokens:
        raise ConfigError(f"{arg('prompt_tokens', tokens)} × {count} prompts exceed the {len(stream)} held-out tokens")
    return prompts
