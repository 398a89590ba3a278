"""The LitServe anchor for `serve_cpu.py`: the same workload model behind LitServe's own
dynamic batching (`max_batch_size`, `batch_timeout`), one inference worker.

    .venv/bin/python benchmarks/litserve_app.py minilm --port 8100 --max-batch-size 32 --batch-timeout-ms 2

Warm-up in `setup` as `overdrive serve` does it (each batch size once). Request: {"text": "..."} (text workloads) or {"input": nested list of one sample}; response
{"output": [...]}.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import litserve as ls  # noqa: E402
import torch  # noqa: E402

from overdrive.tuning.plan import Plan  # noqa: E402
from overdrive.workloads import create_workload  # noqa: E402


class WorkloadAPI(ls.LitAPI):
    def __init__(self, spec: str, plan: str | None = None, **kwargs):
        super().__init__(**kwargs)
        self.workload_spec = spec
        self.plan = plan

    def setup(self, device):
        self.workload = create_workload(self.workload_spec)
        self.model = self.workload.model.eval()
        if self.plan:  # the same optimized model `overdrive serve plan.json` serves
            self.model = Plan.load(self.plan).build(self.workload, torch.device("cpu"))[0]
        # the same warm-up `overdrive serve` does: each batch size once (powers of two for text)
        sample = self.workload.samples[0]
        sizes = range(1, self.max_batch_size + 1)
        if self.workload.is_text:
            sizes = sorted({2 ** i for i in range(self.max_batch_size.bit_length())} | {self.max_batch_size})
        for size in sizes:
            self.predict([sample] * size if self.workload.is_text else torch.stack([sample] * size))

    def decode_request(self, request):
        if self.workload.is_text:
            return request["text"]
        return torch.tensor(request["input"], dtype=torch.float32)

    def batch(self, inputs):
        return inputs if self.workload.is_text else torch.stack(inputs)

    @torch.inference_mode()
    def predict(self, x):
        if self.workload.is_text:
            return self.model(*self.workload.collate(list(x)))
        return self.model(x)

    def unbatch(self, output):
        return list(output)

    def encode_response(self, output):
        return {"output": output.tolist()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workload")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--plan", help="serve the model of this overdrive plan.json instead of the eager fp32 one")
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--batch-timeout-ms", type=float, default=2.0)
    parser.add_argument("--workers", type=int, default=1, help="inference worker processes; the cores are split between them")
    args = parser.parse_args()
    api = WorkloadAPI(args.workload, args.plan, max_batch_size=args.max_batch_size, batch_timeout=args.batch_timeout_ms / 1e3)
    if args.workers > 1:  # as `overdrive serve --instances`: each worker gets its share of the cores
        os.environ["OMP_NUM_THREADS"] = str(max(1, torch.get_num_threads() // args.workers))
        torch.set_num_threads(max(1, torch.get_num_threads() // args.workers))
    server = ls.LitServer(api, accelerator="cpu", workers_per_device=args.workers, timeout=60)
    server.run(host="127.0.0.1", port=args.port, generate_client_file=False, log_level="warning")


if __name__ == "__main__":
    main()
