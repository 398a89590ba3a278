"""concurrent-streams (the branch finder and the rewritten graph, with recording stand-ins for the
streams on the CPU) and cuda-graphs (the capture bookkeeping, with a fake capture on the CPU)."""

from __future__ import annotations

import copy

import pytest
import torch
import torchvision
from torch import fx, nn

from overdrive.techniques import get_technique
from overdrive.techniques.graph.branches import find_regions
from overdrive.techniques.graph.concurrent_streams import StreamOps, streamed_graph
from overdrive.techniques.runtime.cuda_graphs import CUDAGraphModule, FakeCapture
from tests.conftest import requires_cuda

CPU = torch.device("cpu")


class Tower(nn.Module):
    def __init__(self, d_in: int):
        super().__init__()
        self.a, self.b = nn.Linear(d_in, 16), nn.Linear(16, 16)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class TwoTower(nn.Module):
    """A recommender's two towers: user and item, joined by a dot product."""

    def __init__(self):
        super().__init__()
        self.user, self.item = Tower(8), Tower(12)

    def forward(self, u, i):
        return (self.user(u) * self.item(i)).sum(-1, keepdim=True)


class Residual(nn.Module):
    """A skip connection: one branch does work, the other is the identity: nothing to overlap."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.fc2(x + torch.relu(self.fc1(x)))


class MultiHead(nn.Module):
    """A trunk, three heads (one of them two layers deep), a light side computation, one output."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(8, 16)
        self.cls = nn.Linear(16, 4)
        self.box = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
        self.aux = nn.Linear(16, 4)

    def forward(self, x):
        h = torch.relu(self.trunk(x))
        scale = h.mean(-1, keepdim=True)  # light: no parameters, stays on the main stream
        return self.cls(h) + self.box(h) * scale + self.aux(h)


def test_two_tower_branches_are_the_towers():
    regions = find_regions(fx.symbolic_trace(TwoTower()))
    assert len(regions) == 1
    region = regions[0]
    assert region.fork == "<inputs>" and region.join == "mul"
    assert region.names == ["user", "item"]
    assert [[n.name for n in b] for b in region.branches] == [["user_a", "relu", "user_b"], ["item_a", "relu_1", "item_b"]]


def test_googlenet_inception_blocks_have_four_branches_each():
    net = torchvision.models.googlenet(weights=None, aux_logits=False, init_weights=False).eval()
    regions = find_regions(fx.symbolic_trace(net))
    blocks = ["3a", "3b", "4a", "4b", "4c", "4d", "4e", "5a", "5b"]
    assert [r.names for r in regions] == [[f"inception{b}.branch{k}" for k in range(1, 5)] for b in blocks]
    assert all(r.join.startswith("cat") for r in regions)


def test_no_branches_in_a_residual_or_sequential_model():
    assert find_regions(fx.symbolic_trace(Residual())) == []
    assert find_regions(fx.symbolic_trace(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)))) == []


def test_multi_head_branches_and_light_nodes_stay_on_the_main_stream():
    model = MultiHead().eval()
    regions = find_regions(fx.symbolic_trace(model))
    assert len(regions) == 1 and regions[0].names == ["cls", "box", "aux"]
    assert "mean" not in {n.name for b in regions[0].branches for n in b}


