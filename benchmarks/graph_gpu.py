"""The GPU side of the graph: CUDA graphs, compile modes and concurrent streams, against eager, in one run.

resnet50 (torchvision, random weights: speed only) at each batch size, every entry on the same
images with the same batching, timed in interleaved rounds (one timed pass of every entry per
round, in a shuffled order), with the copy / sync / launch audit of one forward and the roofline
point against the peaks measured at start-up:
  eager fp32 · bf16 + channels-last (eager) · + cuda-graphs · + compile · + compile(reduce-overhead)
  [· + compile(max-autotune) with --max-autotune] · + compile + cuda-graphs
Compile entries run at the batch sizes in --compile-batch-sizes only (each is a compile per size).

A two-tower model (`two_tower` below; the user and item towers share no data path until their dot
product) at batch 8 and 64: eager vs concurrent-streams vs concurrent-streams + cuda-graphs.

Goals (issue 19): cuda-graphs ≥ 1.5× eager at batch 1 on resnet50; the bf16 entry at batch 256
≥ 60% of its roof (the measured bf16 GEMM peak; the roofline column).

    python benchmarks/graph_gpu.py [--device cuda] [--batch-sizes 1,8,256] [--compile-batch-sizes 1,8] [--rounds 5]
        [--max-autotune] [--skip-two-tower]

`overdrive optimize benchmarks.graph_gpu:two_tower --device cuda` tunes the same two-tower model.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch
from torch import nn

from overdrive.core.audit import audit_forward
from overdrive.core.measure import Runner
from overdrive.core.roofline import describe_peaks, roofline_cell
from overdrive.techniques import default_config
from overdrive.techniques.runtime.torch_compile import CompileConfig, CompileMode
from overdrive.techniques.compose import build

MIN_GRAPHS_GAIN = 1.5
MIN_ROOF_FRACTION = 0.6


class Tower(nn.Module):
    def __init__(self, d_in: int, width: int, depth: int):
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(d_in, width), nn.GELU()]
        for _ in range(depth - 1):
            layers += [nn.Linear(width, width), nn.GELU()]
        self.body = nn.Sequential(*layers, nn.LayerNorm(width))

    def forward(self, x):
        return self.body(x)


class TwoTower(nn.Module):
    """A retrieval model's user and item towers (different depths), joined by their dot product: [B, 1]."""

    def __init__(self, width: int = 1024):
        super().__init__()
        self.user = Tower(256, width, 6)
        self.item = Tower(384, width, 4)

    def forward(self, user, item):
        return (self.user(user) * self.item(item)).sum(-1, keepdim=True)


def two_tower():
    """The factory `overdrive optimize benchmarks.graph_gpu:two_tower` takes: (model, example inputs)."""
    torch.manual_seed(0)
    return TwoTower().eval(), (torch.randn(8, 256), torch.randn(8, 384))


def entries_for(batch_size: int, compile_sizes: set[int], max_autotune: bool) -> dict[str, list]:
    bf16, cl, graphs = default_config("bf16"), default_config("channels-last"), default_config("cuda-graphs")
    out = {"eager fp32": [], "bf16 + channels-last": [bf16, cl], "bf16 + channels-last + cuda-graphs": [bf16, cl, graphs]}
    if batch_size in compile_sizes:
        out["bf16 + channels-last + compile"] = [bf16, cl, CompileConfig(dynamic=False)]
        out["bf16 + channels-last + compile(reduce-overhead)"] = [bf16, cl, CompileConfig(mode=CompileMode.REDUCE_OVERHEAD,
                                                                                         dynamic=False)]
        if max_autotune:
            out["bf16 + channels-last + compile(max-autotune)"] = [bf16, cl, CompileConfig(mode=CompileMode.MAX_AUTOTUNE,
                                                                                          dynamic=False)]
        out["bf16 + channels-last + compile + cuda-graphs"] = [bf16, cl, CompileConfig(dynamic=False), graphs]
    return out


