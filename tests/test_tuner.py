"""The tuner's decisions: rejection with the figure that broke the budget, rollback of slow steps,
alternatives within a group, and the plan it writes."""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest
import torch

from overdrive.techniques import Stage, Technique, TechniqueConfig, config_from_dict, config_to_dict, default_config
from overdrive.techniques.registry import ForwardWrapper, get_technique, register, unregister
from overdrive.tuning.plan import Plan
from overdrive.tuning.guard import FidelityRule, Guard
from overdrive.tuning.tuner import Tuner

CPU = torch.device("cpu")


@dataclass(frozen=True, kw_only=True)
class _NoConfig(TechniqueConfig):
    pass


class _Noisy(ForwardWrapper):
    scale = 2.0  # noise ÷ mean |output|

    def forward(self, *args):
        out = self.inner(*args)
        return out + self.scale * torch.randn_like(out) * out.abs().mean()


class _SlightlyNoisy(ForwardWrapper):
    """A lossy step whose error is a function of each row alone (so it is batch-invariant and repeats from run
    to run): cosine stays well above 0, labels near a tie flip."""

    def forward(self, *args):
        out = self.inner(*args)
        return out + 0.3 * torch.sin(997.0 * out) * out.abs().mean(dim=-1, keepdim=True)


class _Slow(ForwardWrapper):
    def forward(self, *args):
        time.sleep(0.05)  # 50 ms a call: far slower than the tiny model (under 1 ms), even on a loaded machine
        return self.inner(*args)


class _Broken(ForwardWrapper):
    def forward(self, *args):
        raise RuntimeError("kernel missing")


def _technique(name, wrapper, stage=Stage.GRAPH, group=None):
    """A registered technique `name` (with a config class of its own) that wraps the model in `wrapper`."""
    config = dataclass(frozen=True, kw_only=True)(type(f"{name}-config", (_NoConfig,), {"name": name}))
    register(type(name, (Technique,), {
        "config_cls": config, "stage": stage, "lossless": False, "group": group,
        "description": "test", "apply": lambda self, model, config, **_: wrapper(model),
    }))
    return get_technique(name)


@pytest.fixture
def fake_techniques():
    added = [_technique("t-noisy", _Noisy).name, _technique("t-slow", _Slow).name, _technique("t-broken", _Broken).name]
    yield added
    for name in added:
        unregister(name)


def _row(result, label):
    return next(r for r in result.rows if r.label == label)


def test_lossy_slow_and_broken_techniques_are_rejected_with_reasons(conv_workload, fake_techniques):
    result = Tuner(workload=conv_workload, device=CPU, batch_size=8, techniques=fake_techniques + ["channels-last"],
                   min_rounds=2, max_rounds=4, max_compare_s=2).run()
    noisy, slow, broken = (_row(result, n) for n in fake_techniques)
    assert not noisy.kept and noisy.reason.startswith("min_cosine") and "< 0.99 floor" in noisy.reason
    assert not slow.kept and slow.reason.startswith("not faster")
    assert not broken.kept and "kernel missing" in broken.reason
    assert all(n not in result.plan.names for n in fake_techniques)
    assert result.rows[0].phase == "baseline" and result.rows[-1].phase == "plan"


def test_accuracy_budget_rejects_with_the_drop(conv_workload):
    guard = Guard(min_fidelity=0.0, max_accuracy_drop=0.5, min_gain=0)  # one flipped label of 24 costs 4.2 pt
    _technique("t-slightly-noisy", _SlightlyNoisy)
    try:
        result = Tuner(workload=conv_workload, device=CPU, batch_size=8, techniques=["t-slightly-noisy"], guard=guard,
                       min_rounds=2, max_rounds=4, max_compare_s=2).run()
    finally:
        unregister("t-slightly-noisy")
    row = _row(result, "t-slightly-noisy")
    assert row.measurement.fidelity["min_cosine"] > 0.0
    if row.measurement.task_metric["accuracy_pct"] < result.baseline.task_metric["accuracy_pct"]:
        assert not row.kept and "accuracy drop" in row.reason and "pt budget" in row.reason
    else:  # noise happened not to flip a label; the row must then be kept (min_gain ≈ 0)
        assert row.kept