@pytest.mark.parametrize("make,inputs", [
    (TwoTower, lambda: (torch.randn(5, 8), torch.randn(5, 12))),
    (MultiHead, lambda: (torch.randn(5, 8),)),
    (lambda: torchvision.models.googlenet(weights=None, aux_logits=False, init_weights=False),
     lambda: (torch.randn(2, 3, 64, 64),)),
])
def test_rewritten_graph_gives_identical_outputs_and_runs_each_branch_on_its_stream(make, inputs):
    torch.manual_seed(0)
    model = make().eval()
    x = inputs()
    with torch.no_grad():
        eager = model(*x)  # before the hooks: the traced graph shares the model's modules
    gm, regions = streamed_graph(model, CPU, fake=True)
    ops = {name: m for name, m in gm.named_modules() if isinstance(m, StreamOps)}
    assert len(ops) == len(regions)
    # Each parametrised module of a branch must run while its branch's stream is current.
    seen: list[tuple[str, str]] = []
    modules = dict(gm.named_modules())
    expected = {}
    for index, region in enumerate(regions):
        for k, branch in enumerate(region.branches):
            for node in branch:
                if node.op == "call_module" and any(True for _ in modules[node.target].parameters(recurse=False)):
                    expected[node.target] = (f"overdrive_streams_{index}", f"side{k}")
    for target, (ops_name, _) in expected.items():
        modules[target].register_forward_pre_hook(
            lambda m, a, target=target, ops_name=ops_name: seen.append((target, ops[ops_name].current)))
    with torch.no_grad():
        assert torch.equal(gm(*x), eager)
    assert {t: s for t, s in seen} == {t: stream for t, (_, stream) in expected.items()}
    for index, region in enumerate(regions):
        log = ops[f"overdrive_streams_{index}"].log
        k = len(region.branches)
        assert log == [("fork",)] + [e for j in range(k) for e in (("enter", j), ("leave", j))] + [("join",)]


def test_concurrent_streams_is_cuda_only_and_not_applicable_without_branches():
    technique = get_technique("concurrent-streams")
    assert technique.lossless and technique.devices == ("cuda",)
    assert "cuda" in technique.unsupported_reason(_workload(TwoTower()), CPU)
    assert technique.applicability(_workload(Residual()), torch.device("cuda")).startswith("not applicable: no independent")
    assert technique.applicability(_workload(TwoTower()), torch.device("cuda")) is None


def _workload(model):
    from overdrive.tuning.api import as_workload

    example = (torch.randn(4, 8), torch.randn(4, 12)) if isinstance(model, TwoTower) else (torch.randn(4, 8),)
    return as_workload(model.eval(), example)


# ---- cuda-graphs: the bookkeeping, with a fake capture -------------------------------------------------------------

class Doubler(nn.Module):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x, scale: float = 2.0):
        self.calls += 1
        return {"y": x * scale, "n": x.sum(-1)}


def test_graphs_capture_per_shape_copy_inputs_in_and_outputs_out():
    capture = FakeCapture()
    module = CUDAGraphModule(Doubler(), capture=capture, max_graphs=2)
    a, b = torch.ones(2, 3), torch.full((2, 3), 5.0)
    out_a = module(a)
    out_b = module(b)  # same shape: a replay of the first graph with b's values
    assert capture.captures == 1 and module.stats.captured == 1 and module.stats.replays == 2
    assert torch.equal(out_b["y"], b * 2)
    # The overwrite-on-replay trap: the first call's outputs are its own, not the graph's buffers.
    assert torch.equal(out_a["y"], a * 2) and torch.equal(out_a["n"], a.sum(-1))
    static = module.graphs[next(iter(module.graphs))]
    assert out_b["y"].data_ptr() != static.static_outputs["y"].data_ptr()
    # The caller's input is copied in, never captured by reference.
    a.fill_(100.0)
    assert torch.equal(module(torch.ones(2, 3))["y"], torch.full((2, 3), 2.0))


def test_graphs_beyond_max_run_eagerly_and_are_counted():
    module = CUDAGraphModule(Doubler(), capture=FakeCapture(), max_graphs=2)
    for rows in (1, 2, 3, 4, 3):
        out = module(torch.ones(rows, 3))
        assert torch.equal(out["y"], torch.full((rows, 3), 2.0))
    assert module.stats.captured == 2 and module.stats.eager_calls == 3
    assert "beyond the 2 shapes captured" in module.stats.describe()
    # A non-tensor argument is part of the key: another scale is another graph, never a stale replay.
    module = CUDAGraphModule(Doubler(), capture=FakeCapture(), max_graphs=4)
    assert torch.equal(module(torch.ones(1, 2), 3.0)["y"], torch.full((1, 2), 3.0))
    assert torch.equal(module(torch.ones(1, 2), 4.0)["y"], torch.full((1, 2), 4.0))
    assert module.stats.captured == 2


