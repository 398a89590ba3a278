"""Technique registry. Importing this package registers every built-in technique."""

# Importing each technique module registers it.
from overdrive.techniques.batching import length_bucketing  # noqa: F401
from overdrive.techniques.graph import bn_fold, channels_last, concurrent_streams, remove_padding  # noqa: F401
from overdrive.techniques.multi_device import pipeline_parallel  # noqa: F401
from overdrive.techniques.precision import autocast, int8_dynamic, mixed  # noqa: F401
from overdrive.techniques.pruning import channels, ffn, heads, unstructured  # noqa: F401
from overdrive.techniques.registry import (
    BatchingPolicy,
    Stage,
    Technique,
    TechniqueConfig,
    config_from_dict,
    config_to_dict,
    conflict,
    default_config,
    describe_report,
    get_technique,
    list_techniques,
    register,
    technique_for,
    unregister,
)
from overdrive.techniques.runtime import (  # noqa: F401
    allocator,
    cuda_graphs,
    inference_mode,
    onnx_runtime,
    openvino_runtime,
    tensorrt,
    torch_compile,
)
from overdrive.techniques.sparsity import semi_structured  # noqa: F401

__all__ = ["BatchingPolicy", "Stage", "Technique", "TechniqueConfig", "config_from_dict", "config_to_dict", "conflict", "default_config",
           "describe_report", "get_technique", "list_techniques", "register", "technique_for",
           "unregister"]
