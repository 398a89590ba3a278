"""Technique registry. Importing this package registers every built-in technique."""

from overdrive.techniques import (  # noqa: F401  (importing registers)
    autocast,
    bn_fold,
    channels_last,
    inference_mode,
    int8_dynamic,
    length_bucketing,
    pipeline_parallel,
    prune_channels,
    prune_ffn,
    prune_heads,
    prune_unstructured,
    remove_padding,
    sparsity_24,
    torch_compile,
)
from overdrive.techniques.base import (
    BatchingPolicy,
    Stage,
    Technique,
    TechniqueConfig,
    get_technique,
    list_techniques,
    register,
)

__all__ = ["BatchingPolicy", "Stage", "Technique", "TechniqueConfig", "get_technique", "list_techniques", "register"]
