#!/usr/bin/env bash
# `make gpu-check`: the prepared check for a lent GPU machine (one H200, lent to some tasks by chance).
# Uses that machine's own python3 and packages (torch 2.11, transformers, torchvision, ...);
# installs nothing. Runs in under 13 minutes (90 s + 2 × 150 s + 90 s + 2 × 60 s + 60 s + 150 s caps): the CUDA tests, `optimize resnet50 --device cuda`,
# `optimize bert-base-random --device cuda` (BERT-base shape, random weights; the MiniLM
# package is not on that machine), and 2:4 sparsity with its per-layer speed gate on the same model, and a short bf16 DDP and FSDP
# training run of it through torchrun at world size 1 (the CPU tests cover world size 2), and `overdrive run resnet50`
# over generated images, which reports the fraction of wall time the GPU was busy. Figures go to $OUT (the device tool brings them back) or
# out/gpu-check, flat, for benchmarks/RESULTS.md.
set -u -o pipefail
OUT_DIR=${OUT:-out/gpu-check}
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
# ONLY="tests run" runs just those parts (tests optimize sparsity train run backends precision graph serve serve-generate); the whole check is longer than
# one device loan of 15 minutes can hold with its start-up, so a loan runs the parts its issue needs.
ONLY=${ONLY:-tests optimize sparsity train run}
want() { [[ " $ONLY " == *" $1 "* ]]; }
status=0
{
  echo "# gpu-check $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
} 2>&1 | tee "$OUT_DIR/env.txt"

if want tests; then
echo "== CUDA tests"
timeout 90 $PY -m pytest -q -m cuda tests -p no:cacheprovider 2>&1 | tail -n 30 | tee "$OUT_DIR/cuda_tests.txt" || status=1
fi

want optimize && for spec in "resnet50 --batch-size 64" "bert-base-random --batch-size 32 --num-samples 1024"; do
  name=${spec%% *}
  echo "== optimize $spec --device cuda"
  # shellcheck disable=SC2086
  timeout 150 $PY -m overdrive optimize $spec --device cuda --overwrite --out "$OUT_DIR/runs" 2>&1 | tail -n 60 | tee "$OUT_DIR/optimize_${name}.txt" || status=1
  cp "$OUT_DIR/runs/$name/results.json" "$OUT_DIR/${name}_results.json" 2>/dev/null || status=1
done
if want sparsity; then
echo "== optimize bert-base-random --techniques sparsity-2:4,bf16 --device cuda"
timeout 90 $PY -m overdrive optimize bert-base-random --overwrite --techniques sparsity-2:4,bf16 --batch-size 32 --num-samples 256 \
  --device cuda --out "$OUT_DIR/runs24" 2>&1 | tail -n 40 | tee "$OUT_DIR/optimize_sparsity24.txt" || status=1
cp "$OUT_DIR/runs24/bert-base-random/results.json" "$OUT_DIR/sparsity24_results.json" 2>/dev/null || status=1
fi
want train && for strategy in ddp fsdp; do
  echo "== train bert-base-random --strategy $strategy --nproc 1 --precision bf16 --device cuda"
  timeout 60 $PY -m overdrive train bert-base-random --device cuda --nproc 1 --strategy $strategy --precision bf16 \
    --steps 20 --batch-size 32 --out "$OUT_DIR/train" 2>&1 | tail -n 12 | tee "$OUT_DIR/train_${strategy}.txt" || status=1
  cp "$OUT_DIR/train/bert-base-random/train/summary.json" "$OUT_DIR/train_${strategy}_summary.json" 2>/dev/null || status=1
done
if want run; then
echo "== run resnet50 --device cuda --batch-size auto over 8,192 generated JPEG images"
timeout 60 $PY - <<'PY' || status=1
import os, numpy as np
from concurrent.futures import ProcessPoolExecutor
from PIL import Image
def make(i):
    rng = np.random.default_rng(i)
    base = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)  # smooth, photo-like content (noise JPEGs decode slower than photos)
    Image.fromarray(base).resize((256, 256), Image.Resampling.BICUBIC).save(f"/tmp/od_images/{i:05d}.jpg", quality=90)
os.makedirs("/tmp/od_images", exist_ok=True)
with ProcessPoolExecutor() as pool:
    list(pool.map(make, range(8192), chunksize=256))
PY
timeout 150 $PY -m overdrive run resnet50 --device cuda --input /tmp/od_images --output /tmp/od_logits.npy --batch-size auto \
  --overwrite 2>&1 | tail -n 25 | tee "$OUT_DIR/run_resnet50.txt" || status=1
fi
if want backends; then
# ONLY=backends (≤ 4 minutes): resnet50 and bert-base-random through ONNX Runtime (CUDA provider, and the
# TensorRT provider where the onnxruntime build has it, IOBinding on device memory) and torch-tensorrt when
# installed (else listed as unsupported with the reason), each against eager fp32 and bf16 in one optimize run.
$PY -c "import onnxruntime as o; print('onnxruntime', o.__version__, o.get_available_providers())" 2>&1 | tee "$OUT_DIR/backends_env.txt"
for spec in "resnet50 --batch-size 64 --num-samples 512" "bert-base-random --batch-size 32 --num-samples 512"; do
  name=${spec%% *}
  echo "== optimize $spec --techniques bf16,onnxruntime,tensorrt --device cuda"
  # shellcheck disable=SC2086
  timeout 110 $PY -m overdrive optimize $spec --techniques bf16,onnxruntime,tensorrt --device cuda --overwrite \
    --out "$OUT_DIR/runsb" 2>&1 | tail -n 40 | tee "$OUT_DIR/backends_${name}.txt" || status=1
  cp "$OUT_DIR/runsb/$name/results.json" "$OUT_DIR/backends_${name}_results.json" 2>/dev/null || status=1
