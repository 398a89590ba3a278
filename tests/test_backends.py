"""Runtimes outside PyTorch (ONNX Runtime, OpenVINO) as techniques, ONNX export with proof, and
`overdrive export`'s formats. How each could be silently wrong, and the test that says no:

- an export that answers differently from PyTorch is refused, with the figure;
- a runtime step after bf16/compile would run the fp32 graph and drop them without a word: the
  registry refuses that plan, and the tuner tries the runtime instead of them, measured;
- a runtime's output buffer reused by the next call: outputs are owned by the caller;
- a session made for one thread count used by an instance set to another: one session per count;
- a Triton config whose dims or names do not match the file: parsed with Triton's own protobuf
  and the names checked against the ONNX model.
"""

from __future__ import annotations

import copy
import threading
import time
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pytest
import torch
import yaml
from torch import nn

from overdrive.core.workload import Workload
from overdrive.deploy.formats import describe, dynamic_batching, export
from overdrive.files.onnx import ExportError, export_onnx, ort_session, prove_onnx
from overdrive.techniques import (
    Stage,
    Technique,
    TechniqueConfig,
    conflict,
    default_config,
    register,
    unregister,
)
from overdrive.tuning.plan import Plan
from overdrive.techniques.compose import build
from tests.conftest import make_conv_workload, make_text_workload, requires_cuda

CPU = torch.device("cpu")


def _rows(workload, n=6):
    return workload.collate([workload.samples[i] for i in range(n)])


@pytest.mark.parametrize("factory", [make_conv_workload, make_text_workload], ids=["conv", "text"])
def test_onnx_export_is_proved_and_takes_other_batch_sizes_and_lengths(factory, tmp_path):
    workload = factory()
    exported = export_onnx(workload.model, workload, tmp_path / "m.onnx")
    assert exported.max_abs_diff is not None and exported.max_abs_diff < 1e-4 and exported.proof_rows > 0
    session = ort_session(exported.path)
    assert [i.name for i in session.get_inputs()] == exported.input_names
    for n in (1, 3, 7):  # batch sizes (and, for text, lengths) the trace never saw
        inputs = _rows(workload, n)
        (got,) = session.run(None, {name: t.numpy() for name, t in zip(exported.input_names, inputs)})
        with torch.no_grad():
            torch.testing.assert_close(torch.from_numpy(got), workload.model(*inputs), rtol=1e-4, atol=1e-4)
    if workload.is_text:
        assert exported.dynamic_axes[exported.input_names[0]] == {0: "batch", 1: "sequence"}


class _KeywordEncoder(nn.Module):
    """Keyword inputs, a bare tensor out: its output's path in the model's output is "" (the output itself)."""

    def __init__(self):
        super().__init__()
        self.emb, self.lin = nn.Embedding(100, 16), nn.Linear(16, 8)

    def forward(self, input_ids, attention_mask):
        h = self.lin(self.emb(input_ids)) * attention_mask.unsqueeze(-1)
        return h.sum(1) / attention_mask.sum(1, keepdim=True)


def test_a_keyword_input_model_returning_a_bare_tensor_exports_and_loads(tmp_path):
    # Its one output was named "" in the graph, which ONNX Runtime refuses to load ("Graph output () does not exist"):
    # the onnxruntime and openvino techniques failed for it, and export left the unloadable file behind.
    from overdrive.workloads.user import workload_from_model

    torch.manual_seed(0)
    example = {"input_ids": torch.randint(0, 100, (8, 12)), "attention_mask": torch.ones(8, 12, dtype=torch.long)}
    workload = workload_from_model("kw", _KeywordEncoder().eval(), example)
    exported = export_onnx(workload.model, workload, tmp_path / "m.onnx")
    assert exported.output_names == ["output"] and exported.input_names == ["input_ids", "attention_mask"]
    (got,) = ort_session(exported.path).run(None, {k: v.numpy() for k, v in example.items()})
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(got), workload.model(*example.values()), rtol=1e-4, atol=1e-4)


