"""MiniLM on 2,048 real sentences at batch 32: overdrive's plan against the usual anchors, in one run.

Entries (all on the same sentences, same batch size, same measurement protocol as
`overdrive.core.measure`: warm-up pass apart, then a timed pass, throughput over the whole pass):
  PyTorch eager fp32 (input order) · bf16 autocast · int8 dynamic (torch.ao) · torch.compile ·
  ONNX Runtime fp32 · ONNX Runtime int8 (dynamic, onnxruntime.quantization) · overdrive's plan.
The plan is the one in --plan, or else the one `overdrive optimize minilm` chooses here (tuned on
the first 512 sentences, then measured on all 2,048). Min cosine is against eager fp32.

Target (issue 2): the plan is the fastest entry with min cosine ≥ 0.99, at ≥ 1.3× the best other
entry that meets the same floor.

    .venv/bin/python benchmarks/minilm_cpu.py [--plan out/minilm/plan.json] [--num-sentences 2048]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from overdrive.core.measure import measure  # noqa: E402
from overdrive.techniques import (
    BatchingPolicy,  # noqa: E402
    default_config,  # noqa: E402
)
from overdrive.tuning.plan import Plan
from overdrive.techniques.compose import build
from overdrive.tuning.tuner import Tuner  # noqa: E402
from overdrive.workloads.minilm import build_minilm  # noqa: E402

FLOOR = 0.99
TARGET_RATIO = 1.3
CPU = torch.device("cpu")


class OrtModule(nn.Module):
    """An ONNX Runtime session behind the nn.Module call convention, so `measure` times it the same way."""

    def __init__(self, path: Path):
        super().__init__()
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = torch.get_num_threads()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])

    def forward(self, input_ids, attention_mask):
        (out,) = self.session.run(None, {"input_ids": input_ids.numpy(), "attention_mask": attention_mask.numpy()})
        return torch.from_numpy(out)


def export_onnx(model: nn.Module, example: tuple[torch.Tensor, torch.Tensor], folder: Path) -> tuple[Path, Path]:
    """Export fp32 ONNX (dynamic batch and sequence axes) and a dynamically quantized int8 copy."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    fp32 = folder / "minilm.onnx"
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq")
    torch.onnx.export(model, example, str(fp32), input_names=["input_ids", "attention_mask"], output_names=["sentence_embedding"],
                      dynamic_shapes={"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}},
                      dynamo=True, external_data=False)
    int8 = folder / "minilm.int8.onnx"
    quantize_dynamic(str(fp32), str(int8), weight_type=QuantType.QInt8)
    return fp32, int8


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", type=Path, help="plan.json from `overdrive optimize minilm` (default: tune here)")
    parser.add_argument("--num-sentences", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()

    workload = build_minilm(num_sentences=args.num_sentences)
    indices = list(range(len(workload.samples)))
    bs = args.batch_size
    print(f"minilm: {len(indices)} real sentences, batch {bs}, {torch.get_num_threads()} threads, torch {torch.__version__}")

    if args.plan:
        plan = Plan.load(args.plan)
        tune_s = 0.0
    else:
        t0 = time.perf_counter()
        tuned = Tuner(workload=workload, device=CPU, batch_size=bs, num_samples=512).run()
        plan = tuned.plan
        tune_s = time.perf_counter() - t0
        for row in tuned.rows:
            figure = f"{row.measurement.samples_per_s:.1f} sentences/s" if row.measurement else ""
            print(f"  tuner: {row.label:<28} {figure:>20}  {'kept' if row.kept else row.reason}")
    print(f"plan: {' + '.join(plan.names) or 'baseline'}" + (f" (tuned in {tune_s:.0f} s)" if tune_s else ""))

    entries: dict[str, callable] = {
        "PyTorch eager fp32": lambda: build(workload, [], CPU),
        "bf16 autocast": lambda: build(workload, [default_config("bf16")], CPU),
        "int8 dynamic (torch.ao)": lambda: build(workload, [default_config("int8-dynamic")], CPU),
        "torch.compile": lambda: build(workload, [default_config("compile")], CPU),
    }
    with tempfile.TemporaryDirectory() as tmp:
        example = workload.collate(list(workload.samples[:2]))
        try:
            fp32_path, int8_path = export_onnx(workload.model, example, Path(tmp))
            entries["ONNX Runtime fp32"] = lambda: (OrtModule(fp32_path), BatchingPolicy())
            entries["ONNX Runtime int8"] = lambda: (OrtModule(int8_path), BatchingPolicy())
        except Exception as exc:  # noqa: BLE001 - report, and go on with the other entries
            print(f"ONNX export failed, ONNX Runtime entries skipped: {type(exc).__name__}: {exc}", file=sys.stderr)
        entries["overdrive plan"] = lambda: plan.build(workload, CPU)

        results = {}
        reference = None
        for label, make in entries.items():
            model, policy = make()
            m, out = measure(model, workload, device=CPU, batch_size=bs, indices=indices, policy=policy,
                             reference=reference, min_timed_calls=len(indices) // bs, max_timed_s=120)
            if reference is None:
                reference, m.fidelity = out, workload.fidelity(out, out)
            results[label] = m
            print(f"  {label}: {m.samples_per_s:.1f} sentences/s, min cosine {m.fidelity['min_cosine']:.5f}", flush=True)
            del model
            torch.compiler.reset()

    base = results["PyTorch eager fp32"].samples_per_s
    print("\n| entry | sentences/s | speedup vs eager | min cosine | p50 ms/batch | compile/warm-up s |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, m in results.items():
        print(f"| {label} | {m.samples_per_s:.1f} | {m.samples_per_s / base:.2f}× | {m.fidelity['min_cosine']:.5f} "
              f"| {m.latency_ms['p50']:.1f} | {m.compile_s:.1f} |")
    passing = {k: m.samples_per_s for k, m in results.items() if m.fidelity["min_cosine"] >= FLOOR}
    others = {k: v for k, v in passing.items() if k != "overdrive plan"}
    plan_ok = "overdrive plan" in passing
    best_other = max(others, key=others.get) if others else None
    ratio = passing["overdrive plan"] / others[best_other] if plan_ok and best_other else float("nan")
    met = plan_ok and ratio >= TARGET_RATIO
    print(f"\nplan vs best other entry with min cosine ≥ {FLOOR} ({best_other}): {ratio:.2f}× "
          f"(target ≥ {TARGET_RATIO}×): {'MET' if met else 'NOT MET'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
