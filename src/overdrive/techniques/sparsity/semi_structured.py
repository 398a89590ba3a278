"""2:4 semi-structured sparsity for Linear layers on NVIDIA GPUs with compute capability ≥ 8.0.

In every group of 4 consecutive input weights of a row, the 2 of largest magnitude are kept
(Mishra et al., "Accelerating Sparse Deep Neural Networks", 2021; NVIDIA's ASP recipe), and
the weight is stored with `torch.sparse.to_sparse_semi_structured`, which runs on the sparse
tensor cores (cuSPARSELt, or CUTLASS). Those kernels take fp16/bf16, so a converted layer
computes in bf16 (fp16 where bf16 is missing) and casts its output back to the input dtype.

Per-layer speed gate: each candidate Linear is timed at the shapes it sees on the workload's
samples (its real input, at the workload's batch size), dense in the same half dtype against
2:4 sparse, with CUDA events; a layer whose sparse form is not at least `min_layer_gain`×
faster stays dense and unpruned, and the report says which and by how much. The output layer
is never made sparse, nor is a subclass of nn.Linear (its own forward would be lost). On other
devices the technique is listed as unsupported, not faked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from overdrive.core.timer import Timer
from overdrive.core.workload import Workload
from overdrive.techniques.graph_programs import LINEAR_OPS, missing_layers_reason
from overdrive.techniques.pruning.channels import output_layers
from overdrive.techniques.pruning.recovery import example_inputs
from overdrive.techniques.registry import Stage, Technique, TechniqueConfig, register


@dataclass(frozen=True, kw_only=True)
class Sparsity24Config(TechniqueConfig):
    """Attributes:
    min_layer_gain: a layer is made sparse only when its sparse matmul is at least this many
        times faster than dense at the workload's shapes.
    timing_iterations: timed calls per layer and form (median taken).
    """
    name: ClassVar[str] = "sparsity-2:4"

    min_layer_gain: float = 1.05
    timing_iterations: int = 50

    def __post_init__(self):
        if not self.min_layer_gain > 0:
            raise ValueError(f"Sparsity24Config.min_layer_gain must be > 0, got {self.min_layer_gain}")
        if self.timing_iterations < 1:
            raise ValueError(f"Sparsity24Config.timing_iterations must be ≥ 1, got {self.timing_iterations}")


def mask_2_to_4(weight: torch.Tensor) -> torch.Tensor:
    """Boolean mask [out, in] keeping the 2 largest-magnitude of every 4 consecutive inputs.

    Raises:
        ValueError: `in` is not a multiple of 4.
    """
    out_features, in_features = weight.shape
    if in_features % 4:
        raise ValueError(f"2:4 sparsity needs in_features divisible by 4, got {in_features}")
    groups = weight.detach().abs().reshape(out_features, in_features // 4, 4)
    keep = groups.topk(2, dim=-1).indices
    mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, keep, True)
    return mask.reshape(out_features, in_features)


class SemiStructuredLinear(nn.Module):
    """A Linear whose weight is 2:4 sparse in `dtype`: input [.., in] any float dtype → output [.., out] in it."""

    def __init__(self, linear: nn.Linear, dtype: torch.dtype):
        super().__init__()
        from torch.sparse import to_sparse_semi_structured

        weight = (linear.weight.detach() * mask_2_to_4(linear.weight)).to(dtype)
        self.weight = nn.Parameter(to_sparse_semi_structured(weight), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().to(dtype), requires_grad=False)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = nn.functional.linear(x.reshape(-1, shape[-1]).to(self.weight.dtype), self.weight, self.bias)
        return y.reshape(*shape[:-1], self.out_features).to(x.dtype)


def _time_ms(fn, x: torch.Tensor, iterations: int) -> float:
    """Median milliseconds of `fn(x)` over `iterations` calls (`Timer`: CUDA events), after 5 warm-up calls."""
    timer = Timer(x.device)
    with torch.no_grad():
        for _ in range(5):
            fn(x)
        times = sorted(timer(fn, x)[1] for _ in range(iterations))
    return 1e3 * times[len(times) // 2]


def _set_child(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


@register
class Sparsity24(Technique):
    setup_cost = "search"  # a speed gate per layer
    config_cls = Sparsity24Config
    stage = Stage.PRUNE
    lossless = False
    opt_in = True
    rewrites_modules = True
    devices = ("cuda",)
    description = "2:4 semi-structured sparse Linear layers (sparse tensor cores, cc ≥ 8.0), each kept only where measured faster; opt-in"

    def applicability(self, workload: Workload, device: torch.device) -> str | None:
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 0):
            return f"needs compute capability ≥ 8.0 (sparse tensor cores); this GPU is {major}.{minor}"
        if not hasattr(torch.sparse, "to_sparse_semi_structured"):
            return "this PyTorch build has no torch.sparse.to_sparse_semi_structured"
        if not any(isinstance(m, nn.Linear) for m in workload.model.modules()):
            return missing_layers_reason(workload.model, layers="nn.Linear", ops=LINEAR_OPS,
                                         rewrites="sparsity-2:4 swaps nn.Linear modules for sparse ones")
        if not any(type(m) is nn.Linear for m in workload.model.modules()):
            return "not applicable: its Linear layers are subclasses of nn.Linear, whose own forward a sparse Linear would drop"
        if not any(type(m) is nn.Linear and m.in_features % 4 == 0 for m in workload.model.modules()):
            return "not applicable: no Linear layer with in_features divisible by 4"
        return None

    def describe_report(self, report, fidelity_key):
        """How many Linear layers were made 2:4 sparse, and which stayed dense and why (the speed gate)."""
        dense = [e for e in report["layers"] if e["kept_dense"]]
        text = f"{self.name}: {report['converted']} of {len(report['layers'])} Linear layers made 2:4 sparse ({report['dtype']})"
        if dense:
            text += "; kept dense: " + ", ".join(f"{e['layer']} ({e['reason']})" for e in dense[:6])
            text += f" and {len(dense) - 6} more" if len(dense) > 6 else ""
        return text

    def apply(self, model, config, *, workload, device):
        dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        rows = workload.fixed_batch_size or workload.default_batch_size
        inputs_seen: dict[str, torch.Tensor] = {}
        head = set(map(id, output_layers(model, example_inputs(workload, device))))
        candidates = {name: m for name, m in model.named_modules()
                      if type(m) is nn.Linear and m.in_features % 4 == 0 and id(m) not in head}  # subclasses: own forward

        def record(name):
            return lambda _m, args: inputs_seen.setdefault(name, args[0].detach())

        handles = [m.register_forward_pre_hook(record(name)) for name, m in candidates.items()]
        try:
            with torch.no_grad():
                model(*example_inputs(workload, device, n=min(rows, len(workload.samples))))
        finally:
            for h in handles:
                h.remove()
        layers = []
        for name, linear in candidates.items():
            x = inputs_seen.get(name)
            if x is None:
                continue
            entry = {"layer": name, "shape": [int(x.reshape(-1, x.shape[-1]).shape[0]), linear.in_features, linear.out_features]}
            try:
                sparse = SemiStructuredLinear(linear, dtype)
            except (RuntimeError, ValueError) as exc:  # shape or dtype the sparse kernels refuse
                entry.update(kept_dense=True, reason=f"no 2:4 kernel for this shape: {' '.join(str(exc).split())[:160]}")
                layers.append(entry)
                continue
            dense = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None,
                              device=device, dtype=dtype)
            with torch.no_grad():
                dense.weight.copy_(linear.weight)
                if linear.bias is not None:
                    dense.bias.copy_(linear.bias)
            x_half = x.to(dtype)  # both forms timed on the same half-precision input
            dense_ms = _time_ms(dense, x_half, config.timing_iterations)
            sparse_ms = _time_ms(sparse, x_half, config.timing_iterations)
            entry.update(dense_ms=dense_ms, sparse_ms=sparse_ms, gain=dense_ms / sparse_ms)
            if dense_ms / sparse_ms >= config.min_layer_gain:
                _set_child(model, name, sparse)
                entry["kept_dense"] = False
            else:
                entry.update(kept_dense=True, reason=f"sparse not faster: {dense_ms / sparse_ms:.2f}× dense {dtype}")
            layers.append(entry)
        converted = sum(not e["kept_dense"] for e in layers)
        if not converted:
            measured = ", ".join(f"{e['layer']} {e['gain']:.2f}×" if "gain" in e else f"{e['layer']} (no kernel)" for e in layers)
            raise RuntimeError(f"sparsity-2:4: no layer is {config.min_layer_gain:g}× faster sparse at these shapes "
                               f"({measured or 'no Linear layer measured'}; all stay dense)")
        model.overdrive_report = {"technique": self.name, "source": "2:4 sparsity", "layers": layers,
                                  "converted": converted, "dtype": str(dtype).removeprefix("torch.")}
        return model
