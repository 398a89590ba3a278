"""The copy and sync audit (`core.audit`) and the roofline arithmetic (`core.roofline`)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from overdrive.core.audit import audit_forward
from overdrive.core.roofline import Roofline, roofline, roofline_cell, tensors_bytes, weight_bytes
from tests.conftest import requires_cuda

CPU = torch.device("cpu")


class Planted(nn.Module):
    """A forward with one of each: a scalar read, a nonzero, a boolean mask, a tensor from host data, a .cpu()."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        y = self.fc(x)
        if y.abs().sum().item() > 1e9:  # a scalar read: the host waits for the device
            y = y * 2
        _ = (y > 0).nonzero()
        _ = y[y > 0]
        offset = torch.tensor([1.0, 2.0, 3.0, 4.0], device=x.device)  # host data to the device: a copy
        _ = y.cpu()  # a device→host copy and a sync on a GPU
        return y + offset


class Clean(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return torch.relu(self.fc(x))


def test_audit_counts_the_planted_copies_and_syncs():
    audit = audit_forward(Planted().eval(), (torch.randn(3, 8),), device=CPU)
    assert audit.h2d_copies == 1 and audit.h2d_bytes == 16
    assert audit.d2h_copies == 1 and audit.d2h_bytes == 3 * 4 * 4
    assert audit.syncs == {"scalar read (.item(), bool(), int(), float())": 1, "data-dependent shape (nonzero)": 1,
                           "data-dependent shape (boolean-mask indexing)": 1, ".cpu()": 1}
    assert audit.num_syncs == 4
    assert (audit.input_tensors, audit.input_bytes, audit.output_tensors, audit.output_bytes) == (1, 96, 1, 48)
    assert audit.kernel_launches is None  # the profiler's counts are CUDA-only
    assert "scalar read" in audit.describe()


def test_audit_of_a_clean_model_finds_nothing_and_a_compiled_one_is_not_recompiled():
    model = Clean().eval()
    audit = audit_forward(model, (torch.randn(3, 8),), device=CPU)
    assert (audit.h2d_copies, audit.d2h_copies, audit.num_syncs) == (0, 0, 0)
    assert audit.aten_ops == 2  # addmm, relu: views and metadata are not counted
    from overdrive.core.measure import compiled_graphs

    compiled = torch.compile(Clean().eval())
    x = torch.randn(3, 8)
    with torch.no_grad():  # as every caller runs it
        compiled(x)
    graphs = compiled_graphs()
    assert audit_forward(compiled, (x,), device=CPU).aten_ops == 2
    with torch.no_grad():
        compiled(x)
    assert compiled_graphs() == graphs  # audited eagerly, no recompilation


def test_audit_sees_a_scalar_read_through_bool_and_int():
    class Branchy(nn.Module):
        def forward(self, x):
            n = int(x.shape[0] * x.mean().abs().ceil())
            return x * 2 if bool(x.sum() > 0) else x[:n]

    audit = audit_forward(Branchy(), (torch.ones(2, 3),), device=CPU)
    assert audit.syncs == {"scalar read (.item(), bool(), int(), float())": 2}


def test_roofline_arithmetic_compute_and_memory_bound():
    # 1 GFLOP per sample, 1 MB per batch of 10: intensity 1e4 FLOP/byte; roofs 1e12 FLOP/s and 1e11 B/s.
    compute = roofline(flops_per_sample=1e9, bytes_per_batch=1e6, batch_size=10, samples_per_s=500,
                       peak_flops_per_s=1e12, peak_bytes_per_s=1e11, dtype="bfloat16")
    assert compute.intensity == pytest.approx(1e4)
    assert compute.bound == "compute" and compute.roof == 1e12
    assert compute.flops_per_s == pytest.approx(5e11) and compute.fraction == pytest.approx(0.5)
    assert compute.bytes_per_s == pytest.approx(5e7)
    # 1 MFLOP per sample, 1 MB per batch of 1: intensity 1 FLOP/byte, memory roof 1e11 FLOP/s.
    memory = roofline(flops_per_sample=1e6, bytes_per_batch=1e6, batch_size=1, samples_per_s=1e4,
                      peak_flops_per_s=1e12, peak_bytes_per_s=1e11, dtype="float32")
    assert memory.bound == "memory" and memory.roof == pytest.approx(1e11)
    assert memory.fraction == pytest.approx(0.1)
    assert roofline_cell(memory.to_dict()) == "10% memory" and roofline_cell(compute.to_dict(), compact=True) == "50% comp"
    assert roofline_cell(None) == ""
    with pytest.raises(ValueError):
        roofline(flops_per_sample=0, bytes_per_batch=1, batch_size=1, samples_per_s=1, peak_flops_per_s=1,
                 peak_bytes_per_s=1, dtype="float32")
    assert Roofline.from_dict(compute.to_dict()) == compute


def test_bytes_count_storage_once_at_its_dtype():
    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, shared, nn.Linear(4, 2).to(torch.bfloat16))
    assert weight_bytes(model) == (16 + 4) * 4 + (8 + 2) * 2
    assert tensors_bytes((torch.ones(2, 3), {"a": torch.ones(4, dtype=torch.int8)}, [None, 3])) == 24 + 4


