"""Does a compiled plan of a user's text model keep its speed on real, variable-length rows?

A small BERT classifier (`tests/fixtures/hf_models.py:bert_classifier`: BertForSequenceClassification
from a small config with a WordPiece tokenizer trained here, random weights: a speed figure only)
brought as `(model, tokenizer)`, run by `overdrive run` over 600 real sentences (standard-library
docstrings, lengths 40–300 characters) at batch 32, three ways, on the same sentences and file:

  eager fp32                   no plan (run's own length bucketing)
  compile, static shapes       length-bucketing + compile(dynamic=False): the shapes of the
                               sample batches only, recompiling for each new length (what a
                               (model, example) pair of fixed length got before issue 16)
  compile, dynamic shapes      length-bucketing + compile with the default the tuner uses for text
                               workloads (dynamic=True: one graph for every length)

Each entry runs once untimed (warm-up, compilation for the shapes it meets), then --repeats
times; eager and dynamic shapes are interleaved. The static-shapes entry runs last, after
`torch._dynamo.reset()`, on its own: TorchDynamo caches compiled graphs per code object, so its
recompiles (one per new length, up to `recompile_limit`, then eager for the rest) would otherwise
use up the limit the dynamic entry shares. The table shows the median items/s with each run, the
ratio to eager and the graphs compiled. Target (issue 16): the compiled plan ≥ the eager items/s.

    .venv/bin/python benchmarks/compile_shapes_cpu.py [--repeats 3] [--sentences 600]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from overdrive.run.job import RunConfig, run_offline  # noqa: E402
from overdrive.techniques.batching.length_bucketing import LengthBucketingConfig  # noqa: E402
from overdrive.techniques.runtime.torch_compile import CompileConfig  # noqa: E402
from overdrive.tuning.plan import Plan  # noqa: E402
from overdrive.files.sentences import python_docstring_sentences  # noqa: E402
from overdrive.workloads.user import build_from_import_path  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sentences", type=int, default=600)
    args = parser.parse_args()
    print(f"compile_shapes_cpu: torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC", flush=True)
    workload = build_from_import_path("tests.fixtures.hf_models:bert_classifier")
    sentences = python_docstring_sentences()[:args.sentences]
    lengths = [workload.sample_length(s) for s in sentences]
    print(f"{len(sentences)} sentences, {min(lengths)}–{max(lengths)} tokens (mean {np.mean(lengths):.0f})")
    entries = {"eager fp32": None,
               "compile, static shapes": [LengthBucketingConfig(), CompileConfig(dynamic=False)],
               "compile, dynamic shapes": [LengthBucketingConfig(), CompileConfig()]}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        source = tmp / "sentences.txt"
        source.write_text("".join(s + "\n" for s in sentences))
        plans = {}
        for label, steps in entries.items():
            if steps is not None:
                plans[label] = tmp / f"{label.replace(' ', '_').replace(',', '')}.json"
                Plan(workload="bert_classifier", device="cpu", batch_size=32, steps=steps).save(plans[label])

        graphs = {label: 0 for label in entries}

        def once(label: str) -> tuple[float, np.ndarray]:
            out = tmp / "out.npy"
            summary = run_offline(RunConfig(workload="bert_classifier", input=source, output=out, plan=plans.get(label),
                                            device="cpu", batch_size=32, overwrite=True), workload=workload)
            graphs[label] += summary.recompiles
            return summary.items_per_s, np.load(out)

        first, outputs, rates = {}, {}, {label: [] for label in entries}
        for group in (["eager fp32", "compile, dynamic shapes"], ["compile, static shapes"]):
            torch._dynamo.reset()
            for label in group:
                start = time.perf_counter()
                once(label)
                first[label] = time.perf_counter() - start
            for _ in range(args.repeats):
                for label in group:
                    rate, outputs[label] = once(label)
                    rates[label].append(rate)
    eager = statistics.median(rates["eager fp32"])
    print("\n| entry | items/s (median) | runs | vs eager | max abs diff vs eager | first run incl. compile, s | "
          "graphs compiled during the runs |\n|---|---:|---|---:|---:|---:|---:|")
    for label in entries:
        median = statistics.median(rates[label])
        diff = float(np.abs(outputs[label] - outputs["eager fp32"]).max())
        print(f"| {label} | {median:,.1f} | {', '.join(f'{r:,.0f}' for r in rates[label])} | {median / eager:.2f}× | "
              f"{diff:.1e} | {first[label]:.1f} | {graphs[label]} |")
    ratio = statistics.median(rates["compile, dynamic shapes"]) / eager
    print(f"\ntarget: the compiled plan (dynamic shapes) ≥ eager items/s: {ratio:.2f}× — {'MET' if ratio >= 1 else 'NOT MET'}")


if __name__ == "__main__":
    main()
