"""OpenVINO peer for `generate_cpu.py`: Optimum-Intel's `OVModelForCausalLM` (stateful KV cache) as a JSON-lines worker.

Runs in its own virtual environment (Optimum-Intel pins its own transformers and needs nncf for 8-bit weights), never
in the project's venv: the benchmark side starts it as a subprocess and talks to it over stdin/stdout, one JSON object
a line; everything else goes to stderr.

Set-up (x86_64, Python 3.11; installing torch first keeps pip from downloading another CUDA build of it: 2.14.1 lies
on this machine's disk, or use torch==2.13.0, a CPU build, also on disk). Checked 2026-12-07 with openvino 2026.4.1,
optimum-intel 2.2.0, optimum 2.3.0, nncf 3.4.0, transformers 5.5.4 (which optimum-intel 2.2 now accepts):

    python3 -m venv /work/peers/ov-venv
    /work/peers/ov-venv/bin/pip install torch==2.14.1
    /work/peers/ov-venv/bin/pip install "optimum-intel[openvino]" nncf

The model: the random-weight Llama that generate_cpu builds (seeded, so the same weights), saved from the project venv
(it has no tokenizer; prompts are token ids):

    HF_HUB_OFFLINE=1 PYTHONPATH=src:benchmarks .venv/bin/python -c "from generate_cpu import build; \\
        build('llama-125m-random').save_pretrained('/work/peers/llama-125m-random')"

Export to OpenVINO IR, either with this file (Optimum-Intel's Python API: `OVModelForCausalLM.from_pretrained(...,
export=True)`, for int8 with `OVWeightQuantizationConfig(bits=8)`, i.e. nncf's int8 weight compression, asymmetric,
per output channel) ...

    HF_HUB_OFFLINE=1 /work/peers/ov-venv/bin/python benchmarks/generate_peer_openvino.py \\
        --export /work/peers/llama-125m-random --out /work/peers/ov-llama-fp32 --weight-format fp32
    HF_HUB_OFFLINE=1 /work/peers/ov-venv/bin/python benchmarks/generate_peer_openvino.py \\
        --export /work/peers/llama-125m-random --out /work/peers/ov-llama-int8 --weight-format int8

... or with Optimum's command line, which gives the same IR:

    HF_HUB_OFFLINE=1 /work/peers/ov-venv/bin/optimum-cli export openvino --model /work/peers/llama-125m-random \\
        --task text-generation-with-past --weight-format fp32 /work/peers/ov-llama-fp32      # and int8 / ov-llama-int8

(With no tokenizer files, transformers makes a default Llama tokenizer from the config and the exporter saves it
beside the IR; the worker never uses it.)

Worker:

    HF_HUB_OFFLINE=1 /work/peers/ov-venv/bin/python benchmarks/generate_peer_openvino.py --ir DIR \\
        [--precision f32|default] [--kv-cache auto|f32|default] [--threads 2]

prints `{"ready": true, "load_s": ..., "weights_bytes": ..., "runtime": "openvino <v>, optimum-intel <v>", ...}`,
then for each input line `{"prompts": [[id, ...], ...], "new": N}` (all prompts the same length, one batch) prints
`{"ttft_s": ..., "decode_s": ..., "decode_tokens": B * (N - 1), "tokens": [[id, ...], ...]}`: greedy, exactly N new
tokens per prompt (no EOS), TTFT = a one-new-token `generate`'s wall time, decode = the full `generate` less it (as
generate_cpu's hf_entry). An input line that fails gets `{"error": "..."}`. Exits at EOF.

--precision f32 sets INFERENCE_PRECISION_HINT=f32 and (with --kv-cache auto, the default) KV_CACHE_PRECISION=f32:
fp32 throughout, against Hugging Face fp32. Under the f32 hint alone the CPU plugin (2026.4) still keeps the KV cache
in f16 for the fp32 IR and in u8 for the int8-weight IR (`--kv-cache default` keeps that). `--precision default`
leaves both to the plugin: on an AVX512-BF16 CPU, bf16 compute, an f16 KV cache (fp32 IR) or a u8 one (int8 IR). The
ready line reports the properties as compiled. Threads: INFERENCE_NUM_THREADS, one stream, latency hint; OMP/MKL and
torch (which Optimum's generation loop uses for the logits) are pinned to the same count.

Greedy agreement with Hugging Face eager fp32 `generate` (transformers 5.25, 4 random prompts of 128 ids x 32 new
tokens; random weights have near ties): fp32 IR with --precision f32 1.0000 (also with the f16 KV cache); int8
weights with --precision f32 0.69; fp32 IR at the plugin's default (bf16) 0.64.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def export(model_dir: str, out: str, weight_format: str) -> None:
    from optimum.intel import OVModelForCausalLM, OVWeightQuantizationConfig

    kwargs = {"load_in_8bit": False}
    if weight_format == "int8":
        kwargs = {"quantization_config": OVWeightQuantizationConfig(bits=8)}
    started = time.perf_counter()
    model = OVModelForCausalLM.from_pretrained(model_dir, export=True, compile=False, **kwargs)
    model.save_pretrained(out)
    log(f"exported {model_dir} -> {out} ({weight_format}) in {time.perf_counter() - started:.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ir", help="an exported OpenVINO IR directory (worker mode)")
    parser.add_argument("--precision", choices=["f32", "default"], default="f32")
    parser.add_argument("--kv-cache", choices=["auto", "f32", "default"], default="auto",
                        help="KV_CACHE_PRECISION: auto = f32 with --precision f32, the plugin's own otherwise")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--export", metavar="MODEL_DIR", help="a Hugging Face model directory to export (export mode)")
    parser.add_argument("--out", help="the IR directory to write (export mode)")
    parser.add_argument("--weight-format", choices=["fp32", "int8"], default="fp32")
    args = parser.parse_args()
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    if args.export:
        if not args.out:
            parser.error("--export needs --out")
        export(args.export, args.out, args.weight_format)
        return
    if not args.ir:
        parser.error("give --ir DIR (worker) or --export MODEL_DIR --out DIR (export)")

    # Only the protocol goes to stdout: anything a library prints there goes to stderr instead.
    protocol = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    sys.stdout = sys.stderr

    from importlib.metadata import version

    import torch
    from optimum.intel import OVModelForCausalLM

    torch.set_num_threads(args.threads)
    ov_config = {"INFERENCE_NUM_THREADS": args.threads, "NUM_STREAMS": 1, "PERFORMANCE_HINT": "LATENCY",
                 "CACHE_DIR": ""}
    if args.precision == "f32":
        ov_config["INFERENCE_PRECISION_HINT"] = "f32"
    if args.kv_cache == "f32" or (args.kv_cache == "auto" and args.precision == "f32"):
        ov_config["KV_CACHE_PRECISION"] = "f32"
    started = time.perf_counter()
    model = OVModelForCausalLM.from_pretrained(args.ir, ov_config=ov_config, compile=True)
    load_s = time.perf_counter() - started
    model.generation_config.eos_token_id = None  # exactly `new` tokens, as generate_cpu's reference
    model.generation_config.pad_token_id = 0
    compiled = model.request.get_compiled_model()
    props = {}
    for key in ("INFERENCE_PRECISION_HINT", "KV_CACHE_PRECISION", "INFERENCE_NUM_THREADS", "NUM_STREAMS",
                "DYNAMIC_QUANTIZATION_GROUP_SIZE", "ENABLE_CPU_PINNING"):
        try:
            value = compiled.get_property(key)
            props[key] = value.get_type_name() if hasattr(value, "get_type_name") else str(value)
        except Exception as exc:  # a property this plugin version lacks
            props[key] = f"? {exc}"
    weights = sum(f.stat().st_size for f in Path(args.ir).glob("openvino_model.bin"))
    log(f"loaded {args.ir} in {load_s:.2f} s, stateful={model.stateful}, {props}")
    print(json.dumps({"ready": True, "load_s": load_s, "weights_bytes": weights, "stateful": bool(model.stateful),
                      "runtime": f"openvino {version('openvino')}, optimum-intel {version('optimum-intel')}",
                      "properties": props}), file=protocol, flush=True)

    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            request = json.loads(line)
            new = int(request["new"])
            prompts = torch.tensor(request["prompts"], dtype=torch.int64)
            mask = torch.ones_like(prompts)
            greedy = dict(input_ids=prompts, attention_mask=mask, do_sample=False, num_beams=1)
            with torch.no_grad():
                started = time.perf_counter()
                model.generate(**greedy, max_new_tokens=1, min_new_tokens=1)
                ttft = time.perf_counter() - started
                started = time.perf_counter()
                out = model.generate(**greedy, max_new_tokens=new, min_new_tokens=new)
                total = time.perf_counter() - started
            tokens = out[:, prompts.shape[1]:].tolist()
            assert all(len(t) == new for t in tokens), [len(t) for t in tokens]
            reply = {"ttft_s": ttft, "decode_s": max(total - ttft, 1e-9), "decode_tokens": prompts.shape[0] * (new - 1),
                     "tokens": tokens}
        except Exception as exc:
            log(f"request failed: {exc!r}")
            reply = {"error": repr(exc)}
        print(json.dumps(reply), file=protocol, flush=True)


if __name__ == "__main__":
    main()