def test_measured_peaks_are_positive_and_cached():
    from overdrive.core import roofline as rl

    first = rl.peak_flops(CPU, "float32")
    assert first is not None and first > 1e8
    assert rl.peak_flops(CPU, "float32") == first  # measured once per process
    assert rl.peak_bandwidth(CPU) > 1e8
    assert rl.peak_read_bandwidth(CPU) > 1e8 and rl.peak_read_bandwidth(CPU) == rl.peak_read_bandwidth(CPU)
    assert rl.peak_flops(CPU, "float8") is None  # no fp8 GEMM on a CPU
    assert "float32 GEMM" in rl.describe_peaks(CPU) and "copy" in rl.describe_peaks(CPU)
    point = rl.measured_roofline(device=CPU, dtype="float8", flops_per_sample=1e6, bytes_per_batch=1e5, batch_size=4,
                                 samples_per_s=100.0)
    assert point.dtype == "float32"  # no fp8 GEMM: the fp32 roof, said
    assert rl.measured_roofline(device=CPU, dtype="float32", flops_per_sample=None, bytes_per_batch=1, batch_size=1,
                                samples_per_s=1) is None
    assert math.isfinite(point.fraction)


@requires_cuda
def test_cuda_audit_counts_launches_and_the_planted_sync():
    device = torch.device("cuda")
    model = Planted().to(device).eval()
    audit = audit_forward(model, (torch.randn(3, 8, device=device),), device=device)
    assert audit.kernel_launches and audit.kernel_launches > 3
    assert audit.syncs[".cpu()"] == 1 and audit.d2h_copies == 1 and audit.h2d_copies == 1
    assert audit.num_syncs == 4 and audit.memcpy_calls >= 2


def test_text_flops_are_of_real_tokens_whatever_the_padding(text_workload):
    """A batch padded to its longest row does more work than its rows need; the roofline counts the rows' own."""
    from torch.utils.flop_counter import FlopCounterMode

    from overdrive.core.flops import count_flops_per_sample

    w = text_workload
    indices = list(range(16))
    per_sample = count_flops_per_sample(w.model, w, device=CPU, indices=indices)
    alone = []
    for i in indices:
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            w.model(*w.collate([w.samples[i]]))
        alone.append(counter.get_total_flops())
    assert per_sample == pytest.approx(sum(alone) / len(alone))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        w.model(*w.collate([w.samples[i] for i in indices]))
    assert counter.get_total_flops() / len(indices) > 1.2 * per_sample  # padded: more


def test_a_share_above_the_roof_is_marked_and_said():
    from overdrive.core.roofline import ABOVE_ROOF, above_roof

    over = roofline(flops_per_sample=1e9, bytes_per_batch=1e6, batch_size=10, samples_per_s=1500,
                    peak_flops_per_s=1e12, peak_bytes_per_s=1e11, dtype="float32")
    assert over.fraction == pytest.approx(1.5)
    assert roofline_cell(over.to_dict(), compact=True) == "150%! comp" and ABOVE_ROOF in over.describe()
    assert above_roof([None, over.to_dict()]) and not above_roof([None])


def test_audit_names_the_line_of_each_sync():
    audit = audit_forward(Planted().eval(), (torch.randn(3, 8),), device=CPU)
    lines = {kind: site for kind, site in audit.sync_sites.items()}
    assert all(site.startswith("test_graph_audit.py:") and site.endswith(" in forward") for site in lines.values())
    assert len(set(lines.values())) == 4  # four different lines of Planted.forward


