"""`overdrive run --resume` is refused when the model is not the interrupted run's: its weights
(a fingerprint of the state_dict) or a checkpoint its plan names changed."""

from __future__ import annotations

import time
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from overdrive import cli
from overdrive.core.errors import DataError
from overdrive.run.job import RunConfig, run_offline
from overdrive.core.digest import weights_fingerprint
from overdrive.run.resume import MANIFEST_VERSION, Parts, check_manifest, checkpoint_fingerprints
from overdrive.run.threads import _SimulatedCrash, crash_after
from overdrive.techniques.pruning.unstructured import PruneUnstructuredConfig
from tests.fixtures.run_io import mixed_input, npy_rows
from tests.fixtures.run_models import SCALE_ENV, WEIGHTS_ENV, expected_row

FROM_WEIGHTS = "tests.fixtures.run_models:char_text_from_weights"


def test_resume_after_the_weights_changed_is_refused_naming_them(tmp_path, monkeypatch, capsys):
    weights = tmp_path / "weights.pt"
    torch.save({"scale": torch.tensor(1.0)}, weights)
    monkeypatch.setenv(WEIGHTS_ENV, str(weights))
    inp, texts, bad = mixed_input(tmp_path, n=60)
    out = tmp_path / "out.npy"
    with pytest.raises(_SimulatedCrash), crash_after(3):
        run_offline(RunConfig(workload=FROM_WEIGHTS, input=inp, output=out, device="cpu", batch_size=4, chunk_size=8))
    assert Parts(out).done()
    torch.save({"scale": torch.tensor(2.0)}, weights)  # the model changed between the two runs
    args = ["run", FROM_WEIGHTS, "--input", str(inp), "--output", str(out), "--device", "cpu"]
    assert cli.main([*args, "--resume"]) == 2
    err = capsys.readouterr().err
    assert "the model's weights changed since the interrupted run (fingerprint " in err and "→" in err, err
    assert "--overwrite starts over" in err and not out.exists()
    assert cli.main([*args, "--overwrite"]) == 0
    good = [i for i in range(len(texts)) if i not in bad]
    np.testing.assert_allclose(npy_rows(out)[good], 2.0 * np.array([expected_row(texts[i]) for i in good]), rtol=1e-6)


def test_resume_after_a_change_the_weights_do_not_hold_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(SCALE_ENV, "1")
    inp, _, _ = mixed_input(tmp_path, n=60)
    out = tmp_path / "out.npy"
    with pytest.raises(_SimulatedCrash), crash_after(3):
        run_offline(RunConfig(workload="tests.fixtures.run_models:char_text_scaled_by_env", input=inp, output=out,
                              device="cpu", batch_size=4, chunk_size=8))
    monkeypatch.setenv(SCALE_ENV, "-3")  # the same weights, another answer
    args = ["run", "tests.fixtures.run_models:char_text_scaled_by_env", "--input", str(inp), "--output", str(out),
            "--device", "cpu", "--resume"]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert "the model answers differently than in the interrupted run" in err and not out.exists()


def test_resume_with_the_same_weights_goes_on(tmp_path, monkeypatch):
    weights = tmp_path / "weights.pt"
    torch.save({"scale": torch.tensor(1.0)}, weights)
    monkeypatch.setenv(WEIGHTS_ENV, str(weights))
    inp, _, _ = mixed_input(tmp_path, n=60)
    out = tmp_path / "out.npy"
    config = RunConfig(workload=FROM_WEIGHTS, input=inp, output=out, device="cpu", batch_size=4, chunk_size=8)
    with pytest.raises(_SimulatedCrash), crash_after(3):
        run_offline(config)
    torch.save({"scale": torch.tensor(1.0)}, weights)  # rewritten, same values
    summary = run_offline(RunConfig(**{**config.__dict__, "resume": True}))
    assert summary.done_before > 0 and summary.done_before + summary.processed == 60


def test_a_changed_plan_checkpoint_is_named(tmp_path):
    checkpoint = tmp_path / "prune-unstructured.pt"
    checkpoint.write_bytes(b"pruned weights, first version")
    steps = [PruneUnstructuredConfig(checkpoint=str(checkpoint))]
    parts = Parts(tmp_path / "out.npy")
    parts.dir.mkdir()
    before = {"version": MANIFEST_VERSION, "weights": "ab" * 32, "checkpoints": checkpoint_fingerprints(steps)}
    (parts.dir / "manifest.json").write_text(__import__("json").dumps(before))
    assert check_manifest(parts, dict(before), tmp_path / "out.npy") == before
    checkpoint.write_bytes(b"pruned weights, second version")
    with pytest.raises(DataError, match=r"plan checkpoint prune-unstructured.pt changed; .*overwrite=True starts over"):
        check_manifest(parts, before | {"checkpoints": checkpoint_fingerprints(steps)}, tmp_path / "out.npy")


def test_the_fingerprint_sees_every_parameter_and_buffer_byte():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).eval()
    base = weights_fingerprint(model)
    assert weights_fingerprint(model) == base
    with torch.no_grad():
        model[1].running_var[2] += 1e-6  # a buffer, by a hair
    assert weights_fingerprint(model) != base
    assert weights_fingerprint(model.to(torch.bfloat16)) != weights_fingerprint(model.float())
    with warnings.catch_warnings():  # torch.jit is deprecated; its modules are still models users bring
        warnings.simplefilter("ignore", FutureWarning)
        scripted = torch.jit.script(nn.Linear(3, 2))
    assert len(weights_fingerprint(scripted)) == 64


def test_fingerprinting_minilm_sized_weights_takes_well_under_a_second():
    model = nn.Linear(4800, 4800)  # 92 MB of float32, MiniLM's size
    weights_fingerprint(model)
    start = time.perf_counter()
    weights_fingerprint(model)
    assert time.perf_counter() - start < 1.0


def test_resume_with_another_batch_size_is_refused(tmp_path, capsys):
    from tests.fixtures.run_io import CHAR_TEXT
    from tests.fixtures.run_models import char_text

    inp, _, _ = mixed_input(tmp_path, n=60)
    out = tmp_path / "out.npy"
    with pytest.raises(_SimulatedCrash), crash_after(3):
        run_offline(RunConfig(workload=None, input=inp, output=out, device="cpu", batch_size=4, chunk_size=8),
                    workload=char_text())
    args = ["run", CHAR_TEXT, "--input", str(inp), "--output", str(out), "--device", "cpu", "--resume"]
    assert cli.main([*args, "--batch-size", "8"]) == 2
    err = capsys.readouterr().err
    assert "continues the interrupted run at its batch size 4" in err and "leave out --batch-size 8" in err, err
    assert Parts(out).done()  # the finished chunks are kept
    assert cli.main([*args, "--batch-size", "4"]) == 0 and out.exists()
