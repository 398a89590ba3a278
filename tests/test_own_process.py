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


SIGNAL_STACK_CASES = '''
import ctypes, os, signal

class StackT(ctypes.Structure):
    _fields_ = [("ss_sp", ctypes.c_void_p), ("ss_flags", ctypes.c_int), ("ss_size", ctypes.c_size_t)]

def test_unmaps_the_signal_stack():  # what OpenVINO's CPU plugin did: a stack of its own, then unmapped
    libc = ctypes.CDLL(None)
    libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                              ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    stack = libc.mmap(None, 65536, 3, 0x22, -1, 0)
    assert libc.sigaltstack(ctypes.byref(StackT(stack, 0, 65536)), None) == 0
    libc.munmap(stack, 65536)

def test_takes_a_signal_after_it():
    seen = []
    signal.signal(signal.SIGUSR1, lambda *args: seen.append(1))
    os.kill(os.getpid(), signal.SIGUSR1)
    assert seen == [1]
'''


def test_a_test_that_leaves_the_signal_stack_unmapped_fails_and_the_next_still_takes_signals(pytester):
    pytester.makeconftest((Path(__file__).parent / "conftest.py").read_text())
    pytester.makeini("[pytest]\nmarkers =\n    own_process: own interpreter\n")
    pytester.makepyfile(test_cases=SIGNAL_STACK_CASES)
    result = pytester.runpytest_subprocess("-rA", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, errors=1)  # the first passes its call, errs in teardown
    assert "left the main thread's alternate signal stack at unmapped memory" in result.stdout.str()


WORKER_CRASH_CASES = '''
import ctypes

def test_first():
    pass

def test_kills_its_worker():
    ctypes.string_at(0)  # SIGSEGV in the xdist worker
'''


def test_a_worker_that_dies_is_named_with_its_signal_and_the_tests_it_ran(pytester):
    pytester.makeconftest((Path(__file__).parent / "conftest.py").read_text())
    pytester.makeini("[pytest]\nmarkers =\n    own_process: own interpreter\n")
    pytester.makepyfile(test_cases=WORKER_CRASH_CASES)
    result = pytester.runpytest_subprocess("-n", "2", "--dist", "loadfile", "--max-worker-restart", "0",
                                           "-p", "no:cacheprovider")
    text = result.stdout.str() + result.stderr.str()
    assert "worker process ended: killed by SIGSEGV" in text, text[-3000:]
    assert "test_cases.py" in text.split("the test files it ran, in order:")[1]
    assert "its threads' stacks at the signal" in text and "test_kills_its_worker" in text