done
fi
if want precision; then
# ONLY=precision (≤ 4 minutes): bert-base-random with mixed-int8 and mixed-fp8 searched per layer (torchao when the
# machine has it, else per-row int8 through torch._int_mm; fp8 needs torchao and compute capability ≥ 8.9) against bf16
# and fp16 in one optimize run, and the CUDA tests of the precision techniques. resnet50 is left out: mixed-* switch
# nn.Linear layers only (its one fc layer) and its random-image workload has no training rows to search on.
$PY -c "import torchao; print('torchao', torchao.__version__)" 2>&1 | tail -n 1 | tee "$OUT_DIR/precision_env.txt"
timeout 60 $PY -m pytest -q -m cuda tests/test_mixed_precision.py -p no:cacheprovider 2>&1 | tail -n 15 \
  | tee "$OUT_DIR/precision_tests.txt" || status=1
echo "== optimize bert-base-random --techniques bf16,fp16,mixed-int8,mixed-fp8 --device cuda"
timeout 170 $PY -m overdrive optimize bert-base-random --batch-size 32 --num-samples 512 --techniques bf16,fp16,mixed-int8,mixed-fp8 \
  --device cuda --overwrite --out "$OUT_DIR/runsp" 2>&1 | tail -n 60 | tee "$OUT_DIR/precision_bert.txt" || status=1
cp "$OUT_DIR/runsp/bert-base-random/results.json" "$OUT_DIR/precision_bert_results.json" 2>/dev/null || status=1
fi
if want graph; then
# ONLY=graph (≤ 4 minutes): the CUDA tests of cuda-graphs, concurrent streams and the audit; benchmarks/graph_gpu.py on
# resnet50 at batch 1, 8 and 256 (eager, bf16 + channels-last, + cuda-graphs, with the audit's launch counts and the
# roofline column), then the compile modes at batch 1 (each a resnet50 compile), then `optimize` on the two-tower model.
timeout 30 $PY -m pytest -q -m cuda tests/test_graph_parallel.py tests/test_graph_audit.py -p no:cacheprovider 2>&1 \
  | tail -n 15 | tee "$OUT_DIR/graph_tests.txt" || status=1
echo "== benchmarks/graph_gpu.py --batch-sizes 1,8,256 (no compile) and the two-tower model"
timeout 90 $PY benchmarks/graph_gpu.py --batch-sizes 1,8,256 --compile-batch-sizes "" 2>&1 | tee "$OUT_DIR/graph_gpu.txt" || status=1
echo "== benchmarks/graph_gpu.py --batch-sizes 1 --compile-batch-sizes 1 (compile modes)"
timeout 100 $PY benchmarks/graph_gpu.py --batch-sizes 1 --compile-batch-sizes 1 --skip-two-tower 2>&1 \
  | tee "$OUT_DIR/graph_gpu_compile.txt" || status=1
echo "== optimize benchmarks.graph_gpu:two_tower --techniques bf16,concurrent-streams,cuda-graphs --device cuda"
timeout 50 $PY -m overdrive optimize benchmarks.graph_gpu:two_tower --batch-size 8 --techniques bf16,concurrent-streams,cuda-graphs \
  --device cuda --overwrite --out "$OUT_DIR/runsg" 2>&1 | tail -n 40 | tee "$OUT_DIR/graph_two_tower.txt" || status=1
cp "$OUT_DIR/runsg/two_tower/results.json" "$OUT_DIR/graph_two_tower_results.json" 2>/dev/null || status=1
fi
rm -rf "$OUT_DIR/runs" "$OUT_DIR/runs24" "$OUT_DIR/train" "$OUT_DIR/runsb" "$OUT_DIR/runsp" "$OUT_DIR/runsg"  # nested folders do not come back from the device tool; the flat copies do
if want serve; then
echo "== serve: resnet50 bf16 plan on cuda, adaptive batching vs batching off at 1, 32, 128 clients"
# The CUDA image has no starlette or uvicorn: carry them as wheels (scripts/gpu_wheels.sh fetches them into .whl).
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
timeout 240 $PY benchmarks/serve_gpu.py --seconds 5 --out "$OUT_DIR" 2>&1 | tail -n 20 | tee "$OUT_DIR/serve_gpu.txt" || status=1
rm -rf "$OUT_DIR/serve_gpu"
fi
if want serve-generate; then
# ONLY=serve-generate (≤ 4 minutes): the generation server on llama-1b-random (Llama 3.2 1B's shape, random weights) in
# bf16, continuous batching against static batching and one request at a time at 1, 32 and 128 streams
# (benchmarks/serve_generate_cpu.py --device cuda; the decode step eager: a compiled one builds a graph per batch size).
echo "== serve-generate: llama-1b-random bf16 on cuda, continuous / static / one-at-a-time at 1, 32, 128 streams"
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
timeout 60 $PY -m pytest -q -m cuda tests/test_generate_continuous.py -p no:cacheprovider 2>&1 | tail -n 8 \
  | tee "$OUT_DIR/serve_generate_tests.txt" || status=1
timeout 200 $PY benchmarks/serve_generate_cpu.py --workload llama-1b-random --device cuda --dtype bfloat16 --no-compile \
  --streams 1,32,128 --requests 128 --max-new 32 --think-ms 0 --entries continuous,static,one-at-a-time 2>&1 \
  | grep -v Warning | tail -n 14 | tee "$OUT_DIR/serve_generate_gpu.txt" || status=1
fi

exit $status
