"""Pipeline-parallel inference: the model split across the machine's GPUs (`PipelinedModel`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from overdrive.core.workload import Workload
from overdrive.techniques.multi_device.pipelined_model import PipelinedModel
from overdrive.techniques.registry import Stage, Technique, TechniqueConfig, register


@dataclass(frozen=True, kw_only=True)
class PipelineParallelConfig(TechniqueConfig):
    """microbatches: pieces each batch is cut into; num_devices: GPUs to split over (0: all)."""
    name: ClassVar[str] = "pipeline-parallel"

    microbatches: int = 4
    num_devices: int = 0

    def __post_init__(self):
        if self.microbatches < 1 or self.num_devices < 0:
            raise ValueError(f"microbatches must be ≥ 1 and num_devices ≥ 0, got {self.microbatches}, {self.num_devices}")


@register
class PipelineParallel(Technique):
    """Split the model's blocks across GPUs, balanced by measured block time, and run each batch
    as microbatches in a wavefront so the GPUs work on different microbatches at once."""

    config_cls = PipelineParallelConfig
    stage = Stage.RUNTIME
    lossless = True
    devices = ("cuda",)
    rewrites_modules = True
    opt_in = True
    description = "split the model across GPUs (pipeline parallel inference, microbatched wavefront)"

    def applicability(self, workload: Workload, device: torch.device) -> str | None:
        if torch.cuda.device_count() < 2:
            return f"needs ≥ 2 GPUs; this machine has {torch.cuda.device_count()}"
        from overdrive.workloads.minilm import SentenceEmbedder

        if not isinstance(workload.model, (torch.nn.Sequential, SentenceEmbedder)):
            return "not applicable: splits an nn.Sequential or a transformers sentence encoder only"
        return None

    def apply(self, model, config, *, workload, device):
        count = config.num_devices or torch.cuda.device_count()
        devices = [torch.device("cuda", i) for i in range(count)]
        example = tuple(t.to(devices[0]) for t in workload.collate(list(workload.samples[: workload.default_batch_size])))
        return PipelinedModel(model.to(devices[0]), devices, microbatches=config.microbatches, example=example)
