"""The cache of exports (`overdrive.files.cache`): nothing is paid twice, and nothing wrong is reused.

How it could be silently wrong, each tested: a model whose weights or code changed but whose key
did not (a stale file answering for another model); a cached file damaged or replaced (the proof
at every use refuses it); a half-written entry read by another process; caching switched off still
writing files.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from overdrive.files import cache as cache_mod
from overdrive.files import onnx as onnx_mod
from overdrive.files.onnx import ExportError, cached_onnx
from overdrive.techniques import default_config
from overdrive.tuning.plan import Plan
from tests.conftest import make_conv_workload

SPEC = "tests.fixtures.user_models:build"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv(cache_mod.CACHE_ENV, str(root))
    return root


@pytest.fixture
def exports(monkeypatch):
    """Counts the real exports (`files.onnx.export_onnx` calls)."""
    calls = []
    real = onnx_mod.export_onnx

    def counted(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(onnx_mod, "export_onnx", counted)
    return calls


def test_the_second_export_of_the_same_model_is_read_from_the_cache(cache, exports):
    workload = make_conv_workload()
    first = cached_onnx(workload.model, workload)
    second = cached_onnx(workload.model, workload)
    assert len(exports) == 1 and first.path == second.path and first.path.is_relative_to(cache)
    assert "from the cache" in second.notes and "from the cache" not in first.notes
    assert second.max_abs_diff is not None and second.max_abs_diff < 1e-4  # proved again at this use


def test_changed_weights_or_code_miss_the_cache(cache, exports):
    workload = make_conv_workload()
    cached_onnx(workload.model, workload)
    with torch.no_grad():
        workload.model.head.bias.add_(1.0)
    changed = cached_onnx(workload.model, workload)
    assert len(exports) == 2 and "from the cache" not in changed.notes

    class SameWeightsOtherCode(type(workload.model)):
        def forward(self, x):
            return super().forward(x) * 2.0

    other = SameWeightsOtherCode()
    other.load_state_dict(workload.model.state_dict())
    workload.model = other.eval()
    doubled = cached_onnx(workload.model, workload)
    assert len(exports) == 3 and "from the cache" not in doubled.notes


def test_a_cached_file_that_answers_otherwise_is_refused_and_removed(cache, exports):
    workload = make_conv_workload()
    good = cached_onnx(workload.model, workload)
    other = make_conv_workload()
    with torch.no_grad():
        other.model.head.weight.mul_(-1.0)
    onnx_mod.export_onnx(other.model, other, good.path, prove=False)  # the entry's file replaced behind its back
    with pytest.raises(ExportError, match="differs from PyTorch"):
        cached_onnx(workload.model, workload)
    assert not good.path.exists()
    again = cached_onnx(workload.model, workload)  # exported afresh, not the damaged file
    assert "from the cache" not in again.notes and again.max_abs_diff < 1e-4


def test_caching_off_writes_nothing_and_still_exports(tmp_path, monkeypatch, exports):
    monkeypatch.setenv(cache_mod.CACHE_ENV, "off")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    workload = make_conv_workload()
    first = cached_onnx(workload.model, workload)
    second = cached_onnx(workload.model, workload)
    assert len(exports) == 2 and first.path != second.path and first.path.exists()
    assert not (tmp_path / "xdg").exists()


def test_a_half_written_entry_is_never_read(cache):
    calls = []

    def failing(folder):
        (folder / "model.onnx").write_bytes(b"half")
        calls.append(folder)
        raise RuntimeError("the exporter died")

    with pytest.raises(RuntimeError):
        cache_mod.cached("onnx", {"k": 1}, failing)
    assert not calls[0].exists() and not list((cache / "onnx").iterdir())
    entry = cache_mod.cached("onnx", {"k": 1}, lambda folder: {"made": True})
    assert entry.meta == {"made": True} and not entry.hit


def test_the_cache_keeps_under_its_limit_dropping_the_least_recently_used(cache):
    import os
    import time

    for i in range(3):
        cache_mod.cached("blob", {"i": i}, lambda folder: (folder / "x").write_bytes(b"\0" * 1000) and {})
        stamp = time.time() - 100 + i
        for meta in (cache / "blob").glob("*/meta.json"):
            if meta.stat().st_mtime > stamp:
                os.utime(meta, (stamp, stamp))
    hit = cache_mod.cached("blob", {"i": 0}, lambda folder: pytest.fail("entry 0 is there"))  # used now: the newest
    assert hit.hit
    removed = cache_mod.evict(cache, limit_bytes=2500)
    kept = {e.parent.name for e in (cache / "blob").glob("*/meta.json")}
    assert len(removed) == 1 and hit.folder.name in kept and len(kept) == 2


def test_a_second_run_and_serve_of_a_runtime_plan_start_without_exporting(tmp_path, cache, exports):
    """The issue's criterion: the export is paid once, by the first start of a plan with a runtime."""
    from overdrive import cli
    from overdrive.serve.runner import load_served_model

    path = tmp_path / "plan.json"
    Plan(workload=SPEC, device="cpu", batch_size=4, steps=[default_config("onnxruntime")]).save(path)
    rows = np.random.default_rng(0).standard_normal((10, 16)).astype(np.float32)
    np.save(tmp_path / "rows.npy", rows)
    outputs = []
    for i in range(2):
        out = tmp_path / f"out{i}.npy"
        assert cli.main(["run", str(path), "--input", str(tmp_path / "rows.npy"), "--output", str(out)]) == 0
        outputs.append(np.load(out))
    assert len(exports) == 1
    np.testing.assert_array_equal(outputs[0], outputs[1])
    served, _, _ = load_served_model(str(path), device="cpu", instances=1)
    assert len(exports) == 1  # serve starts from the same file
    x = torch.from_numpy(rows[:3])
    np.testing.assert_allclose(served.execute([(x,)], 0)[0], outputs[0][:3], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("technique, maker", [("openvino", "overdrive.techniques.runtime.openvino_runtime.convert"),
                                              ("onnxruntime-int8", "onnxruntime.quantization.quantize_dynamic")])
def test_converted_and_quantised_files_are_cached_too(cache, monkeypatch, technique, maker):
    import importlib

    from overdrive.techniques.compose import build

    module_name, name = maker.rsplit(".", 1)
    module = importlib.import_module(module_name)
    real, calls = getattr(module, name), []
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(1) or real(*a, **k))
    workload = make_conv_workload()
    x = torch.stack(workload.samples[:4])
    first, _ = build(workload, [default_config(technique)], torch.device("cpu"))
    second, _ = build(workload, [default_config(technique)], torch.device("cpu"))
    assert len(calls) == 1 and list(cache.glob(f"{technique}/*/meta.json"))
    with torch.no_grad():
        torch.testing.assert_close(first(x), second(x))