def test_group_alternatives_compose_at_most_one(conv_workload):
    guard = Guard(min_fidelity=0.9, min_gain=0)  # keep everything that runs
    _technique("t-prec-a", ForwardWrapper, Stage.PRECISION, group="precision").apply = lambda model, config, **_: model
    _technique("t-prec-b", ForwardWrapper, Stage.PRECISION, group="precision").apply = lambda model, config, **_: model
    try:
        result = Tuner(workload=conv_workload, device=CPU, batch_size=8, techniques=["t-prec-a", "t-prec-b"],
                       guard=guard, min_rounds=2, max_rounds=4, max_compare_s=2).run()
    finally:
        unregister("t-prec-a"), unregister("t-prec-b")
    composed = [r for r in result.rows if r.phase == "compose"]
    assert len(composed) == 2
    assert sum(r.kept for r in composed) == 1
    assert any("alternative to" in r.reason for r in composed)
    assert len(result.plan.steps) == 1


def test_guard_validates():
    with pytest.raises(ValueError):
        Guard(min_fidelity=1.5)
    with pytest.raises(ValueError):
        Guard(max_accuracy_drop=-1)


def test_plan_round_trip_rebuilds_the_same_model(conv_workload, tmp_path):
    result = Tuner(workload=conv_workload, device=CPU, batch_size=8, techniques=["bn-fold", "channels-last"],
                   guard=Guard(min_gain=0), min_rounds=2, max_rounds=4, max_compare_s=2).run()
    path = tmp_path / "plan.json"
    result.plan.save(path)
    loaded = Plan.load(path)
    assert loaded.names == result.plan.names and loaded.batch_size == 8 and loaded.device == "cpu"
    model, _ = loaded.build(conv_workload, CPU)
    x = torch.stack(conv_workload.samples[:4])
    with torch.no_grad():
        torch.testing.assert_close(model(x), conv_workload.model(x), rtol=1e-4, atol=1e-5)


def test_plan_rejects_garbage(tmp_path):
    from overdrive.core.errors import PlanError

    bad = tmp_path / "plan.json"
    bad.write_text('{"version": 1, "workload": "x", "device": "cpu", "batch_size": 4, "techniques": [{"name": "warp-drive"}]}')
    with pytest.raises(PlanError, match="not an overdrive plan"):
        Plan.load(bad)
    with pytest.raises(PlanError, match="no such file"):
        Plan.load(tmp_path / "missing.json")


def test_step_default_uses_the_registered_config():
    step = default_config("compile")
    assert config_to_dict(step)["config"]["mode"] == "default"
    assert config_from_dict(config_to_dict(step)) == step


def test_guard_rejects_nan_fidelity_and_nonfinite_outputs():
    from overdrive.core.measure import Measurement

    def measurement(**kw):
        return Measurement(batch_size=1, num_samples=1, num_timed_calls=1, latency_ms={}, samples_per_s=1.0,
                           peak_memory_bytes=None, peak_memory_kind="process_rss_hwm", warmup_s=0.0, compile_s=0.0, **kw)

    guard, rule = Guard(), FidelityRule(key="min_cosine", floor=0.99)
    assert "floor" in guard.violation(measurement(fidelity={"min_cosine": float("nan")}), None, rule)
    assert "non-finite" in guard.violation(measurement(fidelity={"min_cosine": 1.0}, nonfinite_outputs=3), None, rule)
    assert guard.violation(measurement(fidelity={"min_cosine": 0.995}), None, rule) is None
    degenerate = FidelityRule(key="max_abs_error", floor=1e-5, degenerate="all zero")
    assert "tolerance" in guard.violation(measurement(fidelity={"max_abs_error": float("nan")}), None, degenerate)
    assert guard.violation(measurement(fidelity={"max_abs_error": 0.0}), None, degenerate) is None
    with pytest.raises(ValueError):
        Guard(min_gain=float("nan"))


class _Offset(ForwardWrapper):
    def forward(self, *args):
        return self.inner(*args) + 1e-3  # an absolute error that cosine against zeros could not see


def test_a_degenerate_reference_is_named_and_judged_by_max_absolute_error(conv_workload):
    """Agreement with outputs that are all zero means nothing: the rule says so and judges by max |error|."""
    with torch.no_grad():
        conv_workload.model.head.weight.zero_()
        conv_workload.model.head.bias.zero_()
    _technique("t-offset", _Offset)
    try:
        result = Tuner(workload=conv_workload, device=CPU, batch_size=8, techniques=["channels-last", "t-offset"],
                       guard=Guard(min_gain=0), min_rounds=2, max_rounds=2).run()
    finally:
        unregister("t-offset")
    assert "within 1e-06 of zero" in result.rule.degenerate and result.rule.key == "max_abs_error"
    lossless, offset = _row(result, "channels-last"), _row(result, "t-offset")
    assert lossless.kept and lossless.measurement.fidelity["max_abs_error"] <= result.rule.floor
    assert not offset.kept and offset.reason.startswith("max_abs_error 0.001 >")


