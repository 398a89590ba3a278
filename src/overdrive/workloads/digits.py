"""`digits-cnn`: a small CNN trained here on scikit-learn's bundled 8×8 digits.

The data (1,797 images, 10 classes) ships with scikit-learn. The split is stratified,
20% held out (360 images), `random_state=0`. Training is seeded and runs once (a few
seconds on a CPU); the weights are kept in overdrive's cache (`$OVERDRIVE_CACHE`, default
`~/.cache/overdrive`; `files.cache`). The task metric is top-1 accuracy on the held-out split.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from overdrive.core.workload import Workload, logits_fidelity
from overdrive.files.cache import cached

SEED = 0
NUM_EPOCHS = 40
CACHE_VERSION = 1


class DigitsCNN(nn.Module):
    """Conv-BN-ReLU ×3 with pooling and a linear head; input float [B, 1, 8, 8], output logits [B, 10]."""

    def __init__(self, width: int = 32):
        super().__init__()

        def block(c_in: int, c_out: int) -> list[nn.Module]:
            return [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True)]

        self.features = nn.Sequential(
            *block(1, width),
            *block(width, 2 * width),
            nn.MaxPool2d(2),  # [B, 2w, 4, 4]
            *block(2 * width, 4 * width),
            nn.AdaptiveAvgPool2d(1),  # [B, 4w, 1, 1]
        )
        self.classifier = nn.Linear(4 * width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).flatten(1))


def load_digits_split() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fixed train/test split: images float32 [N, 1, 8, 8] scaled to [0, 1], labels int64 [N]."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    images = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(data.target, dtype=torch.int64)
    train_idx, test_idx = train_test_split(
        range(len(labels)), test_size=0.2, random_state=SEED, stratify=data.target
    )
    return images[train_idx], labels[train_idx], images[test_idx], labels[test_idx]


def train_digits_cnn(x_train: torch.Tensor, y_train: torch.Tensor, *, num_epochs: int = NUM_EPOCHS) -> DigitsCNN:
    """Train a DigitsCNN with Adam and cross-entropy, seeded; returns the model in eval mode."""
    generator = torch.Generator().manual_seed(SEED)
    torch.manual_seed(SEED)
    model = DigitsCNN()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=num_epochs)
    model.train()
    for _ in range(num_epochs):
        order = torch.randperm(len(y_train), generator=generator)
        for start in range(0, len(order), 64):
            idx = order[start : start + 64]
            loss = nn.functional.cross_entropy(model(x_train[idx]), y_train[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        scheduler.step()
    return model.eval()


def build_digits_cnn() -> Workload:
    """Build `digits-cnn`, training it on first use and keeping the weights in overdrive's cache (`files.cache`)."""
    x_train, y_train, x_test, y_test = load_digits_split()

    def train(folder: Path) -> dict:
        torch.save(train_digits_cnn(x_train, y_train).state_dict(), folder / "digits_cnn.pt")
        return {}

    entry = cached("digits-cnn", {"seed": SEED, "version": CACHE_VERSION, "epochs": NUM_EPOCHS}, train)
    model = DigitsCNN()
    model.load_state_dict(torch.load(entry.folder / "digits_cnn.pt", map_location="cpu", weights_only=True))
    model.eval()
    return Workload(
        name="digits-cnn",
        model=model,
        samples=list(x_test),
        labels=y_test,
        collate=lambda samples: (torch.stack(samples),),
        fidelity=logits_fidelity,
        fidelity_key="top1_agreement",
        default_batch_size=256,
        description="small CNN trained here on scikit-learn digits (real test accuracy, 360 held-out images)",
        train_samples=list(x_train),
        train_labels=y_train,
    )
