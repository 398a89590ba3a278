"""Technique registry. Importing this package registers every built-in technique."""

from overdrive.techniques import autocast, graph, int8_dynamic, runtime  # noqa: F401  (registration)
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