def test_export_of_a_saved_plan_keeps_its_varying_sequence_dimension(tmp_path):
    """From a new user's trial: `overdrive.export(plan.json, "onnx", out, model=model)` rebuilt the model from the plan's
    input shapes alone, so the file took only the traced length (T 12: "Got: 5 Expected: 12"), while the plan records
    the varying dimension and `overdrive.load` honours it; its notes called made-up rows real ones."""
    import overdrive

    torch.manual_seed(0)
    model = _KeywordEncoder().eval()
    mask = torch.ones(8, 12, dtype=torch.long)
    mask[::2, 8:] = 0
    example = {"input_ids": torch.randint(1, 100, (8, 12)), "attention_mask": mask}
    result = overdrive.optimize(model, example, techniques=["onnxruntime"], device="cpu", sweep_batch_sizes=[], min_gain=0)
    result.save(tmp_path / "out")
    exported = overdrive.export(tmp_path / "out" / "plan.json", "onnx", tmp_path / "m.onnx", model=model)
    session = ort_session(exported.path)
    assert [i.shape for i in session.get_inputs()] == [["batch", "dim1"]] * 2
    short = {"input_ids": torch.randint(1, 100, (3, 5)), "attention_mask": torch.ones(3, 5, dtype=torch.long)}
    (got,) = session.run(None, {k: v.numpy() for k, v in short.items()})
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(got), model(**short), rtol=1e-4, atol=1e-5)


def test_an_export_that_answers_differently_is_refused_with_the_figure(tmp_path):
    workload = make_conv_workload()
    exported = export_onnx(workload.model, workload, tmp_path / "m.onnx")
    other = copy.deepcopy(workload.model)
    with torch.no_grad():
        next(other.parameters()).add_(0.5)  # the file no longer matches this model
    with pytest.raises(ExportError, match=r"max \|diff\| .* refused"):
        prove_onnx(exported, other, workload)


def test_a_runtime_cannot_follow_steps_whose_effect_lives_in_pytorch():
    bf16, ort, fold = default_config("bf16"), default_config("onnxruntime"), default_config("bn-fold")
    assert "cannot follow bf16" in conflict([bf16], ort)
    assert conflict([fold], ort) is None  # folding survives export
    assert "left PyTorch" in conflict([ort], fold)
    assert "alternative to onnxruntime" in conflict([ort], default_config("openvino"))
    with pytest.raises(RuntimeError, match="cannot follow bf16"):
        build(make_conv_workload(), [bf16, ort], CPU)


@pytest.mark.parametrize("name", ["onnxruntime", "openvino"])
def test_runtime_outputs_are_owned_and_sessions_follow_the_thread_count(name):
    workload = make_text_workload()
    model, _ = build(workload, [default_config(name)], CPU)
    first_inputs, second_inputs = _rows(workload, 4), workload.collate(list(workload.samples[10:14]))
    first = model(*first_inputs)
    kept = first.clone()
    model(*second_inputs)  # a runtime that hands out its own buffer would overwrite `first` here
    assert torch.equal(first, kept)
    threads = torch.get_num_threads()
    try:
        for n in (2, 1):  # two thread counts whatever this process has (a test worker may own one CPU)
            torch.set_num_threads(n)
            model(*first_inputs)
        assert {n for _, n in model._sessions} == {threads, 2, 1}
    finally:
        torch.set_num_threads(threads)
    seen = []
    worker = threading.Thread(target=lambda: seen.append(model(*first_inputs)))  # another thread: its own session
    worker.start()
    worker.join()
    assert torch.allclose(seen[0], kept) and len({thread for thread, _ in model._sessions}) == 2


def test_openvino_int8_calibrates_on_training_rows_only():
    workload = make_text_workload()
    from overdrive.techniques import get_technique

    assert "training rows" in get_technique("openvino-int8").unsupported_reason(workload, CPU)


# -- the tuner tries a runtime instead of the steps it cannot follow ----------------------------


