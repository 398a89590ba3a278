"""Tiny workloads built in fixtures, so technique tests run in seconds and compare with fp32 eager."""

from __future__ import annotations

import ctypes
import os
import tempfile
import time

import pytest
import torch
from torch import nn

from overdrive.core.workload import Workload, embedding_fidelity, logits_fidelity, pad_token_ids

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# One cache of exports for the whole run (`overdrive.files.cache`), never the user's ~/.cache: a model
# exported by one test is read back by the next, as a user's second start would.
# Under pytest-xdist every worker imports this file: they share one folder, named by the run's id.
_run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
if _run_id:
    _cache = os.path.join(tempfile.gettempdir(), f"overdrive-test-cache-{_run_id}")
    os.makedirs(_cache, exist_ok=True)
    os.environ.setdefault("OVERDRIVE_CACHE", _cache)
else:
    os.environ.setdefault("OVERDRIVE_CACHE", tempfile.mkdtemp(prefix="overdrive-test-cache-"))

# Under pytest-xdist (`make test` runs a worker per 2 CPUs' share): each worker on CPUs of its own, its torch threads
# as many. A test that times something then never shares a CPU with the other worker's test, which the measuring code
# would see as other work and set aside (the run-queue waits `core.interference` reads), and the processes a test starts
# (the command line, torchrun's ranks) inherit the same CPUs.
_worker, _workers = os.environ.get("PYTEST_XDIST_WORKER"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _worker and _workers > 1 and hasattr(os, "sched_setaffinity"):
    _cpus = sorted(os.sched_getaffinity(0))
    if len(_cpus) >= _workers:
        _mine = set(_cpus[int(_worker.removeprefix("gw")) % _workers::_workers])
        os.sched_setaffinity(0, _mine)
        torch.set_num_threads(len(_mine))
def _worker_file(run_id: str, worker: str, kind: str) -> str:
    """Where an xdist worker leaves its trail ("files": the test files it ran, in order) and its fatal-signal stacks
    ("crash"), for `pytest_testnodedown` to show when the worker dies."""
    return os.path.join(tempfile.gettempdir(), f"overdrive-xdist-{run_id}-{worker}.{kind}")


_trail: list[str] = []


@pytest.hookimpl(trylast=True)  # after pytest's own faulthandler plugin, which would point it at captured stderr
def pytest_configure(config):
    if not (_worker and _run_id):
        return
    import faulthandler
    import signal

    crash = open(_worker_file(_run_id, _worker, "crash"), "w")  # noqa: SIM115 — open until the process ends
    faulthandler.enable(file=crash, all_threads=True)  # SIGSEGV, SIGFPE, SIGABRT, SIGBUS, SIGILL
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        faulthandler.register(sig, file=crash, all_threads=True, chain=True)


def pytest_runtest_logstart(nodeid, location):
    if _worker and _run_id and (path := nodeid.split("::")[0]) not in _trail:
        _trail.append(path)
        with open(_worker_file(_run_id, _worker, "files"), "a") as f:
            f.write(path + "\n")


@pytest.hookimpl(optionalhook=True)  # an xdist hook: `pytest -p no:xdist` runs without it
def pytest_testnodedown(node, error):
    """Under pytest-xdist, a worker that went down without finishing ("node down: Not properly terminated") is
    named with how its process ended (the signal, or the exit code), the memory then free, the test files it had
    run in order, and the stacks its threads had when a fatal signal came: a crash otherwise leaves no trace."""
    if not error:
        return
    import signal
    import subprocess
    import sys

    popen = getattr(getattr(node.gateway, "_io", None), "popen", None)
    try:
        code = popen.wait(timeout=10) if popen is not None else None
    except subprocess.TimeoutExpired:
        code = "still running"
    if isinstance(code, int) and code < 0:
        code = f"killed by {signal.Signals(-code).name}"
    try:
        free = next(line.split()[1] for line in open("/proc/meminfo") if line.startswith("MemAvailable"))
        free = f"{int(free) / 2**20:.1f} GiB"
        kills = next(line.split()[1] for line in open("/proc/vmstat") if line.startswith("oom_kill "))
    except (OSError, StopIteration):
        free = kills = "unknown"
    sys.stderr.write(f"[{node.gateway.id}] worker process ended: {code}; memory available now: {free}; processes "
                     f"the kernel's OOM killer has ended since boot: {kills}\n")
    run_id = node.workerinput.get("testrunuid", "")
    for kind, what in (("files", "the test files it ran, in order"), ("crash", "its threads' stacks at the signal")):
        try:
            text = open(_worker_file(run_id, node.gateway.id, kind)).read().strip()
        except OSError:
            continue
        if text:
            sys.stderr.write(f"[{node.gateway.id}] {what}:\n{text[-6000:]}\n")


class _StackT(ctypes.Structure):  # sigaltstack(2)'s stack_t
    _fields_ = [("ss_sp", ctypes.c_void_p), ("ss_flags", ctypes.c_int), ("ss_size", ctypes.c_size_t)]


def _signal_stack() -> _StackT | None:
    """The calling thread's alternate signal stack (sigaltstack(2)); None where there is no such call."""
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    now = _StackT()
    return now if hasattr(libc, "sigaltstack") and libc.sigaltstack(None, ctypes.byref(now)) == 0 else None


def _mapped(start: int, size: int) -> bool:
    with open("/proc/self/maps") as f:
        spans = [tuple(int(x, 16) for x in line.split()[0].split("-")) for line in f]
    return any(lo <= start and start + size <= hi for lo, hi in spans)


_good_signal_stack: list[_StackT] = []


@pytest.fixture(autouse=True)
def _the_main_threads_signal_stack_stays_mapped():
    """A test must not leave the main thread's alternate signal stack pointing at unmapped memory: the next signal
    with a handler (SIGTERM, SIGINT, SIGCHLD, pytest-timeout's SIGALRM) then kills the process with SIGSEGV, in a
    later test (OpenVINO's CPU plugin did it when two Cores went first-in-first-out: benchmarks/RESULTS.md). The
    test that did it fails here, and the stack it found at the start is put back for the tests after it."""
    before = _signal_stack() if os.path.exists("/proc/self/maps") else None
    if before is not None and before.ss_sp and _mapped(before.ss_sp, before.ss_size):
        _good_signal_stack[:] = [before]
    yield
    now = _signal_stack() if before is not None else None
    if now is None or not now.ss_sp or now.ss_flags or _mapped(now.ss_sp, now.ss_size):
        return
    if _good_signal_stack:
        ctypes.CDLL(None).sigaltstack(ctypes.byref(_good_signal_stack[0]), None)
    pytest.fail(f"the test left the main thread's alternate signal stack at unmapped memory ({now.ss_sp:#x}, "
                f"{now.ss_size} bytes): the next handled signal would kill the process with SIGSEGV")


# `@pytest.mark.own_process`: the test runs in a fresh interpreter (`python -m pytest <its id>`), and its reports come
# back to this session as if it had run here. For tests that leave a library in a state later tests in the same process
# must not inherit: a gRPC server or channel leaves gRPC's threads (the asyncio poller, the core's timer) running for
# good, and two-worker runs lost the worker that later started subprocesses to SIGSEGV in 4 of 11 runs.
_OWN_PROCESS = "OVERDRIVE_TEST_OWN_PROCESS"  # set in the child: the file its reports go to, one JSON object a line


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    if item.get_closest_marker("own_process") is None or os.environ.get(_OWN_PROCESS):
        return None
    import json
    import subprocess
    import sys

    from _pytest.reports import TestReport

    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    fd, out = tempfile.mkstemp(prefix="overdrive-own-process-", suffix=".jsonl")
    os.close(fd)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST_")} | {_OWN_PROCESS: out}
    started = time.perf_counter()
    try:
        child = subprocess.run([sys.executable, "-m", "pytest", item.nodeid, "-q", "--no-header", "-p", "no:cacheprovider"],
                               cwd=item.config.rootpath, env=env, capture_output=True, text=True, timeout=900)
        output, code = child.stdout + child.stderr, child.returncode
    except subprocess.TimeoutExpired as e:
        output, code = f"{e.stdout or ''}{e.stderr or ''}", "timed out after 900 s"
    with open(out) as f:
        reports = [json.loads(line) for line in f if line.strip()]
    os.unlink(out)
    wall = time.perf_counter() - started  # the call's duration: the whole child, its interpreter's start included
    if not any(r["when"] == "call" for r in reports) and not any(r["outcome"] != "passed" for r in reports):
        reports.append({"when": "call", "outcome": "failed", "duration": 0.0,  # the child died, or never ran the test
                        "longrepr": f"the test's own process ended ({code}) without reporting it:\n{output[-8000:]}"})
    for r in reports:
        longrepr = tuple(r["longrepr"]) if isinstance(r["longrepr"], list) else r["longrepr"]
        sections = [("Captured output (own process)", output[-8000:])] if r["outcome"] == "failed" else []
        item.ihook.pytest_runtest_logreport(report=TestReport(
            item.nodeid, item.location, dict.fromkeys(item.keywords, 1), r["outcome"], longrepr, r["when"],
            sections=sections, duration=wall if r["when"] == "call" else r["duration"]))
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True


def pytest_runtest_logreport(report):
    if (out := os.environ.get(_OWN_PROCESS)) is None or report.outcome == "passed" and report.when != "call":
        return
    import json

    longrepr = report.longrepr if isinstance(report.longrepr, tuple) else (report.longreprtext or None)
    with open(out, "a") as f:
        f.write(json.dumps({"when": report.when, "outcome": report.outcome, "duration": report.duration,
                            "longrepr": longrepr}, default=str) + "\n")


def requires_cuda(test):
    """Skipped without a CUDA GPU, and marked `cuda`, so `pytest -m cuda` (what `make gpu-check` runs) selects it."""
    return pytest.mark.cuda(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")(test))


class TinyConvNet(nn.Module):
    """conv-BN-ReLU ×2, a conv whose output feeds two users (must not be folded), pooled, linear head."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(16)
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))  # [B, 8, H, W]
        x = torch.relu(self.bn2(self.conv2(x)))  # [B, 16, H, W]
        return self.head(x.mean(dim=(2, 3)))  # [B, 5]


def _randomise_bn(model: nn.Module) -> nn.Module:
    """Give BatchNorm layers non-trivial running statistics, so folding them is a real test."""
    g = torch.Generator().manual_seed(1)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.1)
            m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
            m.weight.data.copy_(torch.rand(m.num_features, generator=g) + 0.5)
            m.bias.data.copy_(torch.randn(m.num_features, generator=g) * 0.1)
    return model.eval()


def make_conv_workload(num_samples: int = 24) -> Workload:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    images = torch.randn(num_samples, 3, 16, 16, generator=g)
    labels = torch.randint(0, 5, (num_samples,), generator=g)
    return Workload(
        name="tiny-conv",
        model=_randomise_bn(TinyConvNet()),
        samples=list(images),
        labels=labels,
        collate=lambda s: (torch.stack(s),),
        fidelity=logits_fidelity,
        fidelity_key="min_cosine",
        default_batch_size=8,
        real_weights=False,
    )


def tiny_vit() -> nn.Module:
    """torchvision's VisionTransformer at toy size: 32×32 images in 8×8 patches (16 tokens + class
    token), 2 layers of 4 heads of 8, MLP width 64, 5 classes; random weights, and a random
    (not zero-initialised) head so outputs differ between models. [B, 3, 32, 32] -> [B, 5]."""
    from torchvision.models import VisionTransformer

    torch.manual_seed(0)
    model = VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=4, hidden_dim=32, mlp_dim=64,
                              num_classes=5)
    nn.init.normal_(model.heads.head.weight, std=0.2)
    return model.eval()


def make_vit_workload(num_samples: int = 24, num_train: int = 64) -> Workload:
    """`tiny_vit` on seeded standard-normal images, with labelled training images (calibration,
    Taylor importance, recovery)."""
    g = torch.Generator().manual_seed(0)
    images = torch.randn(num_samples + num_train, 3, 32, 32, generator=g)
    labels = torch.randint(0, 5, (num_samples + num_train,), generator=g)
    return Workload(
        name="tiny-vit",
        model=tiny_vit(),
        samples=list(images[:num_samples]),
        labels=labels[:num_samples],
        train_samples=list(images[num_samples:]),
        train_labels=labels[num_samples:],
        collate=lambda s: (torch.stack(s),),
        fidelity=logits_fidelity,
        fidelity_key="min_cosine",
        default_batch_size=8,
        real_weights=False,
    )


def tiny_bert_embedder():
    """A 2-layer, 32-wide BERT with 4 heads of 8 and FFN width 128 (transformers, random weights) with
    masked mean pooling: (input_ids [B, S], attention_mask [B, S]) -> [B, 32]. MiniLM's module layout."""
    from transformers import BertConfig, BertModel

    from overdrive.workloads.minilm import SentenceEmbedder

    torch.manual_seed(0)
    config = BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=64)
    return SentenceEmbedder(BertModel(config)).eval()


def make_text_workload(num_samples: int = 40) -> Workload:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(2, 30, (num_samples,), generator=g).tolist()
    samples = [torch.randint(1, 50, (n,), generator=g).tolist() for n in lengths]
    return Workload(
        name="tiny-text",
        model=tiny_bert_embedder(),
        samples=samples,
        collate=pad_token_ids,
        fidelity=embedding_fidelity,
        fidelity_key="min_cosine",
        default_batch_size=8,
        sample_length=len,
        real_weights=False,
    )


@pytest.fixture
def conv_workload() -> Workload:
    return make_conv_workload()


@pytest.fixture
def text_workload() -> Workload:
    return make_text_workload()
