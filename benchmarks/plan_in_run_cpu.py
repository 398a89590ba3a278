"""A plan as `overdrive run` uses it: the whole plan against each of its steps alone and against no plan,
over 2,048 real sentences, in one process (issue 30: "a plan is a promise about the user's job").

`optimize` measures a plan on its evaluation rows; `run` builds it again, warms it up its own way and
runs records it never saw. This puts the plan's steps through `run_offline` (what `overdrive run PLAN`
does) on the same `.txt` file of CPython reference sentences (the first --num-sentences of the
`minilm` corpus, which holds optimize's 512 evaluation sentences), batch 32 from the plan:

  no plan                       the eager fp32 model, run's length bucketing
  <step> alone                  a plan of that one step (its searched layers, checkpoints as saved)
  the plan                      every step

Figures: run's own items/s (records over the wall time of the records, the model's set-up apart, as
`overdrive run` prints it), the set-up seconds (building, compiling, warm-up), the graphs torch.compile
built while the records ran (each one stalls the job), and min cosine to the no-plan output. Entries run
in turn, --repeats rounds of all of them (TorchDynamo reset before each, so one entry's graphs and
recompile limits do not spill into the next); the table shows each entry's median and range.

    .venv/bin/python benchmarks/plan_in_run_cpu.py --plan out/minilm/plan.json [--repeats 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import statistics
import tempfile
from pathlib import Path

import numpy as np
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from overdrive.run.job import RunConfig, run_offline  # noqa: E402
from overdrive.tuning.plan import Plan  # noqa: E402
from overdrive.files.sentences import python_doc_sentences  # noqa: E402


def min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return float((a * b).sum(axis=1).min())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", type=Path, required=True, help="plan.json from `overdrive optimize minilm`")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--num-sentences", type=int, default=2048)
    args = parser.parse_args()
    print(f"plan_in_run_cpu: torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC", flush=True)
    plan = Plan.load(args.plan)
    sentences = list(python_doc_sentences()[:args.num_sentences])
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        source = tmp / "sentences.txt"
        source.write_text("".join(s.replace("\n", " ") + "\n" for s in sentences), encoding="utf-8")
        entries: dict[str, Path | None] = {"no plan": None}
        for i, step in enumerate(plan.steps):
            if len(plan.steps) > 1:
                alone = dataclasses.replace(plan, steps=[step])
                entries[f"{step.name} alone"] = tmp / f"alone-{i}.json"
                alone.save(entries[f"{step.name} alone"])
        entries[f"the plan: {' + '.join(plan.names)}"] = args.plan
        results: dict[str, list] = {label: [] for label in entries}
        outputs: dict[str, np.ndarray] = {}
        for round_ in range(args.repeats):
            for label, path in entries.items():
                torch._dynamo.reset()
                out = tmp / "out.npy"
                summary = run_offline(RunConfig(workload="minilm", input=source, output=out, plan=path, device="cpu",
                                                batch_size=plan.batch_size, overwrite=True))
                outputs[label] = np.load(out)
                results[label].append(summary)
                print(f"  round {round_ + 1} {label:<55} {summary.items_per_s:8.1f} items/s  set-up {summary.setup_s:6.1f} s  "
                      f"graphs compiled during the run {summary.recompiles}  failed {summary.failed}", flush=True)
    reference = outputs["no plan"]
    print(f"\n{len(sentences)} sentences, batch {plan.batch_size}; plan {args.plan}\n")
    print("| entry | items/s (median) | range | set-up s | graphs compiled during the run | min cosine vs no plan |")
    print("|---|---:|---:|---:|---:|---:|")
    medians = {}
    for label, summaries in results.items():
        rates = [s.items_per_s for s in summaries]
        medians[label] = statistics.median(rates)
        print(f"| {label} | {medians[label]:,.1f} | {min(rates):,.1f}–{max(rates):,.1f} | "
              f"{statistics.median(s.setup_s for s in summaries):.1f} | {max(s.recompiles for s in summaries)} | "
              f"{min_cosine(outputs[label], reference):.5f} |")
    whole = medians[list(entries)[-1]]
    best_step = max((v for k, v in medians.items() if k.endswith(" alone")), default=whole)
    print(f"\nthe plan: {whole / medians['no plan']:.2f}× no plan, {whole / best_step:.2f}× its best single step — "
          f"{'MET' if whole >= best_step and whole > medians['no plan'] else 'NOT MET'} (issue 30: at least as fast as its "
          "best step, faster than no plan)")


if __name__ == "__main__":
    main()
