"""The training data order: one seeded stream of sample indices that every rank reads its share of.

Data: one seeded stream of permutations of the training samples (permutation e for epoch e).
Each optimizer step takes the next dp × batch_size × grad_accum rows of it; data-parallel rank
r's micro-step m gets rows [(m·dp + r)·B, (m·dp + r + 1)·B) of them. So every rank runs the same
number of steps and micro-steps whatever the dataset size (an even split; no rank ever waits
for one with more batches), the ranks' shards are disjoint, and the data position is one
number (rows consumed) that also means the same thing at another world size on resume.
"""

from __future__ import annotations

import torch

from overdrive.core.workload import Workload


class SampleStream:
    """Training-sample indices as one seeded sequence of permutations: position p is row
    p mod n of permutation p // n (each seeded with `seed` and its epoch)."""

    def __init__(self, num_samples: int, seed: int):
        self.n, self.seed = num_samples, seed
        self._cache: dict[int, list[int]] = {}

    def _permutation(self, epoch: int) -> list[int]:
        if epoch not in self._cache:
            self._cache = {epoch: torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed * 100_003 + epoch)).tolist()}
        return self._cache[epoch]

    def take(self, start: int, count: int) -> list[int]:
        return [self._permutation(p // self.n)[p % self.n] for p in range(start, start + count)]


def micro_batch_indices(stream: SampleStream, position: int, *, batch_size: int, grad_accum: int, dp: int,
                        dp_rank: int, micro: int) -> list[int]:
    """Rows of data-parallel rank `dp_rank`'s micro-step `micro` in the step starting at `position`."""
    return stream.take(position + (micro * dp + dp_rank) * batch_size, batch_size)


def train_inputs(workload: Workload, indices: list[int], device: torch.device) -> tuple[torch.Tensor, ...]:
    """The model inputs for these training samples, on `device`."""
    return tuple(t.to(device, non_blocking=True) for t in workload.collate([workload.train_samples[i] for i in indices]))