class _Sleepy(nn.Module):
    """A model whose forward sleeps in Python: invisible to an exported graph."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(16, 4)
        self.sleep_s = 0.02

    def forward(self, x):
        if self.sleep_s:
            time.sleep(self.sleep_s)
        return self.linear(x)


@dataclass(frozen=True, kw_only=True)
class _NoSleepConfig(TechniqueConfig):
    name: ClassVar[str] = "no-sleep-test"


@pytest.fixture
def no_sleep_technique():
    class NoSleep(Technique):  # lossless, kept alone, and its effect lives in PyTorch's execution (not exportable)
        config_cls = _NoSleepConfig
        stage = Stage.GRAPH
        lossless = True
        description = "test: a forward-only setting"

        def apply(self, model, config, *, workload, device):
            model.sleep_s = 0.01
            return model

    register(NoSleep)
    yield _NoSleepConfig.name
    unregister(_NoSleepConfig.name)


def test_the_tuner_tries_a_runtime_instead_of_steps_it_cannot_follow(no_sleep_technique):
    from overdrive.tuning.tuner import Tuner

    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(16, generator=g) for _ in range(32)]
    workload = Workload(name="sleepy", model=_Sleepy().eval(), samples=rows, collate=lambda r: (torch.stack(r),),
                        fidelity=lambda o, r: {"min_cosine": torch.nn.functional.cosine_similarity(o, r, dim=-1).min().item()},
                        fidelity_key="min_cosine", default_batch_size=16, real_weights=False)
    result = Tuner(workload=workload, device=CPU, batch_size=16, techniques=[no_sleep_technique, "onnxruntime"],
                   min_rounds=3, max_rounds=6).run()
    labels = {r.label: r for r in result.rows}
    instead = labels[f"+ onnxruntime instead of {no_sleep_technique}"]
    assert instead.kept, instead.reason
    assert [s.name for s in result.plan.steps] == ["onnxruntime"]


# -- export formats -----------------------------------------------------------------------------


@pytest.fixture
def digits_plan(tmp_path):
    path = tmp_path / "plan" / "plan.json"
    Plan(workload="digits-cnn", device="cpu", batch_size=32, steps=[default_config("bn-fold"), default_config("bf16")],
         measured={"samples_per_s": 5000.0, "latency_ms": {"p50": 6.4}}).save(path)
    return path


def test_export_onnx_says_what_it_carries_and_matches_pytorch(digits_plan, tmp_path):
    result = export(digits_plan, "onnx", tmp_path / "digits.onnx")
    assert result.carried == ["bn-fold"] and result.not_carried == ["bf16 (PyTorch's execution, not the graph)"]
    assert result.max_abs_diff < 1e-4
    assert any("not carried: bf16" in line for line in describe(result))
    assert ort_session(result.path).get_inputs()[0].name == "input"  # as serve and run name it


def test_export_pt2_loads_back_as_a_model(digits_plan, tmp_path):
    result = export(digits_plan, "pt2", tmp_path / "digits.pt2")
    program = torch.export.load(str(result.path)).module()
    assert program(torch.zeros(5, 1, 8, 8)).shape == (5, 10)  # another batch size than the trace's


def test_export_triton_repository_parses_with_tritons_protobuf_and_its_model_loads(digits_plan, tmp_path):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    result = export(digits_plan, "triton", tmp_path / "repo")
    config = text_format.Parse((tmp_path / "repo" / "digits-cnn" / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    assert config.platform == "onnxruntime_onnx" and config.max_batch_size >= 32
    assert list(config.dynamic_batching.preferred_batch_size) == [32]
    assert config.dynamic_batching.max_queue_delay_microseconds == 3200  # half the measured p50 latency
    assert config.instance_group[0].kind == model_config_pb2.ModelInstanceGroup.KIND_CPU
    session = ort_session(tmp_path / "repo" / "digits-cnn" / "1" / "model.onnx")
    assert [i.name for i in session.get_inputs()] == [i.name for i in config.input]
    assert list(config.input[0].dims) == [1, 8, 8] and list(config.output[0].dims) == [10]
    (out,) = session.run(None, {"input": np.zeros((3, 1, 8, 8), np.float32)})
    assert out.shape == (3, 10)
    assert result.files[0].name == "config.pbtxt"


def test_triton_dynamic_batching_from_a_measured_curve():
    curve = [(1, 100.0, 1.0), (8, 700.0, 11.4), (32, 1000.0, 32.0), (64, 980.0, 65.0)]
    assert dynamic_batching(curve, 64) == ([32, 64], 16000)
    assert dynamic_batching(curve, 16) == ([8], 5700)  # sizes above the cap are not offered


def test_export_kserve_manifest(digits_plan, tmp_path):
    result = export(digits_plan, "kserve", tmp_path / "deploy")
    manifest = yaml.safe_load(result.path.read_text())
    assert manifest["kind"] == "InferenceService" and manifest["apiVersion"] == "serving.kserve.io/v1beta1"
    container = manifest["spec"]["predictor"]["containers"][0]
    assert container["command"][:3] == ["overdrive", "serve", "/mnt/models/plan.json"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert manifest["metadata"]["annotations"]["prometheus.io/path"] == "/metrics"
    assert (tmp_path / "deploy" / "plan.json").is_file()


def test_export_command_line(digits_plan, tmp_path, capsys):
    from overdrive.cli import main

    assert main(["export", str(digits_plan), "--format", "onnx", "--out", str(tmp_path / "d.onnx")]) == 0
    out = capsys.readouterr().out
    assert "wrote onnx" in out and "not carried: bf16" in out
    assert main(["export", str(tmp_path / "missing.json"), "--format", "onnx", "--out", str(tmp_path / "x.onnx")]) == 2


def test_a_plan_that_keeps_onnxruntime_exports_the_file_it_ran(tmp_path):
    path = tmp_path / "plan.json"
    Plan(workload="digits-cnn", device="cpu", batch_size=16, steps=[default_config("onnxruntime")]).save(path)
    result = export(path, "onnx", tmp_path / "ran.onnx")
    assert result.carried == ["onnxruntime"] and "the file the plan's ONNX Runtime step runs" in result.notes[0]
    assert result.max_abs_diff is not None and result.max_abs_diff < 1e-4


# -- serve and run take plans that use a runtime ---------------------------------------------------


def test_serve_builds_a_session_per_instance_and_answers_as_the_runtime(tmp_path):
    from overdrive.serve.runner import load_served_model
    from overdrive.workloads import create_workload

    path = tmp_path / "plan.json"
    Plan(workload="tests.fixtures.user_models:build", device="cpu", batch_size=4,
         steps=[default_config("onnxruntime")]).save(path)
    served, plan, instances = load_served_model(str(path), device="cpu", instances=2)
    assert plan.names == ["onnxruntime"] and instances == 2
    x = torch.randn(3, 16)
    with torch.no_grad():
        expected = create_workload("tests.fixtures.user_models:build").model(x).numpy()
    for instance in range(2):
        np.testing.assert_allclose(served.execute([(x[:1],), (x[1:],)], instance)[1], expected[1:], rtol=1e-4, atol=1e-5)


def test_run_with_an_openvino_plan_matches_the_model(tmp_path):
    from sklearn.datasets import load_digits

    from overdrive import cli
    from overdrive.workloads import create_workload

    images = (load_digits().images[:70, None] / 16.0).astype(np.float32)
    np.save(tmp_path / "digits.npy", images)
    path = tmp_path / "plan.json"
    Plan(workload="digits-cnn", device="cpu", batch_size=16, steps=[default_config("openvino")]).save(path)
    out = tmp_path / "out.npy"
    assert cli.main(["run", str(path), "--input", str(tmp_path / "digits.npy"), "--output", str(out)]) == 0
    got = np.load(out)
    with torch.no_grad():
        expected = create_workload("digits-cnn").model(torch.from_numpy(images)).numpy()
    assert got.shape == expected.shape
    cosine = (got * expected).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(expected, axis=1)
    assert cosine.min() > 0.999 and (got.argmax(1) == expected.argmax(1)).mean() == 1.0  # bf16 inside OpenVINO


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("factory", [make_conv_workload, make_text_workload], ids=["conv", "text"])
def test_onnxruntime_on_cuda_binds_device_memory_and_matches(factory):
    import onnxruntime

    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        pytest.skip(f"this onnxruntime build has no CUDA provider: {onnxruntime.get_available_providers()}")
    workload = factory()
    cuda = torch.device("cuda")
    model, _ = build(workload, [default_config("onnxruntime")], cuda)
    for n in (2, 5, 5):  # the second call at one shape writes into a tensor overdrive allocated
        inputs = tuple(t.to(cuda) for t in _rows(workload, n))
        out = model(*inputs)
        assert out.device.type == "cuda"
        with torch.no_grad():
            expected = workload.model(*(t.cpu() for t in inputs))
        torch.testing.assert_close(out.cpu(), expected, rtol=1e-3, atol=1e-3)


class _Branchy(nn.Module):
    """A data-dependent branch: a trace keeps the traced rows' branch for every row."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 4)

    def forward(self, x):
        h = self.linear(x)
        if h.sum() > 0:
            return h * 3
        return h - 1


