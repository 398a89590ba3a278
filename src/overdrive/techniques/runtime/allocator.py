"""The CUDA caching allocator's expandable segments, as a measured option.

`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` makes the caching allocator grow one virtual
segment per stream instead of allocating fixed-size segments, which cuts fragmentation: the
reserved memory stays closer to what is allocated when shapes vary (text of varying lengths,
many batch sizes). See https://pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf.

The setting is switched on for this model's calls only (`torch.cuda.memory._set_allocator_settings`,
restored after each call), so other models in the process, and the tuner's other candidates, keep
theirs; the cache is emptied when the model is built, so its segments are its own. Every row of
`optimize` and `bench` shows the peak allocated / reserved memory, which is what this option
changes; it is lossless and opt-in (it is not expected to be faster, so the speed gate alone would
never keep it: name it in `--techniques`, and read the reserved column).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import ClassVar

import torch

from overdrive.core.workload import Workload
from overdrive.techniques.registry import ForwardWrapper, Stage, Technique, TechniqueConfig, register


def _set(enabled: bool) -> None:
    torch.cuda.memory._set_allocator_settings(f"expandable_segments:{'True' if enabled else 'False'}")


def _process_default() -> bool:
    """The process's own setting (torch has no public getter; nothing else in overdrive changes it)."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").replace(" ", "").lower()
    return "expandable_segments:true" in conf


class ExpandableSegments(ForwardWrapper):
    """`inner` called with the allocator's expandable segments on, the process's setting restored after."""

    def forward(self, *args, **kwargs):
        _set(True)
        try:
            return self.inner(*args, **kwargs)
        finally:
            _set(_process_default())


@dataclass(frozen=True, kw_only=True)
class ExpandableSegmentsConfig(TechniqueConfig):
    name: ClassVar[str] = "expandable-segments"


@register
class ExpandableSegmentsTechnique(Technique):
    config_cls = ExpandableSegmentsConfig
    stage = Stage.RUNTIME
    lossless = True
    opt_in = True
    devices = ("cuda",)
    description = ("opt-in: the CUDA caching allocator's expandable segments (less fragmentation: read the reserved "
                   "memory)")

    def applicability(self, workload: Workload, device: torch.device) -> str | None:
        if not hasattr(torch.cuda.memory, "_set_allocator_settings"):
            return "this torch cannot change the allocator's settings at run time"
        return None

    def apply(self, model, config, *, workload, device):
        torch.cuda.empty_cache()  # this model's segments are made with the setting on
        return ExpandableSegments(model)
