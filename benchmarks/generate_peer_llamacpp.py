"""A llama.cpp peer for `generate_cpu.py`: greedy generation from a GGUF file, driven over stdin/stdout JSON lines.

Runs under its own virtual environment (llama-cpp-python, gguf, numpy; no torch, nothing of overdrive), so that
llama.cpp can be timed beside overdrive's engine and Hugging Face on the same random-weight model
(`llama-125m-random`). Speed only: random weights judge nothing.

Set-up (once; llama-cpp-python compiles llama.cpp from source: about 9 minutes on 2 cores):

    python3 -m venv /work/peers/llamacpp-venv
    CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF" CMAKE_BUILD_PARALLEL_LEVEL=2 \\
        /work/peers/llamacpp-venv/bin/pip install llama-cpp-python gguf numpy
    # GGML_NATIVE=ON: -march=native (AVX-512, VNNI, BF16 on this CPU); LLAVA_BUILD=OFF skips the multimodal library.

The model, saved from overdrive's venv (seeded: the same weights `generate_cpu.build` makes; no tokenizer):

    HF_HUB_OFFLINE=1 PYTHONPATH=src:benchmarks .venv/bin/python -c "from generate_cpu import build; \\
        build('llama-125m-random').save_pretrained('/work/peers/llama-125m-random')"

Conversion to GGUF (this file's `--convert` mode, run by the peer venv's python; writes f32 with gguf's GGUFWriter,
then F16 and Q8_0 with llama.cpp's own quantizer, `llama_model_quantize`, as `llama-quantize` does):

    /work/peers/llamacpp-venv/bin/python benchmarks/generate_peer_llamacpp.py \\
        --convert /work/peers/llama-125m-random --out /work/peers/gguf [--types f32,f16,q8_0]
    # -> /work/peers/gguf/llama-125m-random-{f32,f16,q8_0}.gguf

llama.cpp's convert_hf_to_gguf.py refuses a model directory without a tokenizer, so `--convert` writes the GGUF
itself, as convert_hf_to_gguf.py does for Llama: architecture `llama`, hyper-parameters from config.json
(rope_theta, rms_norm_eps, heads and KV heads, head_dim), the tensors under llama.cpp's names, the Q and K
projections permuted from Hugging Face's rotate-half RoPE layout to llama.cpp's interleaved one (its
`LlamaModel.permute`), and a dummy Llama-2-shaped SentencePiece vocabulary (<unk>, <s>, </s>, 256 byte tokens,
then placeholders up to vocab_size) that is never used: prompts go in as token ids.

Worker protocol (the default mode):

    /work/peers/llamacpp-venv/bin/python benchmarks/generate_peer_llamacpp.py --gguf PATH [--threads 2] \\
        [--n-ctx 512] [--kv-type f16|f32] [--flash-attn auto|on|off] [--verbose]

prints one line `{"ready": true, "load_s": float, "weights_bytes": int, "runtime": "llama.cpp ..."}`, then answers
each input line `{"prompts": [[int, ...], ...], "new": int}` with one line
`{"ttft_s": float, "decode_s": float, "decode_tokens": int, "tokens": [[int, ...], ...]}` (or `{"error": str}`),
and exits on EOF. Everything else (llama.cpp's log) goes to stderr.

- Greedy: the argmax of the raw logits, exactly `new` tokens per prompt; EOS is never looked at, so it stops nothing.
- A batch of B prompts is one llama.cpp batch: the prefill puts all prompts' tokens in one `llama_batch`, each
  token with its prompt's sequence id, and each decode step one token per sequence; the context has
  n_seq_max = B and n_ctx = B × --n-ctx (--n-ctx per sequence; llama.cpp's default non-unified KV cache keeps one
  stream per sequence). The context is made again (outside the timings) when B changes, and its KV cache is
  cleared before every request. Prompts may differ in length.
- ttft_s: the prefill's `llama_decode` and the first token's argmax; decode_s: the sum over the other new - 1 steps
  of `llama_decode` plus the argmax (perf_counter around those calls only: filling the batch's arrays is outside);
  decode_tokens = B × (new - 1).
- The first request (and the first after a change of batch size) pays for paging in the memory-mapped weights
  and llama.cpp's graph set-up, seconds: warm up before timing, as generate_cpu.py does.
- weights_bytes: `llama_model_size` (the bytes of all tensors at their storage type).
- The KV cache is f16 by default, as llama.cpp's own default (Hugging Face and overdrive keep it in fp32:
  `--kv-type f32` for that); flash attention `auto` (llama.cpp's default: on for the CPU backend).

Fidelity caveat: with random weights the logits have near ties, so a correct conversion can still part from
Hugging Face's greedy tokens where a tie flips (summation order, the f16 KV cache), and a wrong one still agrees on
some. Measured on llama-125m-random against Hugging Face eager fp32 `generate` (4 prompts of 32 random ids × 32 new
tokens; in brackets generate_cpu's 128-id batch-1 prompt × 64): the f32 and F16 GGUFs agreed on 1.0 (1.0) of the
tokens (f16 KV cache); Q8_0 0.43 (0.48) (its rounded weights flip ties: speed only); a deliberately wrong conversion
(Q/K not permuted) 0.23 (0.09). A batch-4 call agreed 1.0 with the same prompts run one by one; a batch-16 call of
generate_cpu's 128-id prompts 0.967: 15 of 16 identical, one parted at its 19th token, where Hugging Face's top two
logits differ by 5e-4. So an agreement near 1.0 on the f32 file is the check that a conversion is right.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time

GGML_TYPE_F32, GGML_TYPE_F16 = 0, 1
FTYPES = {"f32": 0, "f16": 1, "q8_0": 7}  # llama_ftype: ALL_F32, MOSTLY_F16, MOSTLY_Q8_0


# ----------------------------------------------------------------------------------------------------------------------
# conversion: Hugging Face Llama directory (config.json + model.safetensors) -> GGUF


def read_safetensors(path: str) -> dict:
    """The tensors of one .safetensors file as numpy arrays (memory-mapped; F32, F16 and BF16)."""
    import numpy as np

    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    raw = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n)
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        start, end = meta["data_offsets"]
        buf = raw[start:end]
        if meta["dtype"] == "F32":
            a = buf.view(np.float32)
        elif meta["dtype"] == "F16":
            a = buf.view(np.float16).astype(np.float32)
        elif meta["dtype"] == "BF16":
            a = (buf.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            raise ValueError(f"{name}: dtype {meta['dtype']} not handled")
        out[name] = a.reshape(meta["shape"])
    return out


def permute(w, n_head: int):
    """convert_hf_to_gguf.py's `LlamaModel.permute`: rotate-half RoPE rows (HF) -> interleaved pairs (llama.cpp)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_f32_gguf(model_dir: str, out_path: str) -> None:
    import glob

    import gguf
    import numpy as np

    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    if cfg.get("model_type") != "llama":
        raise SystemExit(f"--convert handles Llama only, not {cfg.get('model_type')}")
    rope = cfg.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", (cfg.get("rope_scaling") or {}).get("rope_type", "default"))
    if rope_type != "default":
        raise SystemExit(f"rope type {rope_type} not handled (only the default RoPE)")
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    n_embd, n_head = cfg["hidden_size"], cfg["num_attention_heads"]
    n_kv = cfg.get("num_key_value_heads") or n_head
    head_dim = cfg.get("head_dim") or n_embd // n_head
    n_layer, n_vocab = cfg["num_hidden_layers"], cfg["vocab_size"]

    tensors = {}
    for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        tensors.update(read_safetensors(path))

    w = gguf.GGUFWriter(out_path, "llama")
    w.add_name(os.path.basename(os.path.normpath(model_dir)))
    w.add_vocab_size(n_vocab)
    w.add_context_length(cfg.get("max_position_embeddings", 2048))
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(theta))
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    w.add_file_type(FTYPES["f32"])
    # a dummy vocabulary of Llama 2's shape (never used: the worker takes token ids)
    specials = [("<unk>", gguf.TokenType.UNKNOWN), ("<s>", gguf.TokenType.CONTROL), ("</s>", gguf.TokenType.CONTROL)]
    vocab = specials + [(f"<0x{i:02X}>", gguf.TokenType.BYTE) for i in range(256)]
    vocab += [(f"\u2581t{i}", gguf.TokenType.NORMAL) for i in range(len(vocab), n_vocab)]
    w.add_tokenizer_model("llama")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_scores([-float(i) for i in range(n_vocab)])
    w.add_token_types([int(k) for _, k in vocab])
    w.add_unk_token_id(0)
    w.add_bos_token_id(cfg.get("bos_token_id", 1) or 1)
    w.add_eos_token_id(cfg.get("eos_token_id", 2) or 2)
    w.add_add_bos_token(False)

    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    per_layer = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                 "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                 "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down"}
    for i in range(n_layer):
        for hf, gg in per_layer.items():
            names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{gg}.weight"
    if cfg.get("tie_word_embeddings"):
        names.pop("lm_head.weight")  # llama.cpp falls back to token_embd for the output
        tensors.pop("lm_head.weight", None)
    left = set(tensors) - set(names)
    if left:
        raise SystemExit(f"tensors not mapped: {sorted(left)[:5]}")
    for hf, gg in names.items():
        a = np.ascontiguousarray(tensors[hf], dtype=np.float32)
        if hf.endswith("q_proj.weight"):
            a = np.ascontiguousarray(permute(a, n_head))
        elif hf.endswith("k_proj.weight"):
            a = np.ascontiguousarray(permute(a, n_kv))
        w.add_tensor(gg, a)  # (out, in) row-major, which GGUF stores as ne = [in, out]
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def convert(model_dir: str, out_dir: str, types: list[str], threads: int, verbose: bool) -> None:
    import llama_cpp
    import llama_cpp._logger as logger

    logger.set_verbose(verbose)  # llama_model_quantize logs every tensor otherwise

    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, os.path.basename(os.path.normpath(model_dir)))
    f32 = f"{stem}-f32.gguf"
    started = time.perf_counter()
    write_f32_gguf(model_dir, f32)
    print(f"wrote {f32} ({os.path.getsize(f32) / 1e6:.0f} MB) in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    for t in types:
        if t == "f32":
            continue
        out = f"{stem}-{t}.gguf"
        params = llama_cpp.llama_model_quantize_default_params()
        params.nthread = threads
        params.ftype = FTYPES[t]
        started = time.perf_counter()
        rc = llama_cpp.llama_model_quantize(f32.encode(), out.encode(), ctypes.byref(params))
        if rc != 0:
            raise SystemExit(f"llama_model_quantize to {t} failed: {rc}")
        print(f"wrote {out} ({os.path.getsize(out) / 1e6:.0f} MB) in {time.perf_counter() - started:.1f} s",
              file=sys.stderr)
    if "f32" not in types:
        os.remove(f32)


# ----------------------------------------------------------------------------------------------------------------------
# worker


def runtime_version() -> str:
    import llama_cpp

    text = f"llama.cpp (llama-cpp-python {llama_cpp.__version__}"
    lib_dir = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
    try:
        base = ctypes.CDLL(os.path.join(lib_dir, "libggml-base.so"))
        base.ggml_version.restype = base.ggml_commit.restype = ctypes.c_char_p
        text += f", ggml {base.ggml_version().decode()} commit {base.ggml_commit().decode()}"
    except (OSError, AttributeError):
        pass
    return text + ")"


class Worker:
    def __init__(self, args):
        import llama_cpp

        self.ll = llama_cpp
        self.args = args
        llama_cpp.llama_backend_init()
        mparams = llama_cpp.llama_model_default_params()
        mparams.n_gpu_layers = 0
        started = time.perf_counter()
        self.model = llama_cpp.llama_model_load_from_file(args.gguf.encode(), mparams)
        if not self.model:
            raise SystemExit(f"could not load {args.gguf}")
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.ctx = None
        self.batch = None
        self.n_seq = 0
        self._context(1)
        self.load_s = time.perf_counter() - started

    def _context(self, n_seq: int) -> None:
        """A context for n_seq sequences (n_ctx per sequence from --n-ctx), and a batch that holds a whole prefill."""
        ll = self.ll
        if self.ctx is not None:
            ll.llama_batch_free(self.batch)
            ll.llama_free(self.ctx)
        p = ll.llama_context_default_params()
        p.n_ctx = self.args.n_ctx * n_seq
        p.n_batch = p.n_ctx
        p.n_seq_max = n_seq
        p.n_threads = p.n_threads_batch = self.args.threads
        p.type_k = p.type_v = {"f16": GGML_TYPE_F16, "f32": GGML_TYPE_F32}[self.args.kv_type]
        p.flash_attn_type = {"auto": -1, "off": 0, "on": 1}[self.args.flash_attn]
        self.ctx = ll.llama_init_from_model(self.model, p)
        if not self.ctx:
            raise RuntimeError(f"could not make a context for {n_seq} sequences")
        self.n_seq = n_seq
        self.n_batch = p.n_ctx
        self.batch = ll.llama_batch_init(self.n_batch, 0, 1)

    def _fill(self, entries) -> None:
        """entries: (token, pos, seq, wants_logits) for each token of the next llama_decode."""
        b = self.batch
        for i, (tok, pos, seq, out) in enumerate(entries):
            b.token[i] = tok
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = out
        b.n_tokens = len(entries)

    def _step(self, n_out: int):
        """llama_decode on the filled batch, then the argmax of each output's logits (in the batch's order)."""
        import numpy as np

        rc = self.ll.llama_decode(self.ctx, self.batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        logits = np.ctypeslib.as_array(self.ll.llama_get_logits(self.ctx), shape=(n_out, self.n_vocab))
        return logits.argmax(axis=1).tolist()

    def generate(self, prompts: list[list[int]], new: int) -> dict:
        ll = self.ll
        b = len(prompts)
        if b < 1 or new < 1 or any(len(p) < 1 for p in prompts):
            raise ValueError("needs at least one non-empty prompt and new >= 1")
        if any(not 0 <= t < self.n_vocab for p in prompts for t in p):
            raise ValueError(f"token ids must lie in [0, {self.n_vocab})")
        longest = max(len(p) for p in prompts)
        if longest + new > self.args.n_ctx:
            raise ValueError(f"prompt {longest} + new {new} tokens exceed --n-ctx {self.args.n_ctx} per sequence")
        if b != self.n_seq:
            self._context(b)
        ll.llama_memory_clear(ll.llama_get_memory(self.ctx), True)

        self._fill([(t, j, s, j == len(p) - 1) for s, p in enumerate(prompts) for j, t in enumerate(p)])
        started = time.perf_counter()
        nxt = self._step(b)
        ttft = time.perf_counter() - started
        tokens = [[t] for t in nxt]
        decode = 0.0
        for k in range(1, new):
            self._fill([(nxt[s], len(p) + k - 1, s, True) for s, p in enumerate(prompts)])
            started = time.perf_counter()
            nxt = self._step(b)
            decode += time.perf_counter() - started
            for s in range(b):
                tokens[s].append(nxt[s])
        return {"ttft_s": ttft, "decode_s": decode, "decode_tokens": b * (new - 1), "tokens": tokens}


def serve(args) -> None:
    import llama_cpp
    import llama_cpp._logger as logger

    logger.set_verbose(args.verbose)
    worker = Worker(args)
    print(f"llama.cpp system info: {llama_cpp.llama_print_system_info().decode()}", file=sys.stderr)
    print(json.dumps({"ready": True, "load_s": worker.load_s,
                      "weights_bytes": int(llama_cpp.llama_model_size(worker.model)),
                      "runtime": runtime_version()}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            request = json.loads(line)
            reply = worker.generate([list(map(int, p)) for p in request["prompts"]], int(request["new"]))
        except Exception as e:  # noqa: BLE001 — one bad request answers an error, the worker goes on
            reply = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(reply), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", help="the model to serve (worker mode)")
    parser.add_argument("--threads", type=int, default=2, help="n_threads and n_threads_batch")
    parser.add_argument("--n-ctx", type=int, default=512, help="context length per sequence")
    parser.add_argument("--kv-type", choices=["f16", "f32"], default="f16", help="KV cache type (llama.cpp's default f16)")
    parser.add_argument("--flash-attn", choices=["auto", "on", "off"], default="auto")
    parser.add_argument("--verbose", action="store_true", help="llama.cpp's full log on stderr")
    parser.add_argument("--convert", metavar="MODEL_DIR", help="convert a Hugging Face Llama directory to GGUF")
    parser.add_argument("--out", metavar="DIR", help="where --convert writes")
    parser.add_argument("--types", default="f32,f16,q8_0", help="--convert's outputs: f32, f16, q8_0")
    args = parser.parse_args()
    if args.convert:
        if not args.out:
            parser.error("--convert needs --out")
        types = args.types.split(",")
        if set(types) - set(FTYPES):
            parser.error(f"--types from {sorted(FTYPES)}")
        convert(args.convert, args.out, types, args.threads, args.verbose)
    elif args.gguf:
        serve(args)
    else:
        parser.error("--gguf PATH (worker) or --convert MODEL_DIR --out DIR")


if __name__ == "__main__":
    main()
