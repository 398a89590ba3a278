"""The per-layer search's cost on gpt2-small-random: each layer's sensitivity (mean KL over the 32 calibration texts
with that layer alone in fp16-weight) with the logits read one text at a time (as before) against 8 texts to a
forward (`fidelity.batched_sequence_logits`, what `quantize.search_layers` reads now), for the first 6 layers,
interleaved. Random weights: the KLs are rounding-level and only say both ways measure alike.

    HF_HUB_OFFLINE=1 PYTHONPATH=src .venv/bin/python benchmarks/search_batching_cpu.py
"""

import statistics
import time

import torch

from overdrive.generate import Decoder
from overdrive.generate.fidelity import batched_sequence_logits, sequence_logits
from overdrive.generate.quantize import copy_decoder, linear_names, quantize_linears
from overdrive.workloads.generation import create_generation_workload


def main() -> None:
    workload = create_generation_workload("gpt2-small-random")
    decoder = Decoder.from_hf(workload.model)
    texts = workload.calibration
    tokens = sum(map(len, texts))

    def kl(reference: list[torch.Tensor], candidate: list[torch.Tensor]) -> float:
        total = 0.0
        for r, c in zip(reference, candidate):
            log_p, log_q = torch.log_softmax(r, -1), torch.log_softmax(c, -1)
            total += float((log_p.exp() * (log_p - log_q)).sum(-1).clamp(min=0).sum())
        return total / tokens

    ways = {"one at a time": lambda model: [sequence_logits(model, x) for x in texts],
            "8 to a forward": lambda model: batched_sequence_logits(model, texts)}
    references = {label: read(decoder) for label, read in ways.items()}
    times: dict[str, list[float]] = {label: [] for label in ways}
    kls: dict[str, list[float]] = {label: [] for label in ways}
    for name in linear_names(decoder)[:6]:
        trial = copy_decoder(decoder)
        quantize_linears(trial, [name], form="fp16-weight")
        for label, read in ways.items():
            started = time.perf_counter()
            kls[label].append(kl(references[label], read(trial)))
            times[label].append(time.perf_counter() - started)
    print(f"gpt2-small-random, {len(texts)} calibration texts ({tokens} tokens), torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    for label in ways:
        print(f"{label}: {statistics.median(times[label]):.2f} s per layer [{min(times[label]):.2f}, "
              f"{max(times[label]):.2f}]; KLs {', '.join(f'{k:.1e}' for k in kls[label])}")


if __name__ == "__main__":
    main()
