"""FLOPs of a model on a workload's rows (torch.utils.flop_counter): per sample, and the share done in
given layer types; the figures the roofline (`core.roofline`) and pruning's reports use."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from overdrive.core.memory import to_device
from overdrive.core.workload import Workload


def count_flops_per_sample(model: nn.Module, workload: Workload, *, device: torch.device, indices: list[int]) -> float | None:
    """FLOPs per row of one eager forward on the first samples (torch.utils.flop_counter).

    Text (a workload with `sample_length`): up to 64 samples spread over `indices`, each alone, so the count is of
    real tokens only, never of the padding a batch adds (a candidate that pads less, length bucketing
    or remove-padding, does the same useful work); the mean per sample. Otherwise one batch of the
    first samples, divided by its rows. A compiled model is counted eagerly (not recompiled).

    Returns None when the model cannot run under FlopCounterMode (e.g. TorchScript).
    Counts matmul/conv FLOPs as 2 × MACs, as FlopCounterMode does. nn.MultiheadAttention's
    inference fast path (`torch._native_multi_head_attention`) is switched off while counting
    (and restored): FlopCounterMode does not see inside that fused op, so its projections and
    attention would count as zero.
    """
    from torch.utils.flop_counter import FlopCounterMode

    if workload.is_text:  # up to 64 rows spread evenly over the distinct rows measured, each alone
        distinct = list(dict.fromkeys(indices))
        chunks = [[distinct[k * len(distinct) // min(64, len(distinct))]] for k in range(min(64, len(distinct)))]
    else:
        chunks = [indices[: min(len(indices), workload.default_batch_size)]]
    fast_path = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    set_stance = getattr(torch.compiler, "set_stance", None)  # a compiled model counted eagerly, not recompiled
    try:
        with torch.no_grad(), set_stance("force_eager") if set_stance else contextlib.nullcontext(), \
                FlopCounterMode(display=False) as counter:
            for chunk in chunks:
                model(*to_device(workload.collate([workload.samples[i] for i in chunk]), device))
    except Exception:  # noqa: BLE001 - FLOPs are informative, never required
        return None
    finally:
        torch.backends.mha.set_fastpath_enabled(fast_path)
    return counter.get_total_flops() / sum(len(chunk) for chunk in chunks)


def layer_flop_share(model: nn.Module, workload: Workload, *, device: torch.device, indices: list[int],
                     layer_types: tuple[type[nn.Module], ...]) -> float | None:
    """The share of the model's FLOPs (as `count_flops_per_sample` counts them, on one batch of the first
    rows) done inside modules of `layer_types`: where a technique that lowers only those layers' precision
    (int8-dynamic: nn.Linear) puts its work. None when it cannot be counted."""
    from torch.utils.flop_counter import FlopCounterMode

    chunk = indices[: min(len(indices), workload.default_batch_size)]
    inside = [0]
    with FlopCounterMode(display=False) as counter:
        def before(module, args):
            module._overdrive_flops = counter.get_total_flops()

        def after(module, args, output):
            inside[0] += counter.get_total_flops() - module.__dict__.pop("_overdrive_flops", 0)

        handles = [h for m in model.modules() if isinstance(m, layer_types)
                   for h in (m.register_forward_pre_hook(before), m.register_forward_hook(after))]
        try:
            with torch.no_grad():
                model(*to_device(workload.collate([workload.samples[i] for i in chunk]), device))
        except Exception:  # noqa: BLE001 - informative, never required
            return None
        finally:
            for handle in handles:
                handle.remove()
    total = counter.get_total_flops()
    return inside[0] / total if total else None
