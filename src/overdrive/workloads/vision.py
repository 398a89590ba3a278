"""torchvision architectures by name, with random weights: speed figures only.

No weights are downloaded. Inputs are seeded standard-normal images [3, 224, 224]; fidelity
is agreement with the fp32 outputs (top-1 agreement, max relative error, and the minimum
per-row cosine, which is the guarded figure, since the argmax of a random network's logits
is not a task answer).
"""

from __future__ import annotations

import torch

from overdrive.errors import UserError
from overdrive.workloads.base import Workload, logits_fidelity

NUM_SAMPLES = 64
IMAGE_SIZE = 224


def torchvision_names() -> list[str]:
    """Classification architectures torchvision can build (e.g. 'resnet50', 'mobilenet_v3_large')."""
    from torchvision import models

    return sorted(models.list_models(module=models))


def build_torchvision(name: str, *, num_samples: int = NUM_SAMPLES) -> Workload:
    """Build a random-weight torchvision classifier.

    Raises:
        UserError: `name` is not a torchvision classification model.
    """
    from torchvision import models

    if name not in torchvision_names():
        raise UserError(f"unknown workload {name!r}; run `overdrive list` for the names")
    torch.manual_seed(0)
    model = models.get_model(name, weights=None).eval()
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(num_samples, 3, IMAGE_SIZE, IMAGE_SIZE, generator=generator)
    return Workload(
        name=name,
        model=model,
        samples=list(images),
        collate=lambda samples: (torch.stack(samples),),
        fidelity=logits_fidelity,
        fidelity_key="min_cosine",
        default_batch_size=8,
        real_weights=False,
        description=f"torchvision {name}, random weights (speed only)",
    )