def test_a_shape_that_cannot_be_captured_runs_eagerly_and_is_not_retried():
    class Fails:
        def __init__(self):
            self.tries = 0

        def __call__(self, fn):
            self.tries += 1
            raise RuntimeError("operation not permitted when stream is capturing")

    capture = Fails()
    module = CUDAGraphModule(Doubler(), capture=capture, max_graphs=4)
    for _ in range(3):
        assert torch.equal(module(torch.ones(2, 2))["y"], torch.full((2, 2), 2.0))
    assert capture.tries == 1 and module.stats.eager_calls == 3 and module.stats.captured == 0
    assert "capture failed: RuntimeError: operation not permitted" in module.stats.describe()


def test_cuda_graphs_technique_is_cuda_only_and_reduce_overhead_includes_it():
    from overdrive.techniques import conflict
    from overdrive.techniques.runtime.cuda_graphs import CudaGraphsConfig
    from overdrive.techniques.runtime.torch_compile import CompileConfig, CompileMode

    assert get_technique("cuda-graphs").devices == ("cuda",)
    assert conflict([CompileConfig(mode=CompileMode.REDUCE_OVERHEAD)], CudaGraphsConfig()) is not None
    assert conflict([CompileConfig()], CudaGraphsConfig()) is None
    with pytest.raises(ValueError):
        CudaGraphsConfig(max_graphs=0)
    compile_ = get_technique("compile")
    assert len(compile_.variants(CompileConfig(), _workload(Residual()), torch.device("cuda"))) == 3
    assert compile_.variants(CompileConfig(), _workload(Residual()), CPU) == [CompileConfig()]


@requires_cuda
def test_cuda_graphs_and_streams_on_a_gpu_match_eager():
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = TwoTower().to(device).eval()
    u, i = torch.randn(8, 8, device=device), torch.randn(8, 12, device=device)
    from overdrive.techniques.runtime.cuda_graphs import CudaCapture

    graphs = CUDAGraphModule(model, capture=CudaCapture(device), max_graphs=4)
    with torch.no_grad():
        expected = model(u, i)
        first = graphs(u, i)
        second = graphs(u * 2, i)
        torch.testing.assert_close(first, expected)
        torch.testing.assert_close(second, model(u * 2, i))
        assert graphs.stats.captured == 1 and graphs.stats.replays == 2
        streamed, _ = streamed_graph(model, device)
        torch.testing.assert_close(streamed(u, i), expected)


def test_eager_fallbacks_are_said():
    from overdrive.techniques.registry import fallbacks

    module = CUDAGraphModule(Doubler(), capture=FakeCapture(), max_graphs=1)
    wrapped = nn.Sequential(module)
    module(torch.ones(1, 2))
    assert fallbacks(wrapped) is None
    module(torch.ones(2, 2))
    assert fallbacks(wrapped) == "cuda-graphs: 1 shapes captured, 1 replays, 1 eager calls (2×2: beyond the 1 shapes captured)"


def test_graphs_key_arguments_by_type_and_accept_keywords_and_nested_tensors():
    class Scale(nn.Module):
        def forward(self, x, factor=2, pair=None):
            out = x * factor
            return out + pair[0] * pair[1] if pair is not None else out

    eager = Scale()
    module = CUDAGraphModule(Scale(), capture=FakeCapture(), max_graphs=8)
    ints = torch.arange(4).reshape(2, 2)
    for factor in (2, 2.0, True):  # equal under ==, three graphs: the int one must not answer the float call
        got, want = module(ints, factor), eager(ints, factor)
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert module.stats.captured == 3
    x = torch.ones(2, 2)
    for k in range(3):  # a tuple of tensors as a keyword: copied in, one graph
        pair = (torch.full((2, 2), float(k)), torch.ones(2, 2))
        assert torch.equal(module(x, factor=3, pair=pair), eager(x, factor=3, pair=pair))
    assert module.stats.captured == 4 and module.stats.eager_calls == 0