def test_audit_counts_each_transfer_once_as_a_gpu_would():
    class Transfers(nn.Module):
        def forward(self, x):
            mean = x.mean(0)
            as_numpy = mean.cpu().numpy()  # one copy and sync, not two
            listed = x.sum().to("cpu").tolist()  # one, by the string device
            onto = torch.tensor([2.0, 3.0, 4.0], device=x.device)  # host data to the model's device: one copy
            host = torch.tensor([1.0, 1.0, 1.0])  # stays on the host ...
            moved = host.to(x.device)  # ... until moved: one copy
            _ = host.sum().item()  # a host value: no sync
            y = x.clone()
            y[y > 0] = 0.0  # a boolean-mask write
            return y + onto + moved + float(as_numpy.sum()) + listed

    audit = audit_forward(Transfers(), (torch.ones(2, 3),), device=CPU)
    assert (audit.d2h_copies, audit.h2d_copies) == (2, 2)
    assert audit.h2d_bytes == 24 and audit.d2h_bytes == 12 + 4
    assert audit.syncs == {".cpu()": 1, ".to('cpu')": 1, "data-dependent shape (boolean-mask assignment)": 1}


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_audit_sees_the_syncs_of_a_fast_path_the_modes_switch_off():
    layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).eval()
    x, mask = torch.randn(2, 5, 16), torch.tensor([[False] * 5, [False, False, False, True, True]])

    class Encoder(nn.Module):
        def forward(self, x, mask):
            return model(x, src_key_padding_mask=mask)

    audit = audit_forward(Encoder(), (x, mask), device=CPU)
    from overdrive.core.audit import FAST_PATH

    assert audit.syncs.get(FAST_PATH, 0) >= 1


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_int8_dynamic_weights_are_counted_at_one_byte():
    model = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 64))
    quantized = torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)
    fp32 = weight_bytes(model)
    assert fp32 == (2 * (64 * 64 + 64) + 2 * 64) * 4
    assert weight_bytes(quantized) == 2 * 64 * 64 + 2 * 64 * 4 + 2 * 64 * 4  # int8 weights, fp32 biases and LayerNorm


def test_runtime_compute_dtypes():
    from overdrive.techniques import default_config
    from overdrive.techniques.registry import compute_dtype

    assert compute_dtype([default_config("openvino-int8")]) == "int8"
    assert compute_dtype([default_config("onnxruntime-int8")]) == "int8"
    assert compute_dtype([default_config("onnxruntime")]) == "float32"
    assert compute_dtype([default_config("bf16"), default_config("compile")]) == "bfloat16"


def test_audit_tracks_factories_and_new_tensor():
    class Made(nn.Module):
        def forward(self, x):
            steps = torch.arange(3).to(x.device)  # made on the host, then moved: one copy
            zeros = torch.zeros(3, device=x.device)  # made on the device: none
            extra = x.new_tensor([1.0, 2.0, 3.0])  # host data to x's device: one copy
            buf = torch.empty(2, 3)
            buf.copy_(x)  # device to a host buffer: one copy and a sync
            return x + steps + zeros + extra + buf  # the host buffer used on the device: a copy back

    audit = audit_forward(Made(), (torch.ones(2, 3),), device=CPU)
    assert (audit.h2d_copies, audit.d2h_copies) == (3, 1) and audit.syncs == {"copy_ to host": 1}
    assert audit.h2d_bytes == 3 * 8 + 3 * 4 + 6 * 4 and audit.d2h_bytes == 24


def test_nan_and_non_init_dataclass_fields_in_graphs():
    from dataclasses import dataclass as plain_dataclass, field as plain_field

    from overdrive.techniques.runtime.cuda_graphs import CUDAGraphModule, FakeCapture

    @plain_dataclass
    class Out:
        a: torch.Tensor
        b: torch.Tensor = plain_field(init=False)

    class Model(nn.Module):
        def forward(self, x, scale):
            out = Out(x * 2)
            out.b = x + (0.0 if scale != scale else scale)
            return out

    module = CUDAGraphModule(Model(), capture=FakeCapture(), max_graphs=4)
    for k in range(3):
        got = module(torch.full((2,), float(k)), float("nan"))
        assert torch.equal(got.a, torch.full((2,), 2.0 * k)) and torch.equal(got.b, torch.full((2,), float(k)))
    assert module.stats.captured == 1 and module.stats.eager_calls == 0


def test_a_roof_for_a_dtype_on_part_of_the_flops_is_time_weighted(conv_workload):
    from overdrive.core import roofline as rl
    from overdrive.core.flops import layer_flop_share

    share = layer_flop_share(conv_workload.model, conv_workload, device=CPU, indices=list(range(8)),
                             layer_types=(nn.Linear,))
    assert 0 < share < 0.05  # the head only: the convolutions stay fp32
    int8, fp32 = rl.peak_flops(CPU, "int8"), rl.peak_flops(CPU, "float32")
    point = rl.measured_roofline(device=CPU, dtype="int8", flops_per_sample=1e6, bytes_per_batch=1e3, batch_size=8,
                                 samples_per_s=10.0, dtype_share=share)
    assert point.peak_flops_per_s == pytest.approx(1 / (share / int8 + (1 - share) / fp32))
    assert point.dtype.startswith("int8 on ") and "float32 the rest" in point.dtype
