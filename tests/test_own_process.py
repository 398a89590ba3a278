"""`@pytest.mark.own_process` (tests/conftest.py): a test run in a fresh interpreter reports back as if run here —
a pass, a failure with its message, a skip with its reason, and a child that dies is a failure, never a pass."""

from __future__ import annotations

from pathlib import Path

pytest_plugins = ["pytester"]

CASES = '''
import ctypes, os, pytest

@pytest.mark.own_process
def test_passes():
    assert os.environ["OVERDRIVE_TEST_OWN_PROCESS"]  # it really ran in the child

@pytest.mark.own_process
def test_fails():
    assert 1 + 1 == 3, "arithmetic is broken"

@pytest.mark.own_process
def test_skips():
    pytest.skip("nothing to see")

@pytest.mark.own_process
def test_dies():
    ctypes.string_at(0)  # SIGSEGV in the child

def test_here():
    assert "OVERDRIVE_TEST_OWN_PROCESS" not in os.environ
'''


def test_own_process_reports_pass_fail_skip_and_a_crash(pytester):
    pytester.makeconftest((Path(__file__).parent / "conftest.py").read_text())
    pytester.makeini("[pytest]\nmarkers =\n    own_process: own interpreter\n")
    pytester.makepyfile(test_cases=CASES)
    result = pytester.runpytest_subprocess("-rA", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=2, skipped=1)
    text = result.stdout.str()
    assert "arithmetic is broken" in text and "nothing to see" in text
    assert "without reporting it" in text and "test_dies" in text
