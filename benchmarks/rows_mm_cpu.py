"""overdrive's row kernels (`generate/rows_mm.py`) against PyTorch's products, over a decoder's layers, on the CPU.

Every linear layer of a random-weight built-in (default llama-125m-random: 85 layers, 100 M weights; speed only)
called once per sweep, as a decode step calls them (the weights streamed from memory, not cached), at each row
count: float32 `F.linear` (`aten.mm`: MKL/oneDNN) against `float_rows_mm`, and int8 `torch._int_mm` (oneDNN)
against `int8_rows_mm` and against float32 GEMMs over exact spans (int8-rowwise's path beyond the kernel's rows on
AVX2, `quantize.exact_float_spans`): the same exact integer products. Entries interleaved in each repeat; the
median sweep time with its range, and each kernel's ratio to PyTorch's.

    .venv/bin/python benchmarks/rows_mm_cpu.py [--shape llama-125m-random] [--rows 1,4,16,64,256,512] [--repeats 5]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time

import torch
import torch.nn.functional as F


def layer_shapes(shape: str) -> list[tuple[int, int]]:
    import transformers

    from overdrive.workloads.generation import RANDOM_LMS

    family, config = RANDOM_LMS[shape]
    with torch.device("meta"):
        model = (transformers.GPT2LMHeadModel(transformers.GPT2Config(**config)) if family == "gpt2" else
                 transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)))
    return [tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear)]


def main() -> None:
    from overdrive.generate import rows_mm
    from overdrive.generate.quantize import exact_float_spans

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="llama-125m-random")
    parser.add_argument("--rows", default="1,4,16,64,256,512")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    ok, why = rows_mm.available()
    if not ok:
        raise SystemExit(f"overdrive's row kernels are not built here: {why}")
    shapes = layer_shapes(args.shape)
    torch.manual_seed(0)
    floats = [torch.randn(s) for s in shapes]
    ints = [torch.randint(-127, 128, s, dtype=torch.int8) for s in shapes]
    sums = [w.sum(1, dtype=torch.int32) for w in ints]
    now = datetime.datetime.now(datetime.timezone.utc)
    print(f"rows_mm_cpu {now:%Y-%m-%d %H:%M} UTC · torch {torch.__version__} · "
          f"{torch.get_num_threads()} threads · {rows_mm.ISA} · {args.shape}: {len(shapes)} layers, "
          f"{sum(o * i for o, i in shapes) / 1e6:.0f} M weights")
    for rows in map(int, args.rows.split(",")):
        xf = {k: torch.randn(rows, k) for k in {i for _, i in shapes}}
        xi = {k: torch.randint(-127, 128, (rows, k), dtype=torch.int8) for k in xf}
        entries = {
            "float32 aten.mm": lambda: [F.linear(xf[w.shape[1]], w) for w in floats],
            "float32 float_rows_mm": lambda: [rows_mm.FLOAT_OP(xf[w.shape[1]], w) for w in floats],
            "int8 _int_mm": lambda: [torch._int_mm(xi[w.shape[1]], w.t()) for w in ints],
            "int8 int8_rows_mm": lambda: [rows_mm.OP(xi[w.shape[1]], w, s) for w, s in zip(ints, sums)],
            "int8 float spans": lambda: [exact_float_spans(xi[w.shape[1]], w) for w in ints],
        }
        times: dict[str, list[float]] = {name: [] for name in entries}
        for name, run in entries.items():  # warm-up
            run()
        for _ in range(args.repeats):
            for name, run in entries.items():
                started = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - started)
        med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        print(f"rows {rows}:")
        for name, t in times.items():
            base = med["float32 aten.mm" if name.startswith("float32") else "int8 _int_mm"]
            print(f"  {name:22} {med[name]:8.1f} ms [{min(t) * 1e3:.1f}, {max(t) * 1e3:.1f}]  "
                  f"{base / med[name]:5.2f}× PyTorch's")


if __name__ == "__main__":
    main()
