"""Token generation on the CPU: overdrive's engine against Hugging Face `generate`, side by side in one run.

A random-weight causal LM of a real shape (the built-ins llama-125m-random and gpt2-small-random; speed only: no
accuracy claim rests on random weights), the same prompts (random token ids of a fixed length), greedy, the same
number of new tokens, the same batch for every entry. Entries are timed in interleaved repeats; each figure is the
median with its range.

Per entry and batch size: time to first token (TTFT, the prefill), decode tokens/s in total (new tokens
after the first over the decode time) and per sequence, and the tokens' agreement with Hugging Face eager
fp32 (the reference). Hugging Face's decode time is its whole `generate` less a one-token `generate`. The decode
roofline (`generate/roofline.py`): bytes read per decode step (weights at their storage dtype, the KV cache's slots)
× steps/s against the measured copy bandwidth.

    .venv/bin/python benchmarks/generate_cpu.py [--shape llama-125m-random|gpt2-small-random] [--batch-sizes 1,16]
        [--prompt-tokens 128] [--new-tokens 64] [--repeats 3] [--entries hf-eager,overdrive-eager,overdrive-compiled]

Entries: hf-eager, hf-static-compiled (Hugging Face's static KV cache with its forward under torch.compile,
fullgraph, as its docs set it up), hf-continuous-batching (`generate_batch`), overdrive-eager, overdrive-compiled,
and every linear layer each low-precision form of `generate/quantize.py` holds: overdrive-int8-weight[-compiled],
overdrive-fp16-weight, overdrive-int8-rowwise[-compiled], overdrive-int4-weight[-compiled].

Peers in their own virtual environments (they pin other versions of transformers and torch), each a worker
process speaking JSON lines (`benchmarks/generate_peer_*.py`, whose docstrings give the set-up and the conversion
of this script's model, saved by `--save-model DIR`): llamacpp-f32 and llamacpp-q8_0 (llama-cpp-python on a GGUF
file; `--llamacpp-python`, `--gguf-dir`), openvino-fp32 and openvino-int8 (Optimum-Intel's OVModelForCausalLM,
8-bit weights by NNCF; `--openvino-python`, `--ov-dir`). A peer's load and conversion are outside the timing, as
the other entries' compilation is. At the end, each precision's best overdrive entry against its best peer.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

SHAPES = {  # the random-weight built-ins (`workloads.generation.RANDOM_LMS`) and a tiny Llama for trial runs
    "llama-tiny": ("llama", dict(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                 num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
                                 tie_word_embeddings=False)),
}
ALIASES = {"llama-150m": "llama-125m-random"}  # the name earlier results in RESULTS.md used


def build(shape: str):
    import transformers

    from overdrive.workloads.generation import RANDOM_LMS

    family, config = {**RANDOM_LMS, **SHAPES}[ALIASES.get(shape, shape)]
    torch.manual_seed(0)
    if family == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**config)).eval()
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def hf_entry(model, prompts: torch.Tensor, new: int) -> dict:
    mask = torch.ones_like(prompts)
    started = time.perf_counter()
    model.generate(input_ids=prompts, attention_mask=mask, max_new_tokens=1, do_sample=False)
    ttft = time.perf_counter() - started
    started = time.perf_counter()
    out = model.generate(input_ids=prompts, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                         do_sample=False)
    total = time.perf_counter() - started
    b = prompts.shape[0]
    return {"ttft_s": ttft, "decode_s": max(total - ttft, 1e-9), "decode_tokens": b * (new - 1),
            "tokens": out[:, prompts.shape[1]:].tolist(), "slots": prompts.shape[1] + new}


def hf_continuous_entry(model, prompts: torch.Tensor, new: int) -> dict:
    """Hugging Face continuous batching (`generate_batch`, transformers 5: a paged KV cache, requests scheduled per
    step), timed by its own per-token timestamps (`record_timestamps`): TTFT from the first request's scheduling to
    the last request's first token, decode from there to the last token (its set-up, seconds per call on the CPU,
    is in neither: a server pays it once)."""
    import transformers

    config = transformers.GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
    out = model.generate_batch(inputs=prompts.tolist(), generation_config=config, warmup=False, record_timestamps=True)
    outputs = [out[f"req_{i}"] for i in range(prompts.shape[0])]
    scheduled = min(o.lifespan[0] if o.lifespan[0] >= 0 else o.created_time for o in outputs)
    first = max(o.timestamps[0] for o in outputs)
    last = max(o.timestamps[-1] for o in outputs)
    b = prompts.shape[0]
    return {"ttft_s": first - scheduled, "decode_s": last - first, "decode_tokens": b * (new - 1),
            "tokens": [o.generated_tokens for o in outputs], "slots": prompts.shape[1] + new}


def overdrive_entry(generator, prompts: torch.Tensor, new: int) -> dict:
    from overdrive.generate import SamplingParams

    completions = generator.generate(prompts.tolist(), SamplingParams(max_new_tokens=new))
    (t,) = generator.timings
    return {"ttft_s": t.prefill_s, "decode_s": sum(t.step_s), "decode_tokens": t.new_tokens - t.batch_size,
            "tokens": [c.token_ids for c in completions], "slots": t.slots}


PRECISION = {  # the weights' precision of each entry, for the comparison against the best peer at the same one
    "hf-eager": "fp32", "hf-static-compiled": "fp32", "hf-continuous-batching": "fp32", "overdrive-eager": "fp32",
    "overdrive-compiled": "fp32", "llamacpp-f32": "fp32", "openvino-fp32": "fp32", "overdrive-fp16-weight": "16-bit",
    "llamacpp-q8_0": "8-bit", "openvino-int8": "8-bit", "overdrive-int8-weight": "8-bit",
    "overdrive-int8-weight-compiled": "8-bit", "overdrive-int8-rowwise": "8-bit", "overdrive-int8-rowwise-compiled": "8-bit",
    "overdrive-int4-weight": "4-bit", "overdrive-int4-weight-compiled": "4-bit",
}
PEERS = {  # entry -> (the worker script, how it is given its model)
    "llamacpp-f32": ("generate_peer_llamacpp.py", lambda a: ["--gguf", str(Path(a.gguf_dir) / f"{a.shape}-f32.gguf")]),
    "llamacpp-q8_0": ("generate_peer_llamacpp.py", lambda a: ["--gguf", str(Path(a.gguf_dir) / f"{a.shape}-q8_0.gguf")]),
    "openvino-fp32": ("generate_peer_openvino.py", lambda a: ["--ir", f"{a.ov_dir}-fp32", "--precision", "f32"]),
    "openvino-int8": ("generate_peer_openvino.py", lambda a: ["--ir", f"{a.ov_dir}-int8", "--precision", "f32"]),
}


class Peer:
    """A peer runtime in a worker process of its own Python: one JSON line out when loaded ({"ready": true,
    "weights_bytes", "runtime", ...}), then one JSON line in per call ({"prompts", "new"}) and one out (the
    entries' dict, or {"error": why})."""

    def __init__(self, python: str, script: str, args: list[str]):
        self.log = tempfile.NamedTemporaryFile("w+", prefix="generate-peer-", suffix=".log", delete=False)
        self.process = subprocess.Popen([python, str(Path(__file__).parent / script), "--threads",
                                         str(torch.get_num_threads()), *args],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.ready = self._answer()

    def _answer(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the peer worker {self.process.args[1]} ended (exit {self.process.wait()}); its "
                               f"log: {self.log.name}")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"{Path(self.process.args[1]).name}: {answer['error']}")
        return answer

    def __call__(self, prompts: torch.Tensor, new: int) -> dict:
        self.process.stdin.write(json.dumps({"prompts": prompts.tolist(), "new": new}) + "\n")
        self.process.stdin.flush()
        return {**self._answer(), "slots": prompts.shape[1] + new}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-125m-random",
                        choices=["llama-125m-random", "gpt2-small-random", *SHAPES, *ALIASES])
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--entries", default="hf-eager,overdrive-eager,overdrive-compiled")
    parser.add_argument("--save-model", metavar="DIR", help="save the model (Hugging Face format) for the peers' "
                        "conversions, and stop")
    parser.add_argument("--llamacpp-python", default="/work/peers/llamacpp-venv/bin/python")
    parser.add_argument("--gguf-dir", default="/work/peers/gguf", help="SHAPE-f32.gguf and SHAPE-q8_0.gguf")
    parser.add_argument("--openvino-python", default="/work/peers/ov-venv/bin/python")
    parser.add_argument("--ov-dir", default="/work/peers/ov-llama", help="OpenVINO IR exports in OV_DIR-fp32 and "
                        "OV_DIR-int8")
    args = parser.parse_args()
    if args.save_model:
        build(args.shape).save_pretrained(args.save_model)
        return

    from overdrive.generate import Decoder, Generator
    from overdrive.generate.quantize import FORMS, copy_decoder, quantize_linears
    from overdrive.generate.roofline import decode_roofline

    model = build(args.shape)
    static = copy.deepcopy(model)
    static.generation_config.cache_implementation = "static"
    static.forward = torch.compile(static.forward, fullgraph=True)
    params = sum(p.numel() for p in model.parameters())
    decoder = Decoder.from_hf(model)
    models = {}  # entry -> the decoder whose bytes it reads (Hugging Face's: the same fp32 weights)
    entries = {
        "hf-eager": lambda x: hf_entry(model, x, args.new_tokens),
        "hf-static-compiled": lambda x: hf_entry(static, x, args.new_tokens),
        "hf-continuous-batching": lambda x: hf_continuous_entry(model, x, args.new_tokens),
        "overdrive-eager": (lambda g: lambda x: overdrive_entry(g, x, args.new_tokens))(
            Generator(decoder, max_batch_size=1024)),
        "overdrive-compiled": (lambda g: lambda x: overdrive_entry(g, x, args.new_tokens))(
            Generator(decoder, max_batch_size=1024, compile=True)),
    }
    for form in FORMS:  # every linear layer in the form (speed only: random weights judge nothing)
        converted = copy_decoder(decoder)
        quantize_linears(converted, form=form)
        models[f"overdrive-{form}"] = models[f"overdrive-{form}-compiled"] = converted
        entries[f"overdrive-{form}"] = (lambda g: lambda x: overdrive_entry(g, x, args.new_tokens))(
            Generator(converted, max_batch_size=1024))
        if form != "fp16-weight":  # FBGEMM's packed weights are opaque to torch.compile
            entries[f"overdrive-{form}-compiled"] = (lambda g: lambda x: overdrive_entry(g, x, args.new_tokens))(
                Generator(converted, max_batch_size=1024, compile=True))
    chosen = args.entries.split(",")
    peers = {}
    for name in chosen:
        if name in PEERS:
            script, model_args = PEERS[name]
            python = args.llamacpp_python if name.startswith("llamacpp") else args.openvino_python
            peers[name] = Peer(python, script, model_args(args))
            entries[name] = (lambda peer: lambda x: peer(x, args.new_tokens))(peers[name])
            print(f"{name}: {peers[name].ready.get('runtime', '?')}, loaded in {peers[name].ready['load_s']:.1f} s",
                  flush=True)
    print(f"generate_cpu {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC · torch {torch.__version__} · "
          f"{torch.get_num_threads()} threads · {args.shape} ({params / 1e6:.0f} M parameters, random weights, fp32) · "
          f"prompts {args.prompt_tokens} tokens · {args.new_tokens} new · greedy")
    g = torch.Generator().manual_seed(1)
    for b in (int(x) for x in args.batch_sizes.split(",")):
        prompts = torch.randint(1, model.config.vocab_size, (b, args.prompt_tokens), generator=g)
        with torch.no_grad():
            for name in chosen:  # warm-up (compiles) outside the timed repeats
                entries[name](prompts[:, :8].contiguous())
                entries[name](prompts)
            runs = {name: [] for name in chosen}
            for _ in range(args.repeats):
                for name in chosen:
                    runs[name].append(entries[name](prompts))
        reference = runs[chosen[0]][0]["tokens"]
        print(f"\nbatch {b}: entry | TTFT ms | decode tokens/s total | per sequence | vs {chosen[0]} | token agreement | "
              "decode roofline")
        base, best = None, {}
        for name in chosen:
            rates = [r["decode_tokens"] / r["decode_s"] for r in runs[name]]
            ttft = statistics.median(r["ttft_s"] for r in runs[name]) * 1e3
            rate = statistics.median(rates)
            base = base or rate
            tokens = runs[name][0]["tokens"]
            agree = sum(a == c for x, y in zip(reference, tokens) for a, c in zip(x, y)) / sum(len(x) for x in reference)
            if name in peers:  # its own weights' bytes; its KV cache's dtype is its own (not counted)
                roof = f"{peers[name].ready['weights_bytes'] / 1e6:.0f} MB weights"
            else:
                roof = decode_roofline(models.get(name, decoder), batch_size=b, slots=runs[name][0]["slots"],
                                       cache_dtype=torch.float32, steps_per_s=rate / b).describe()
            print(f"  {name:20s} | {ttft:8.1f} | {rate:8.1f} [{min(rates):.1f}, {max(rates):.1f}] | {rate / b:7.1f} | "
                  f"{rate / base:5.2f}× | {agree:.4f} | {roof}")
            side = "overdrive" if name.startswith("overdrive") else "peer"
            key = (PRECISION.get(name, "?"), side)
            if rate > best.get(key, (0.0, ""))[0]:
                best[key] = (rate, name)
        for precision in dict.fromkeys(p for p, _ in best):
            ours, theirs = best.get((precision, "overdrive")), best.get((precision, "peer"))
            if ours and theirs:
                print(f"  {precision}: best overdrive {ours[1]} {ours[0]:.1f} against best peer {theirs[1]} "
                      f"{theirs[0]:.1f} tokens/s: {ours[0] / theirs[0]:.2f}×")
    for peer in peers.values():
        peer.process.stdin.close()
        peer.process.wait(timeout=60)


if __name__ == "__main__":
    main()
