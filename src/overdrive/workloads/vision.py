"""torchvision architectures by name, with random weights: speed figures only.

No weights are downloaded. Inputs are seeded standard-normal images [3, 224, 224]; fidelity
is agreement with the fp32 outputs (top-1 agreement, max relative error, and the minimum
per-row cosine, which is the guarded figure, since the argmax of a random network's logits
is not a task answer).
"""

from __future__ import annotations

import torch

from overdrive.core.errors import WorkloadError
from overdrive.core.workload import Workload, logits_fidelity

NUM_SAMPLES = 64
IMAGE_SIZE = 224


def torchvision_names() -> list[str]:
    """Classification architectures torchvision can build (e.g. 'resnet50', 'mobilenet_v3_large')."""
    from torchvision import models

    return sorted(models.list_models(module=models))


IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def image_preset(name: str):
    """PIL image -> float [3, 224, 224] as the architecture's ImageNet weights expect it (resize,
    centre crop, normalise), from torchvision's weight metadata (no download); a plain resize with
    ImageNet normalisation for architectures whose preset has another crop size or none."""
    from torchvision import models

    from overdrive.files.inputs import ResizeToTensor

    try:
        preset = models.get_model_weights(name).DEFAULT.transforms()
    except (ValueError, KeyError, AttributeError):
        preset = None
    if preset is None or list(getattr(preset, "crop_size", [])) != [IMAGE_SIZE]:
        return ResizeToTensor((IMAGE_SIZE, IMAGE_SIZE), IMAGENET_MEAN, IMAGENET_STD)
    return preset


def _random_head(model: torch.nn.Module) -> torch.nn.Module:
    """Give zero-initialised Linear layers (torchvision's ViT and Swin heads) seeded random weights
    (std 0.02, as timm initialises heads): with a zero head every output is 0 and fidelity cannot
    tell one technique from another."""
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and not module.weight.detach().any():
            torch.nn.init.trunc_normal_(module.weight, std=0.02)
    return model


def build_torchvision(name: str, *, num_samples: int = NUM_SAMPLES) -> Workload:
    """Build a random-weight torchvision classifier.

    Raises:
        WorkloadError: `name` is not a torchvision classification model.
    """
    from torchvision import models

    if name not in torchvision_names():
        raise WorkloadError(f"unknown workload {name!r}; run `overdrive list` for the names")
    torch.manual_seed(0)
    model = _random_head(models.get_model(name, weights=None).eval())
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
        rows_source="random",
        description=f"torchvision {name}, random weights (speed only)",
        extra={"image_transform": image_preset(name), "classifier": True},  # for `overdrive run` over image folders
    )
