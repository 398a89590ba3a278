"""Processes of a training job: torchrun starts them (also across nodes); `launch` runs torchrun
on this machine, and `init_distributed` joins a rank to the job (NCCL on GPUs, gloo on CPU)."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job. `world_size` 1 with no process group for a plain run."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1 or dist.is_initialized()


def launched_by_torchrun() -> bool:
    """True inside a process started by torchrun (it sets RANK, WORLD_SIZE and the rendezvous)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def init_distributed(device: torch.device, *, timeout_s: float) -> DistEnv:
    """Join the torchrun job (or describe a plain single process).

    Under torchrun, creates the default process group: NCCL when `device` is CUDA (each rank on
    cuda:LOCAL_RANK), gloo on CPU. Every collective then fails after `timeout_s` seconds
    instead of hanging (NCCL: with TORCH_NCCL_ASYNC_ERROR_HANDLING, the default since 2.2).

    Raises:
        RuntimeError: the rendezvous fails or times out.
    """
    if not launched_by_torchrun():
        return DistEnv(0, 0, 1, device)
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    if device.type == "cuda":
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                timeout=datetime.timedelta(seconds=timeout_s),
                                **({"device_id": device} if device.type == "cuda" else {}))
    return DistEnv(rank, local, world, device)


def shutdown_distributed(*, barrier: bool = True) -> None:
    """Leave the job: wait for every rank (so none tears down a group another still uses), then
    destroy the process group. barrier=False after an error, when peers may be gone."""
    if dist.is_initialized():
        if barrier:
            dist.barrier()
        dist.destroy_process_group()


def launch(argv: list[str], nproc: int, *, env: dict[str, str] | None = None) -> int:
    """Run `python -m overdrive <argv>` in `nproc` processes with torchrun on this machine.

    torchrun stops every rank when one fails; its exit code is then non-zero, and instead of its
    traceback it reports the failed ranks (`overdrive.train._torchrun`). Each rank gets
    OMP_NUM_THREADS = cores / nproc unless set, so CPU ranks do not oversubscribe the cores.

    Args:
        env: extra environment variables for the ranks.

    Returns:
        torchrun's exit code.
    """
    env = {**os.environ, **(env or {})}
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    torchrun = [sys.executable, "-m", "overdrive.train._torchrun", "--standalone", f"--nproc-per-node={nproc}",
                "--max-restarts=0", "-m", "overdrive"]
    return subprocess.run([*torchrun, *argv], env=env).returncode
