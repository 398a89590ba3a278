"""The one device-synchronising timer."""

from __future__ import annotations

import time

import torch


class Timer:
    """Seconds that work takes on a device, read only once the device has finished it.

    CUDA: events recorded on the current stream before and after the work; the elapsed time is
    read after the end event completes (`Event.synchronize`), so it is the GPU's time, not the
    time it took to launch the kernels. CPU: `time.perf_counter` around the work, which ran
    synchronously. The one timer every measured figure uses (`measure`, the 2:4 per-layer speed
    gate, pipeline block costs and the bubble, the auto batch size). `run`'s replicas time their
    copy and compute streams with events they read later, without waiting, by design (the
    overlap is what they measure).

    Use it as `out, seconds = timer(fn, *args)`, or with `token = timer.start()` ... `seconds =
    timer.stop(token)` where the work is not one call (forward hooks).
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"

    def start(self):
        """A token for `stop`: a recorded CUDA event, or the host clock."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            return event
        return time.perf_counter()

    def stop(self, token) -> float:
        """Seconds since `start` gave `token`, after waiting for the device to finish the work."""
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record(torch.cuda.current_stream(self.device))
            end.synchronize()
            return token.elapsed_time(end) / 1e3
        return time.perf_counter() - token

    def __call__(self, fn, *args, **kwargs):
        """Run fn(*args, **kwargs); returns (its result, seconds)."""
        token = self.start()
        out = fn(*args, **kwargs)
        return out, self.stop(token)
