"""One linear layer in each low-precision form on this CPU: microseconds per call at decode's row counts.

The shapes are a ~150 M Llama's (hidden 768, MLP 2048, vocabulary 32000). Entries: float32 (`F.linear`), the
forms of `overdrive.generate.quantize` (int8-weight through `_weight_int8pack_mm`, fp16-weight through FBGEMM,
int8-rowwise through `torch._int_mm`), and two kernels overdrive does not offer as forms, timed to say why:
PyTorch's int4 weight-only CPU kernel (`_weight_int4pack_mm_for_cpu`, groups of 128, asymmetric) and FBGEMM's
dynamic int8 (`quantize_dynamic`: one activation scale shared by every row of a call, so a row's answer
depends on its batch-mates). Each figure is the median of 5 runs of 100 calls, entries interleaved per shape.

    .venv/bin/python benchmarks/linear_forms_cpu.py [--rows 1,16]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time

import torch
from torch import nn

from overdrive.generate.quantize import FORMS, convert_linear

SHAPES = [(2048, 768), (768, 2048), (32000, 768)]  # (out, in): MLP up/gate, MLP down, LM head


def _time(fn, calls: int = 100) -> float:
    for _ in range(5):
        fn()
    runs = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - started) / calls * 1e6)
    return statistics.median(runs)


def _int4(weight: torch.Tensor, group: int = 128):
    """PyTorch's int4 CPU packing (as its tests do): 4-bit codes per group of `group` inputs, a scale and a zero each."""
    n, k = weight.shape
    g = weight.reshape(n, k // group, group)
    high, low = g.amax(-1, keepdim=True), g.amin(-1, keepdim=True)
    scales = (high - low).clamp(min=1e-6) / 15
    zeros = low + scales * 8
    codes = ((g - low) / scales).round().clamp(0, 15).to(torch.int32).reshape(n, k)
    scales_zeros = torch.cat([scales.reshape(n, -1, 1), zeros.reshape(n, -1, 1)], 2).transpose(0, 1).contiguous()
    packed = torch._convert_weight_to_int4pack_for_cpu(codes, 2)
    return lambda x: torch._weight_int4pack_mm_for_cpu(x, packed, group, scales_zeros)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,16")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"linear_forms_cpu {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC · torch {torch.__version__} · "
          f"{torch.get_num_threads()} threads · µs per call (median of 5 × 100)")
    names = ["float32", *FORMS, "int4-weight (g128)", "fbgemm-dynamic (per-tensor)"]
    print("out × in | rows | " + " | ".join(names))
    for out_f, in_f in SHAPES:
        linear = nn.Linear(in_f, out_f, bias=False)
        with torch.no_grad():
            linear.weight.mul_(0.5)
        calls = {"float32": linear, **{f: convert_linear(linear, f) for f in FORMS}, "int4-weight (g128)": _int4(linear.weight.detach()),
                 "fbgemm-dynamic (per-tensor)": torch.ao.quantization.quantize_dynamic(nn.Sequential(linear), {nn.Linear},
                                                                                        dtype=torch.qint8)}
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, in_f)
            with torch.inference_mode():
                figures = {name: _time(lambda f=fn: f(x)) for name, fn in calls.items()}
            base = figures["float32"]
            print(f"{out_f} × {in_f} | {rows} | " + " | ".join(
                f"{figures[n]:.0f}" + ("" if n == "float32" else f" ({base / figures[n]:.2f}×)") for n in names), flush=True)


if __name__ == "__main__":
    main()