def measure(workload, entries: dict[str, list], *, device, batch_size: int, rounds: int, rows: int, flops: float | None):
    """Build and warm up every entry, then interleaved rounds. Returns the table's rows."""
    indices = [i % len(workload.samples) for i in range(max(rows, batch_size))]
    runners, compile_s, audits, fidelity = {}, {}, {}, {}
    reference = None
    for label, steps in entries.items():
        try:
            model, policy = build(workload, steps, device)
            runner = Runner(model, workload, device=device, batch_size=batch_size, indices=indices, policy=policy)
            start = time.perf_counter()
            out = runner.warm_up()
            compile_s[label] = time.perf_counter() - start
            reference = out if reference is None else reference
            fidelity[label] = workload.fidelity(out, reference)
            audits[label] = audit_forward(runner.model, runner.batches[0].inputs, device=device)
            runners[label] = runner
        except Exception as exc:  # noqa: BLE001 - one failing entry is a line, not a lost run
            print(f"  {label} at batch {batch_size} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}",
                  flush=True)
    per_pass: dict[str, list[float]] = {label: [] for label in runners}
    for _ in range(rounds):
        order = list(runners)
        random.shuffle(order)
        for label in order:
            per_pass[label].append(runners[label].rows_per_pass / runners[label].timed_pass())
    table = []
    base = statistics.median(per_pass["eager fp32"]) if "eager fp32" in per_pass else None
    for label, runner in runners.items():
        rate = statistics.median(per_pass[label])
        dtype = "bfloat16" if "bf16" in label else "float32"
        point = runner.roofline(flops, dtype, rate)
        a = audits[label]
        table.append({"entry": label, "batch": batch_size, "samples/s": rate, "min": min(per_pass[label]),
                      "max": max(per_pass[label]), "vs eager": rate / base if base else None,
                      "p50 ms": 1e3 * statistics.median(runner.latencies_s), "roofline": roofline_cell(point),
                      "roofline_fraction": point["fraction"] if point else None,
                      "launches": a.kernel_launches, "graph launches": a.graph_launches, "syncs": a.device_syncs,
                      "warm-up s": compile_s[label], "fidelity": fidelity[label]})
        runner.model = None
    torch.compiler.reset()
    return table


def print_table(table: list[dict]) -> None:
    print("| entry | batch | samples/s median [min, max] | × eager fp32 | p50 ms | roofline | kernel launches | "
          "graph launches | device syncs | warm-up s | fidelity |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in table:
        fid = ", ".join(f"{k} {v:.5f}" for k, v in r["fidelity"].items() if isinstance(v, float))
        gain = f"{r['vs eager']:.2f}×" if r["vs eager"] else ""
        print(f"| {r['entry']} | {r['batch']} | {r['samples/s']:,.1f} [{r['min']:,.1f}, {r['max']:,.1f}] | {gain} | "
              f"{r['p50 ms']:.2f} | {r['roofline']} | {r['launches']} | {r['graph launches']} | {r['syncs']} | "
              f"{r['warm-up s']:.1f} | {fid} |", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch-sizes", default="1,8,256")
    parser.add_argument("--compile-batch-sizes", default="1,8")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rows", type=int, default=256, help="rows per timed pass (at least one batch)")
    parser.add_argument("--max-autotune", action="store_true")
    parser.add_argument("--skip-two-tower", action="store_true")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    from overdrive.core.flops import count_flops_per_sample
    from overdrive.tuning.api import as_workload
    from overdrive.workloads import create_workload

    print(f"# graph_gpu — {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, torch {torch.__version__}",
          flush=True)
    workload = create_workload("resnet50")
    flops = count_flops_per_sample(workload.model.to(device), workload, device=device, indices=[0, 1])
    workload.model.cpu()
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    compile_sizes = {int(b) for b in args.compile_batch_sizes.split(",") if b}
    results = []
    for b in sizes:
        entries = entries_for(b, compile_sizes, args.max_autotune)
        if device.type != "cuda":
            entries = {k: v for k, v in entries.items() if "cuda-graphs" not in k and "reduce-overhead" not in k}
        table = measure(workload, entries, device=device, batch_size=b, rounds=args.rounds, rows=args.rows, flops=flops)
        print_table(table)
        results += table
    print(f"measured peaks: {describe_peaks(device)}", flush=True)
    verdicts = []
    graphs_b1 = next((r for r in results if r["batch"] == 1 and r["entry"] == "bf16 + channels-last + cuda-graphs"), None)
    if graphs_b1:
        verdicts.append(f"cuda-graphs at batch 1: {graphs_b1['vs eager']:.2f}× eager fp32 (goal ≥ {MIN_GRAPHS_GAIN}×)")
    bf16_256 = next((r for r in results if r["batch"] == 256 and r["entry"] == "bf16 + channels-last"), None)
    if bf16_256 and bf16_256["roofline_fraction"]:
        verdicts.append(f"bf16 at batch 256: {100 * bf16_256['roofline_fraction']:.0f}% of its roof "
                        f"(goal ≥ {100 * MIN_ROOF_FRACTION:.0f}%)")
    if not args.skip_two_tower and device.type == "cuda":
        model, example = two_tower()
        tower_workload = as_workload(model, example)
        tower_flops = count_flops_per_sample(tower_workload.model.to(device), tower_workload, device=device,
                                             indices=[0])
        tower_workload.model.cpu()
        streams, graphs = default_config("concurrent-streams"), default_config("cuda-graphs")
        for b in (8, 64):
            table = measure(tower_workload, {"eager fp32": [], "concurrent-streams": [streams],
                                             "cuda-graphs": [graphs], "concurrent-streams + cuda-graphs": [streams, graphs]},
                            device=device, batch_size=b, rounds=args.rounds, rows=max(256, b), flops=tower_flops)
            print_table(table)
    for line in verdicts:
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