def _branchy_workload():
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(8, generator=g) + 2.0 for _ in range(8)]  # every example row takes one branch
    return Workload(name="branchy", model=_Branchy().eval(), samples=rows, collate=lambda r: (torch.stack(r),),
                    fidelity=lambda o, r: {}, fidelity_key="min_cosine", default_batch_size=4, real_weights=False)


def test_a_trace_that_fixed_a_data_dependent_branch_is_refused_not_proved_on_its_own_rows(tmp_path):
    workload = _branchy_workload()
    with pytest.raises(ExportError, match="fixed a value computed from a tensor"):
        export_onnx(workload.model, workload, tmp_path / "b.onnx")
    assert not (tmp_path / "b.onnx").exists()  # a file that failed its proof is not left for a runtime to load
    with pytest.raises(RuntimeError, match="fixed a value computed from a tensor"):
        build(workload, [default_config("openvino")], CPU)


def test_export_refuses_bad_outputs_and_invalid_plans_in_one_line(digits_plan, tmp_path):
    from overdrive.core.errors import ConfigError, PlanError

    (tmp_path / "taken.onnx").write_bytes(b"x")
    with pytest.raises(ConfigError, match="exists; pass overwrite=True"):
        export(digits_plan, "onnx", tmp_path / "taken.onnx")
    with pytest.raises(ConfigError, match="is a folder"):
        export(digits_plan, "onnx", tmp_path, overwrite=True)
    with pytest.raises(ConfigError, match="cannot write there"):
        export(digits_plan, "pt2", "/proc/x.pt2")
    bad = tmp_path / "bad.json"
    Plan(workload="digits-cnn", device="cpu", batch_size=8, steps=[default_config("bf16"), default_config("onnxruntime")]).save(bad)
    with pytest.raises(PlanError, match="cannot follow bf16"):
        export(bad, "onnx", tmp_path / "bad.onnx")


