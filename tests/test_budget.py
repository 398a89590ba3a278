"""The time budget (`overdrive.tuning.budget`): what is tried first, what is left untried and said
so, the history that makes a second run's estimates measured ones, and an honest time left.

How it could be silently wrong, each tested: a candidate left out without a row saying so; the
plan's headline skipped for lack of time; the table's order changing with the order of trial; a
prediction shown as a measurement; an estimate of time left above what the budget has left.
"""

from __future__ import annotations

import math
import time

import pytest
import torch

import overdrive
from overdrive.core.errors import ConfigError
from overdrive.core.workload import Workload
from overdrive.files import cache as cache_mod
from overdrive.techniques import get_technique
from overdrive.tuning import budget as budget_mod
from overdrive.tuning.budget import Budget, History, Signals, estimate, padding_share, resolve_budget
from overdrive.tuning.guard import Guard
from overdrive.tuning.tuner import Tuner

CPU = torch.device("cpu")
TECHNIQUES = ["channels-last", "bf16", "inference-mode"]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A cache of its own (a fresh history), holding the trained digits-cnn of the real one (trained once)."""
    from overdrive.workloads.digits import build_digits_cnn

    build_digits_cnn()
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "digits-cnn").symlink_to(cache_mod.cache_root() / "digits-cnn", target_is_directory=True)
    monkeypatch.setenv(cache_mod.CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def _tuner(workload, seconds, **kwargs):
    return Tuner(workload=workload, device=CPU, batch_size=8, techniques=TECHNIQUES, guard=Guard(min_gain=0),
                 min_rounds=2, max_rounds=2, budget=Budget(seconds), **kwargs)


def test_resolve_budget():
    assert resolve_budget(None) == budget_mod.DEFAULT_TIME_BUDGET_S
    assert resolve_budget(0) is None and resolve_budget(math.inf) is None and resolve_budget(90) == 90.0
    for bad in (-1, math.nan, "60", True):
        with pytest.raises(ValueError):
            resolve_budget(bad)
    with pytest.raises(ConfigError, match="time_budget_s"):
        overdrive.optimize("digits-cnn", time_budget_s=-5)


def test_padding_share_of_text_batches_is_that_of_the_baselines_batches():
    rows = [torch.ones(n, dtype=torch.long) for n in (2, 8, 3, 7)]
    workload = Workload(name="t", model=torch.nn.Identity(), samples=rows, collate=lambda r: (r,),
                        fidelity=lambda o, r: {}, fidelity_key="x", sample_length=len, default_batch_size=2)
    # the baseline batches text longest first, as run does: [8, 7] pads to 16, [3, 2] to 6 (in data order: 30)
    assert padding_share(workload, [0, 1, 2, 3], 2) == pytest.approx(1 - 20 / 22)
    workload.sample_length = None
    assert padding_share(workload, [0, 1], 2) is None


def test_a_prediction_comes_from_signals_and_a_measurement_from_history(tmp_path):
    signals = Signals(params_m=1.0, pass_s=0.1, compare_s=2.0, padding=0.5,
                      shares={budget_mod.default_dtype_layers(): 0.9}, peaks={"float32": 1e11, "bfloat16": 4e11})
    history = History(tmp_path / "h.json")
    bf16 = get_technique("bf16")
    predicted = estimate(bf16, bf16.config_cls(), signals, history, "bf16", CPU)
    amdahl = 1 / (0.1 + 0.9 / 4)
    assert predicted.gain == pytest.approx(1 + budget_mod.DAMPING * (amdahl - 1))
    assert predicted.source.startswith("predicted: 90% of the FLOPs")
    bucketing = get_technique("length-bucketing")
    assert estimate(bucketing, bucketing.config_cls(), signals, history, "length-bucketing", CPU).gain == \
        pytest.approx(1 + budget_mod.DAMPING * 1.0)  # half the tokens are padding: 2× at most
    history.record("bf16", gain=0.8, setup_s=7.0, trial_s=9.0, kept=False)
    measured = estimate(bf16, bf16.config_cls(), signals, History(tmp_path / "h.json"), "bf16", CPU)  # read back
    assert measured.source == "measured for this model before" and measured.setup_s == 7.0 and measured.gain == 0.8
    assert measured.priority < 0 < predicted.priority


def test_a_tight_budget_leaves_candidates_untried_says_so_and_still_measures_the_plan(conv_workload, cache):
    result = _tuner(conv_workload, 1.0).run()
    labels = [r.label for r in result.rows]
    assert labels[:4] == ["baseline (eager fp32)", *TECHNIQUES]  # every technique has its row, in the table's order
    untried = [r for r in result.rows if r.reason.startswith("untried")]
    assert untried and all("the time budget (1 s)" in r.reason and "--time-budget" in r.reason for r in untried)
    assert all(r.measurement is None and not r.kept for r in untried)
    assert result.rows[-1].phase == "plan"  # the headline is measured whatever the budget


def test_no_budget_tries_everything_and_records_what_it_measured(conv_workload, cache):
    result = _tuner(conv_workload, None).run()
    assert not any(r.reason.startswith("untried") for r in result.rows)
    tried = [r for r in result.rows if r.phase == "alone"]
    assert all(r.setup_s is not None and r.trial_s >= r.setup_s for r in tried)
    history = History.for_model(conv_workload.model, CPU, 8)
    assert set(history.entries) == set(TECHNIQUES)
    assert history.entries["bf16"]["gain"] == pytest.approx(next(r for r in tried if r.label == "bf16").gain.ratio)


def test_what_was_measured_before_decides_the_order_of_trial_and_the_time_left_stays_in_the_budget(
        conv_workload, cache, monkeypatch):
    history = History.for_model(conv_workload.model, CPU, 8)
    for label, gain in (("channels-last", 0.9), ("bf16", 1.0), ("inference-mode", 3.0)):
        history.record(label, gain=gain, setup_s=0.1, trial_s=1.0, kept=gain > 1)
    order = []
    real = Tuner._try

    def spy(self, phase, label, *args, **kwargs):
        if phase == "alone":
            order.append(label)
        return real(self, phase, label, *args, **kwargs)

    monkeypatch.setattr(Tuner, "_try", spy)
    seen = []
    tuner = _tuner(conv_workload, 600.0)
    tuner.progress = lambda description: seen.append((tuner.eta_s(), tuner.budget.left()))
    result = tuner.run()
    assert order[0] == "inference-mode" and order[-1] == "channels-last"
    assert [r.label for r in result.rows if r.phase == "alone"] == TECHNIQUES  # the table's order is not the trial's
    assert seen and all(eta <= left + 0.01 for eta, left in seen)  # `left` is read just after `eta`


def test_optimize_from_python_keeps_its_budget_and_the_cli_takes_the_flag(tmp_path, cache):
    from overdrive import cli

    started = time.monotonic()
    result = overdrive.optimize("digits-cnn", techniques=["bf16", "channels-last", "compile", "onnxruntime"],
                                num_samples=64, sweep_batch_sizes=[8, 32], time_budget_s=8)
    took = time.monotonic() - started
    assert result.time_budget_s == 8
    assert any(r.reason.startswith("untried") for r in result.rows) or took < 8 * 1.5
    assert took < 8 + 60, took  # a started candidate finishes; nothing new starts past the budget
    with pytest.raises(SystemExit) as refused:
        cli.main(["optimize", "digits-cnn", "--time-budget", "-1", "--out", str(tmp_path)])
    assert refused.value.code == 2


def test_a_risky_int8_is_predicted_less_and_alternatives_reserve_once(tmp_path, conv_workload):
    from overdrive.tuning.rows import Row

    risky, searched = get_technique("int8-dynamic"), get_technique("mixed-int8")
    shares = {t.dtype_layers or budget_mod.default_dtype_layers(): 1.0 for t in (risky, searched)}
    signals = Signals(params_m=1.0, pass_s=0.1, compare_s=2.0, shares=shares, peaks={"float32": 1e11, "int8": 4e11})
    history = History(tmp_path / "h.json")
    whole = estimate(risky, risky.config_cls(), signals, history, "int8-dynamic", CPU)
    per_layer = estimate(searched, searched.config_cls(), signals, history, "mixed-int8", CPU)
    assert "risk of breaking the fidelity floor" in whole.source
    assert per_layer.gain == pytest.approx(1 + budget_mod.DAMPING * 3.0)  # every FLOP in int8 at 4×
    assert whole.gain == pytest.approx(per_layer.gain ** 0.5)
    tuner = _tuner(conv_workload, 100.0)
    tuner.schedule.compare_s = [10.0]
    kept = [Row(phase="alone", label=name, steps=[name], kept=True, setup_s=setup)
            for name, setup in (("bf16", 1.0), ("mixed-int8", 50.0), ("channels-last", 2.0))]
    assert tuner.schedule.reserve(kept) == pytest.approx(2 * 10 + (50 + 10) + (2 + 10))  # bf16 and mixed-int8: one precision