def test_torchvision_heads_that_start_at_zero_get_random_weights():
    import torchvision

    from overdrive.workloads.vision import _random_head

    vit = torchvision.models.VisionTransformer(image_size=32, patch_size=8, num_layers=1, num_heads=2, hidden_dim=16,
                                               mlp_dim=32, num_classes=5).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert not vit(x).any()  # torchvision zero-initialises the ViT head
        assert _random_head(vit)(x).abs().min() > 0


@dataclass(frozen=True, kw_only=True)
class _ModeConfig(TechniqueConfig):
    name = "t-modes"
    slow: bool = True


class _Modes(Technique):
    config_cls = _ModeConfig
    stage = Stage.COMPILE
    lossless = True
    description = "test: a technique with a slow default mode and a fast one"

    def variants(self, config, workload, device):
        return [config, _ModeConfig(slow=False)]

    def apply(self, model, config, **_):
        return _Slow(model) if config.slow else model


def test_variants_each_get_a_row_and_the_kept_one_composes_with_roofline_and_audit(conv_workload):
    register(_Modes)
    try:
        result = Tuner(workload=conv_workload, device=CPU, batch_size=8, techniques=["t-modes"],
                       guard=Guard(min_gain=0), min_rounds=2, max_rounds=4, max_compare_s=2).run()
        named = Tuner(workload=conv_workload, device=CPU, batch_size=8, techniques=["t-modes"],
                      configs={"t-modes": _ModeConfig(slow=True)}, guard=Guard(min_gain=0), min_rounds=2,
                      max_rounds=2, max_compare_s=2).run()
    finally:
        unregister("t-modes")
    slow, fast = _row(result, "t-modes"), _row(result, "t-modes (slow=False)")
    assert slow.kept and fast.kept and fast.config == _ModeConfig(slow=False)  # min_gain 0 keeps both
    assert fast.measurement.samples_per_s > 2 * slow.measurement.samples_per_s
    assert result.plan.steps == [_ModeConfig(slow=False)]  # the faster kept variant composes
    assert [r.label for r in named.rows if r.phase == "alone"] == ["t-modes"]  # a config the user named: no search
    baseline, plan = result.rows[0], next(r for r in result.rows if r.phase == "plan")
    for row in (baseline, plan):
        assert row.measurement.audit["num_syncs"] == 0 and row.measurement.audit["aten_ops"] > 0
        assert 0 < row.measurement.roofline["fraction"] and row.measurement.roofline["dtype"] == "float32"
    assert all(r.measurement.roofline for r in result.rows if r.measurement is not None)
    assert "float32 GEMM" in result.peaks


class _Same(ForwardWrapper):
    def forward(self, *args):
        return self.inner(*args)


def test_the_headline_is_timed_for_a_figure_not_a_decision(conv_workload):
    """The plan's gain is what a user quotes and `bench` re-measures: it gets `HEADLINE_ROUNDS` clean rounds at
    least (a decision may stop at 4, whose deviation can read a fifth of the machine's), never past `max_rounds`."""
    from overdrive.core.gain import HEADLINE_ROUNDS

    _technique("t-same", _Same)
    try:
        full = Tuner(workload=conv_workload, device=CPU, batch_size=8, techniques=["t-same"], guard=Guard(min_gain=0)).run()
        capped = Tuner(workload=conv_workload, device=CPU, batch_size=8, techniques=["t-same"], guard=Guard(min_gain=0),
                       min_rounds=2, max_rounds=3).run()
    finally:
        unregister("t-same")
    trial, plan = _row(full, "t-same"), full.rows[-1]
    assert plan.phase == "plan" and plan.steps == ["t-same"], [(r.label, r.reason) for r in full.rows]
    assert plan.gain.rounds >= HEADLINE_ROUNDS or plan.gain.busy, plan.gain
    assert trial.gain.rounds < plan.gain.rounds or plan.gain.busy  # the decision stopped sooner
    capped_gain = capped.rows[-1].gain  # max_rounds caps the clean rounds; a busy gain also counts those set aside,
    clean = capped_gain.rounds - (capped_gain.preempted_rounds if capped_gain.busy else 0)  # which are capped alike
    assert clean <= 3 and capped_gain.preempted_rounds <= 3, capped_gain
