#!/usr/bin/env bash
# `make gpu-check`: the prepared check for a lent GPU machine (one H200, lent to some tasks by chance).
# Uses that machine's own python3 and packages (torch 2.11, transformers, torchvision, ...);
# installs nothing. Runs in under 10 minutes (90 s + 2 × 150 s + 90 s + 2 × 60 s caps): the CUDA tests, `optimize resnet50 --device cuda`,
# `optimize bert-base-random --device cuda` (BERT-base shape, random weights; the MiniLM
# package is not on that machine), and 2:4 sparsity with its per-layer speed gate on the same model, and a short bf16 DDP and FSDP
# training run of it through torchrun at world size 1 (the CPU tests cover world size 2). Figures go to $OUT (the device tool brings them back) or
# out/gpu-check, flat, for benchmarks/RESULTS.md.
set -u -o pipefail
OUT_DIR=${OUT:-out/gpu-check}
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
status=0
{
  echo "# gpu-check $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
} 2>&1 | tee "$OUT_DIR/env.txt"

echo "== CUDA tests"
timeout 90 $PY -m pytest -q -m cuda tests -p no:cacheprovider 2>&1 | tail -n 30 | tee "$OUT_DIR/cuda_tests.txt" || status=1

for spec in "resnet50 --batch-size 64" "bert-base-random --batch-size 32 --num-samples 1024"; do
  name=${spec%% *}
  echo "== optimize $spec --device cuda"
  # shellcheck disable=SC2086
  timeout 150 $PY -m overdrive optimize $spec --device cuda --out "$OUT_DIR/runs" 2>&1 | tail -n 60 | tee "$OUT_DIR/optimize_${name}.txt" || status=1
  cp "$OUT_DIR/runs/$name/results.json" "$OUT_DIR/${name}_results.json" 2>/dev/null || status=1
done
echo "== optimize bert-base-random --techniques sparsity-2:4,bf16 --device cuda"
timeout 90 $PY -m overdrive optimize bert-base-random --techniques sparsity-2:4,bf16 --batch-size 32 --num-samples 256 \
  --device cuda --out "$OUT_DIR/runs24" 2>&1 | tail -n 40 | tee "$OUT_DIR/optimize_sparsity24.txt" || status=1
cp "$OUT_DIR/runs24/bert-base-random/results.json" "$OUT_DIR/sparsity24_results.json" 2>/dev/null || status=1
for strategy in ddp fsdp; do
  echo "== train bert-base-random --strategy $strategy --nproc 1 --precision bf16 --device cuda"
  timeout 60 $PY -m overdrive train bert-base-random --device cuda --nproc 1 --strategy $strategy --precision bf16 \
    --steps 20 --batch-size 32 --out "$OUT_DIR/train" 2>&1 | tail -n 12 | tee "$OUT_DIR/train_${strategy}.txt" || status=1
  cp "$OUT_DIR/train/bert-base-random/train/summary.json" "$OUT_DIR/train_${strategy}_summary.json" 2>/dev/null || status=1
done
rm -rf "$OUT_DIR/runs" "$OUT_DIR/runs24" "$OUT_DIR/train"  # nested folders do not come back from the device tool; the flat copies do
exit $status
