"""Length bucketing of text batches: sort by token length, pad per batch (a batching technique)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from overdrive.core.workload import Workload
from overdrive.techniques.registry import BatchingPolicy, Stage, Technique, TechniqueConfig, register


@dataclass(frozen=True, kw_only=True)
class LengthBucketingConfig(TechniqueConfig):
    name: ClassVar[str] = "length-bucketing"


@register
class LengthBucketing(Technique):
    """Sort samples by length before cutting batches, so each batch pads only to the longest of
    similar-length neighbours; outputs are returned in input order. Text is sorted by token count;
    tensor rows with a varying dimension (a dict example's `input_ids`) by their size there, which
    is the real token count of rows cut at their attention mask (`signature.cut_padding`).

    Text is already timed sorted (`BatchingPolicy.deployed`: `run` and `serve` always batch text by
    length), so the tuner does not try it there; a plan that holds it still builds."""

    config_cls = LengthBucketingConfig
    exportable = True  # survives export to ONNX / OpenVINO
    stage = Stage.BATCHING
    lossless = True
    description = "sort text by length, pad per batch (batching)"

    def applicability(self, workload: Workload, device: torch.device) -> str | None:
        if workload.bucket_length is None:
            return "not applicable: inputs have a fixed shape (no padding to save)"
        return None

    def redundancy(self, workload: Workload) -> str | None:
        if workload.is_text:
            return ("the baseline is already batched by length, as `run` and `serve` batch text whatever the plan "
                    "holds (nothing to gain from it)")
        return None

    def batching(self, policy: BatchingPolicy, config) -> BatchingPolicy:
        return dataclasses.replace(policy, sort_by_length=True)
