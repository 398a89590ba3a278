"""`overdrive run` interrupted and resumed: crashes at any batch (byte-identical output), real
SIGKILL and Ctrl-C, a changed input, a second writer, a finished output, --max-errors on resume."""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from overdrive import cli
from overdrive.run.job import RunConfig, run_offline
from overdrive.run.resume import Parts
from overdrive.run.threads import _SimulatedCrash
from overdrive.run.threads import crash_after as crashing_after
from tests.fixtures.run_io import CHAR_TEXT, ENV, cli_run, exit_code, mixed_input, run, sentences, wait_for_chunks, write_lines
from tests.fixtures.run_models import char_text


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fmt=st.sampled_from(["npy", "parquet", "csv", "jsonl"]), crash_after=st.integers(1, 14),
       second_crash=st.one_of(st.none(), st.integers(1, 8)), torn=st.booleans())
def test_resume_after_a_crash_is_byte_identical(tmp_path_factory, fmt, crash_after, second_crash, torn):
    """Property: however many batches ran before each crash, and whether the last chunk was torn
    (its errors written, its outputs not, a temporary left behind), resume gives the same bytes."""
    tmp = tmp_path_factory.mktemp("resume")
    inp, _, _ = mixed_input(tmp, n=53)
    options = {"batch_size": 4, "chunk_size": 12}
    reference = tmp / f"ref.{fmt}"
    run(inp, reference, **options)
    out = tmp / f"out.{fmt}"
    for crash in [crash_after, second_crash]:
        if crash is None:
            continue
        try:  # 14 batches in all: the first crash always comes; the second only if batches are left
            with crashing_after(crash):
                run_offline(RunConfig(workload=None, input=inp, output=out, device="cpu", resume=True, **options),
                            workload=char_text())
            assert crash != crash_after, "the first run should have crashed"
        except _SimulatedCrash:
            pass
    parts = Parts(out)
    if torn and parts.done():
        last = max(parts.done())
        parts.chunk_path(last).rename(parts.chunk_path(last).with_name("x.tmp"))
    summary = run(inp, out, resume=True, **options)
    assert out.read_bytes() == reference.read_bytes()
    assert Path(summary.errors_path).read_bytes() == Path(f"{reference}.errors.jsonl").read_bytes()
    assert summary.nothing_to_resume or summary.done_before + summary.processed == 53  # the 2nd run may have finished


def test_sigkill_and_ctrl_c_then_resume_are_byte_identical(tmp_path):
    """Real kills at random moments (seeded): SIGKILL twice, then Ctrl-C, then --resume to the end."""
    inp, _, _ = mixed_input(tmp_path, n=240)  # 20 chunks of 3 batches: work is left at every signal
    args = ["--input", str(inp), "--device", "cpu", "--batch-size", "4", "--chunk-size", "12"]
    reference = tmp_path / "ref.parquet"
    run(inp, reference, batch_size=4, chunk_size=12)
    out = tmp_path / "out.parquet"
    slow = {**ENV, "OVERDRIVE_TEST_BATCH_SLEEP_S": "0.05"}
    rng = random.Random(1)
    for round_, sig in enumerate([signal.SIGKILL, signal.SIGKILL, signal.SIGINT]):
        before = len(Parts(out).done())
        proc = cli_run(CHAR_TEXT, *args, "--output", str(out), *(["--resume"] if round_ else []), env=slow)
        wait_for_chunks(out, proc, before + 1)
        time.sleep(rng.uniform(0.0, 0.2))
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
        if sig == signal.SIGINT:
            assert proc.returncode == 130 and "rerun with --resume" in err, err
        else:
            assert proc.returncode == -signal.SIGKILL
        assert not out.exists()
    proc = cli_run(CHAR_TEXT, *args, "--output", str(out), "--resume")
    stdout, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert out.read_bytes() == reference.read_bytes()
    assert "done before the resume" in stdout
    again = cli_run(CHAR_TEXT, *args, "--output", str(out), "--resume")
    stdout, _ = again.communicate(timeout=60)
    assert again.returncode == 0 and "nothing to resume" in stdout


def test_resume_refuses_a_changed_input(tmp_path):
    inp, _, _ = mixed_input(tmp_path)
    out = tmp_path / "out.npy"
    with pytest.raises(_SimulatedCrash), crashing_after(3):
        run_offline(RunConfig(workload=None, input=inp, output=out, device="cpu", batch_size=4, chunk_size=8),
                    workload=char_text())
    write_lines(inp, sentences(61))
    assert cli.main(["run", CHAR_TEXT, "--input", str(inp), "--output", str(out), "--resume", "--device", "cpu"]) == 2


def test_a_second_run_into_the_same_output_is_refused_while_the_first_runs(tmp_path, capsys):
    inp, _, _ = mixed_input(tmp_path, n=240)
    out = tmp_path / "out.npy"
    first = cli_run(CHAR_TEXT, "--input", str(inp), "--output", str(out), "--device", "cpu", "--batch-size", "4",
                    "--chunk-size", "12", env={**ENV, "OVERDRIVE_TEST_BATCH_SLEEP_S": "0.05"})
    try:
        wait_for_chunks(out, first, 1)
        for extra in ([], ["--resume"], ["--overwrite"]):
            assert exit_code(["run", CHAR_TEXT, "--input", str(inp), "--output", str(out), "--device", "cpu", *extra]) == 2
            assert "another overdrive run is writing" in capsys.readouterr().err
    finally:
        first.kill()
        first.communicate()
    assert exit_code(["run", CHAR_TEXT, "--input", str(inp), "--output", str(out), "--device", "cpu", "--resume"]) == 0


def test_resume_of_a_finished_output_claims_nothing(tmp_path, capsys):
    inp, _, _ = mixed_input(tmp_path)
    out = tmp_path / "o.npy"
    out.write_bytes(b"something else")
    assert cli.main(["run", CHAR_TEXT, "--input", str(inp), "--output", str(out), "--device", "cpu", "--resume"]) == 0
    assert "no interrupted run is recorded for it" in capsys.readouterr().out and out.read_bytes() == b"something else"


def test_max_errors_holds_on_resume(tmp_path, capsys):
    inp, _, _ = mixed_input(tmp_path, n=40)  # bad lines 4, 11, 18, 25, 32, 39
    args = ["run", CHAR_TEXT, "--input", str(inp), "--output", str(tmp_path / "o.npy"), "--device", "cpu",
            "--chunk-size", "8"]
    assert cli.main([*args, "--max-errors", "5"]) == 1
    err = capsys.readouterr().err
    assert "6 records failed, more than --max-errors 5 (the first: line 4: invalid UTF-8" in err
    assert cli.main([*args, "--resume", "--max-errors", "2"]) == 1  # all 5 chunks were done, holding the 6 failures
    assert "6 records failed in the chunks already done, more than --max-errors 2" in capsys.readouterr().err