def test_graphs_copy_out_dataclass_outputs_and_refuse_models_that_write_their_inputs():
    from dataclasses import dataclass as plain_dataclass

    @plain_dataclass
    class Out:
        value: torch.Tensor

    class ReturnsDataclass(nn.Module):
        def forward(self, x):
            return Out(x * 3)

    module = CUDAGraphModule(ReturnsDataclass(), capture=FakeCapture(), max_graphs=4)
    first = module(torch.ones(2))
    second = module(torch.full((2,), 2.0))
    assert first is not second and torch.equal(first.value, torch.full((2,), 3.0))
    assert torch.equal(second.value, torch.full((2,), 6.0))

    class Mutates(nn.Module):
        def forward(self, x):
            x.mul_(2)
            return x + 1

    module = CUDAGraphModule(Mutates(), capture=FakeCapture(), max_graphs=4)
    caller = torch.ones(2)
    assert torch.equal(module(caller), torch.full((2,), 3.0)) and torch.equal(caller, torch.full((2,), 2.0))  # as eager
    assert module.stats.captured == 0 and "writes into its inputs" in module.stats.describe()


def test_a_call_that_fails_eagerly_raises_and_does_not_disable_the_shape():
    class Lookup(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = nn.Embedding(10, 4)

        def forward(self, ids):
            return self.table(ids)

    module = CUDAGraphModule(Lookup(), capture=FakeCapture(), max_graphs=4)
    with pytest.raises(IndexError):
        module(torch.tensor([[99, 1]]))
    for _ in range(3):
        module(torch.tensor([[3, 1]]))
    assert module.stats.captured == 1 and module.stats.eager_calls == 0 and module.stats.replays == 3


class WritesTheFork(nn.Module):
    """Two heads around an in-place write into their shared input: moving the heads would change `a`."""

    def __init__(self):
        super().__init__()
        self.trunk, self.ha, self.hb = nn.Linear(16, 16), nn.Linear(16, 4), nn.Linear(16, 4)

    def forward(self, x):
        h = self.trunk(x)
        a = self.ha(h)
        h.view(-1).clamp_(min=0)  # through a view, too
        b = self.hb(h)
        return a, b


class WritesInsideBranches(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        left = self.act(self.a(x))  # in place, on the branch's own activation
        right = torch.nn.functional.relu(self.b(x), True)
        return left + right


def test_a_write_into_a_shared_tensor_keeps_the_region_serial_and_branch_local_writes_do_not():
    assert find_regions(fx.symbolic_trace(WritesTheFork())) == []
    regions = find_regions(fx.symbolic_trace(WritesInsideBranches()))
    assert len(regions) == 1 and len(regions[0].branches) == 2
    model, x = WritesInsideBranches().eval(), torch.randn(3, 8)
    with torch.no_grad():
        assert torch.equal(streamed_graph(model, CPU, fake=True)[0](x), model(x))


def test_keyword_inputs_and_dict_outputs_are_traced_inside_the_signature_wrapper():
    class DictTowers(nn.Module):
        def __init__(self):
            super().__init__()
            self.user, self.item = Tower(8), Tower(12)

        def forward(self, user, item):
            return {"score": (self.user(user) * self.item(item)).sum(-1), "user": self.user(user)}

    from overdrive.tuning.api import as_workload

    workload = as_workload(DictTowers().eval(), {"user": torch.randn(4, 8), "item": torch.randn(4, 12)})
    technique = get_technique("concurrent-streams")
    assert technique.applicability(workload, torch.device("cuda")) is None
    import copy

    model = copy.deepcopy(workload.model)
    streamed = technique.apply(model, technique.config_cls(), workload=workload, device=CPU)
    assert "branches" in streamed.overdrive_report["regions"]
    inputs = workload.collate(workload.samples[:4])
    with torch.no_grad():
        assert torch.equal(streamed(*inputs), workload.model(*inputs))


def test_branch_names_are_unique_within_a_region():
    net = torchvision.models.inception_v3(weights=None, aux_logits=False, init_weights=False).eval()
    for region in find_regions(fx.symbolic_trace(net)):
        assert len(set(region.names)) == len(region.names), region.names


def test_graph_replays_from_several_threads_each_get_their_own_answer():
    """serve's instance threads and run's replicas may share one model: a replay and its copy-out are one step."""
    from concurrent.futures import ThreadPoolExecutor

    module = CUDAGraphModule(Doubler(), capture=FakeCapture(), max_graphs=4)

    def call(k: int) -> bool:
        x = torch.full((4, 8), float(k))
        return torch.equal(module(x)["y"], x * 2)

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(call, range(200)))
    assert module.stats.captured == 1 and module.stats.replays == 200


class WritesThroughACast(WritesTheFork):
    """`.float()` of a float tensor is the tensor itself: a write through it reaches the shared input."""

    def forward(self, x):
        h = self.trunk(x)
        a = self.ha(h)
        b = self.hb(torch.nn.functional.relu(h.float(), inplace=True))
        return a, b


class OptionalMask(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, mask=None):
        h = self.a(x) + self.b(x)
        return h if mask is None else h * mask


class ScalesABuffer(nn.Module):
    """A forward that writes into a buffer no traced value holds: fx records one run of it, not the write."""

    def __init__(self):
        super().__init__()
        self.ha, self.hb = nn.Linear(8, 4), nn.Linear(8, 4)
        self.register_buffer("s", torch.ones(()))

    def forward(self, x):
        a = self.ha(x * self.s)
        self.s.mul_(2)
        b = self.hb(x * self.s)
        self.s.div_(2)
        return a + b


def test_writes_through_calls_that_may_return_their_input_keep_the_region_serial():
    assert find_regions(fx.symbolic_trace(WritesThroughACast())) == []


def test_parameters_not_passed_are_traced_at_their_defaults_and_untraced_work_is_refused():
    technique = get_technique("concurrent-streams")
    model, x = OptionalMask().eval(), torch.randn(3, 8)
    workload = _workload(model)
    streamed = technique.apply(copy.deepcopy(workload.model), technique.config_cls(), workload=workload, device=CPU)
    with torch.no_grad():
        assert torch.equal(streamed(x), model(x))
    scaled = ScalesABuffer().eval()
    workload = _workload(scaled)
    before = scaled.s.clone()
    assert technique.applicability(workload, torch.device("cuda")) is None  # traced on a copy: the buffer is untouched
    assert torch.equal(scaled.s, before)
    with pytest.raises(RuntimeError, match="does not reproduce the model"):
        technique.apply(copy.deepcopy(workload.model), technique.config_cls(), workload=workload, device=CPU)


def test_streams_inside_bf16_are_checked_against_the_same_model_before_the_rewrite():
    from overdrive.techniques import default_config
    from overdrive.techniques.compose import build

    workload = _workload(TwoTower().eval())
    expected, _ = build(workload, [default_config("bf16")], CPU)
    technique = get_technique("concurrent-streams")  # CUDA-only in a plan: applied directly, with recording streams
    streamed = technique.apply(copy.deepcopy(expected), technique.config_cls(), workload=workload, device=CPU)
    assert "2 branches" in streamed.overdrive_report["regions"]
    inputs = workload.collate(workload.samples[:4])
    with torch.no_grad():
        assert torch.equal(streamed(*inputs), expected(*inputs))