def test_the_per_layer_search_is_kept_and_not_run_again(cache, monkeypatch):
    """mixed-int8's sensitivity table: a second process (the in-process memo cleared) reads it back."""
    from overdrive.techniques.compose import build
    from overdrive.techniques.precision import mixed
    from tests.conftest import make_vit_workload

    calls = []
    real = mixed.search
    monkeypatch.setattr(mixed, "search", lambda *a, **k: calls.append(1) or real(*a, **k))
    workload = make_vit_workload()
    reports_first, reports_second = [], []
    build(workload, [default_config("mixed-int8")], torch.device("cpu"), reports_first)
    mixed._CACHE.clear()  # what a new process starts with
    build(workload, [default_config("mixed-int8")], torch.device("cpu"), reports_second)
    assert len(calls) == 1 and list(cache.glob("sensitivity/*/meta.json"))
    first, second = (next(r for r in reports if r.get("technique") == "mixed-int8") for reports in (reports_first, reports_second))
    assert first["chosen"] == second["chosen"] and first["layers"] == second["layers"]


def _helper(x):
    return x


class _CallsAHelper(torch.nn.Module):
    """Its forward calls a module-level function: code no module class holds."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(16, 4)

    def forward(self, x):
        return _helper(self.linear(x))


def test_code_outside_the_module_classes_that_changes_the_answers_misses_the_cache(cache, monkeypatch):
    """OpenVINO's IR is not proved at each use as an ONNX file is: its key must see a changed helper."""
    from overdrive.techniques.compose import build
    from overdrive.tuning.api import as_workload

    torch.manual_seed(0)
    model = _CallsAHelper().eval()
    x = torch.randn(8, 16)
    first, _ = build(as_workload(model, x), [default_config("openvino")], torch.device("cpu"))
    monkeypatch.setitem(globals(), "_helper", lambda y: y * 2.0)  # the user edits the helper, not the class
    second, _ = build(as_workload(model, x), [default_config("openvino")], torch.device("cpu"))
    assert len(list(cache.glob("openvino/*/meta.json"))) == 2
    with torch.no_grad():
        torch.testing.assert_close(second(x), model(x), rtol=2e-2, atol=2e-2)  # bf16 inside OpenVINO
        assert not torch.allclose(first(x), second(x), rtol=0.1, atol=0.1)