def test_pt2_says_it_does_not_carry_a_runtime(tmp_path):
    path = tmp_path / "plan.json"
    Plan(workload="digits-cnn", device="cpu", batch_size=8, steps=[default_config("bn-fold"), default_config("onnxruntime")]).save(path)
    result = export(path, "pt2", tmp_path / "d.pt2")
    assert result.carried == ["bn-fold"] and result.not_carried == ["onnxruntime (a runtime of its own)"]


def test_onnxruntime_static_int8_calibrates_on_training_rows_and_needs_them():
    import dataclasses

    from overdrive.techniques.runtime.onnx_runtime import OnnxRuntimeInt8Config

    workload = make_conv_workload()
    static = OnnxRuntimeInt8Config(calibration="static")
    with pytest.raises(RuntimeError, match="training rows"):
        build(workload, [static], CPU)
    trained = dataclasses.replace(workload, train_samples=list(workload.samples), samples=list(workload.samples))
    model, _ = build(trained, [static], CPU)
    inputs = _rows(trained, 8)
    with torch.no_grad():
        cosine = torch.nn.functional.cosine_similarity(model(*inputs), trained.model(*inputs), dim=-1)
    assert cosine.min() > 0.95
    assert conflict([default_config("prune-channels")], default_config("onnxruntime")) is None  # prune in PyTorch, then export


def test_a_triton_repository_takes_a_second_model_but_not_the_same_one_twice(digits_plan, tmp_path):
    from overdrive.core.errors import ConfigError

    export(digits_plan, "triton", tmp_path / "repo")
    with pytest.raises(ConfigError, match="already holds a model 'digits-cnn'"):
        export(digits_plan, "triton", tmp_path / "repo")
    export(digits_plan, "triton", tmp_path / "repo", name="digits-2")
    assert sorted(p.name for p in (tmp_path / "repo").iterdir()) == ["digits-2", "digits-cnn"]


class _BatchBranch(nn.Module):
    """A branch on the batch size: a graph traced at one batch size keeps its side of it."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 4), nn.Linear(8, 4)

    def forward(self, x):
        if x.shape[0] > 4:
            return self.a(x)
        return self.b(x) - 5


def test_a_graph_that_fixed_a_branch_on_the_batch_size_is_refused(tmp_path):
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(8, generator=g) for _ in range(8)]  # the example traces at batch 4
    workload = Workload(name="batch-branch", model=_BatchBranch().eval(), samples=rows, collate=lambda r: (torch.stack(r),),
                        fidelity=lambda o, r: {}, fidelity_key="min_cosine", default_batch_size=4, real_weights=False)
    with pytest.raises(ExportError, match="max \\|diff\\||refused"):
        export_onnx(workload.model, workload, tmp_path / "b.onnx")
    from overdrive.deploy.formats import _pt2

    with pytest.raises(ExportError, match="refuses a batch of|differs"):
        _pt2(workload, [], tmp_path / "b.pt2")


def test_kserve_refuses_a_folder_that_holds_other_files(digits_plan, tmp_path):
    from overdrive.core.errors import ConfigError

    (tmp_path / "deploy").mkdir()
    (tmp_path / "deploy" / "other.txt").write_text("x")
    with pytest.raises(ConfigError, match="exists and is not empty"):
        export(digits_plan, "kserve", tmp_path / "deploy")


def test_an_int8_file_a_plan_ran_is_exported_with_its_own_difference_not_the_fp32_proof(tmp_path):
    path = tmp_path / "plan.json"
    Plan(workload="digits-cnn", device="cpu", batch_size=16, steps=[default_config("onnxruntime-int8")]).save(path)
    result = export(path, "onnx", tmp_path / "int8.onnx")
    assert result.carried == ["onnxruntime-int8"] and "int8 quantisation's" in result.notes[0]
    assert result.max_abs_diff > 1e-4  # the quantised file's own difference, measured on real rows
    got = ort_session(result.path).run(None, {"input": np.zeros((3, 1, 8, 8), np.float32)})[0]
    assert got.shape == (3, 10)
