"""Serving generation under load: continuous batching against static batching and one request at a time, the same
server code and the same requests, side by side in one run (the CPU; --device cuda for `make gpu-check`).

The server (`serve/generation.py`, uvicorn in a thread of this process) serves the workload's model with the decode
step compiled (eager with --no-compile), its scheduler one of:
- continuous: `ContinuousGenerator(max_batch_size=streams)`, a request joins at the next step;
- static: the same with scheduling="static": a batch is admitted only when the last one has ended entirely;
- one-at-a-time: max_batch_size 1;
- hf-continuous: Hugging Face's own server, `transformers serve DIR --continuous-batching --device D` (its paged
  continuous batching, eager: no --compile), in a process of its own on the workload's model and tokenizer saved to a
  temporary folder (it needs `accelerate`); it takes text prompts, so each prompt is its token ids decoded (the table
  says how many re-tokenize to other ids); no engine ITL, KV or prefix-cache figures (it reports none);
an entry "continuous/N" prefills at most N prompt tokens a step (`max_prefill_tokens`; chunked prefill beyond it);
"-nocache" after a scheduler's name turns prefix caching off (`prefix_caching=False`; on for the others); ":bK" at
the end of an entry gives it KV blocks of K slots (else --block-size), e.g. "continuous:b4".
With --shared-prefix, every prompt starts with the same text (a chat's system prompt, as an API's users send it),
the case prefix caching is for.
A load generator in its own process (multiprocessing, spawn) keeps `streams` clients busy: each sends its next
request (streamed, greedy, `max_tokens` drawn once per request, seeded, from --min-new..--max-new; the workload's
held-out prompts) after an exponential pause (mean --think-ms: Poisson-like arrivals), and records time to first
token (TTFT) and the gaps between streamed chunks (inter-token latency as a client sees it: a token whose text is
held back, an unfinished UTF-8 character or a random-weight model's id beyond its tokenizer's 4,096, comes with the
next chunk), and the server side records when the engine took each request and produced each token (eTTFT and ITL
per token, at the engine: the figures `bench` measures, for a model whose tokens carry no text). Per
entry and stream count: total tokens/s (completion tokens over the wall time from the first request to the last
answer), TTFT and both ITLs p50/p99,
the KV cache's empty share (a property of each sequence's length and the block size, so the same for every
scheduler), the share of prompt tokens the prefix cache held ("cached"; the untimed load has warmed it, as a
running server's would be), and whether each answer equals the first entry's (greedy: it must). Each entry first serves a short
untimed load (its engine thread's first steps), then the timed one.

    .venv/bin/python benchmarks/serve_generate_cpu.py [--workload pydoc-lm] [--streams 1,8,32] [--requests 64]
        [--min-new 8] [--max-new 96] [--think-ms 20] [--block-size K] [--shared-prefix] [--device cuda]
        [--dtype bfloat16] [--no-compile]
        [--entries continuous,continuous/64,continuous-nocache,continuous:b4,static,one-at-a-time,hf-continuous]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import importlib.util
import json
import multiprocessing
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import torch


def load(url: str, requests: list[dict], streams: int, think_ms: float, seed: int, out) -> None:
    """The load generator (its own process): `streams` clients share `requests`; sends the results to `out`."""
    import httpx

    async def main():
        queue = list(enumerate(requests))
        results = {}
        rng = random.Random(seed)

        async def client(http):
            while queue:
                index, body = queue.pop(0)
                await asyncio.sleep(rng.expovariate(1000 / think_ms) if think_ms else 0)
                sent = time.perf_counter()
                chunks, text, usage = [], "", None
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        event = json.loads(line[6:])
                        if event.get("usage"):
                            usage = event["usage"]
                        if event.get("choices") and event["choices"][0]["text"]:
                            chunks.append(time.perf_counter())
                            text += event["choices"][0]["text"]
                results[index] = {"sent": sent, "chunks": chunks, "text": text, "ended": time.perf_counter(),
                                  "tokens": usage["completion_tokens"] if usage else 0}

        async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=streams)) as http:
            await asyncio.gather(*(client(http) for _ in range(streams)))
        return results

    out.send(asyncio.run(main()))


SYSTEM = ("You answer questions about Python from its documentation. Answer in one or two sentences, name the "
          "module or the statement the question is about, give a short example where one helps, and say so when the "
          "documentation does not answer the question.\n\n")


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def drive(url: str, requests: list[dict], streams: int, think_ms: float, context, on_warm=None) -> dict:
    """A short untimed load (a server's first steps), then `on_warm()`, then the timed load; the timed load's
    results (request index -> what its client saw)."""
    for timed in (False, True):
        receive, send = context.Pipe(duplex=False)
        todo = requests if timed else requests[:2 * streams]
        client = context.Process(target=load, args=(url, todo, streams, think_ms, streams, send))
        client.start()
        results = receive.recv()
        client.join()
        if not timed and on_warm is not None:
            on_warm()
    return results


@contextlib.contextmanager
def hf_server(workload, device: str):
    """`transformers serve --continuous-batching` on the workload's model, in its own process; yields its URL and
    the model name requests must carry.

    Raises:
        RuntimeError: the server did not answer /health within 240 s (its output's tail said)."""
    import httpx

    with tempfile.TemporaryDirectory(prefix="hf-serve-") as folder:
        workload.model.save_pretrained(folder)
        workload.tokenizer.save_pretrained(folder)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        log = open(os.path.join(folder, "server.log"), "w+")
        server = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "transformers"), "serve", folder,
                                   "--continuous-batching", "--device", device, "--host", "127.0.0.1", "--port", str(port),
                                   "--log-level", "warning"], stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.time() + 240
            while time.time() < deadline and server.poll() is None:
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(1)
            else:
                log.seek(0)
                raise RuntimeError(f"transformers serve did not start: {log.read()[-1500:]}")
            yield url, folder
        finally:
            os.killpg(server.pid, 15)
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, 9)
            log.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="pydoc-lm")
    parser.add_argument("--streams", default="1,8,32")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--min-new", type=int, default=8)
    parser.add_argument("--max-new", type=int, default=96)
    parser.add_argument("--think-ms", type=float, default=20.0)
    parser.add_argument("--entries", default="continuous,static,one-at-a-time,hf-continuous")
    parser.add_argument("--block-size", type=int, help="KV slots per block (default: the generator's)")
    parser.add_argument("--shared-prefix", action="store_true", help="every prompt after the same system text")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda for `make gpu-check ONLY=serve-generate`")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the model's weights and KV cache")
    parser.add_argument("--no-compile", dest="compile", action="store_false",
                        help="the decode step eager (a compiled step builds a graph per batch size it meets)")
    args = parser.parse_args()

    from overdrive.generate import Decoder
    from overdrive.workloads.generation import create_generation_workload

    workload = create_generation_workload(args.workload, num_prompts=args.requests)
    workload.model.to(device=args.device, dtype=getattr(torch, args.dtype))
    decoder = Decoder.from_hf(workload.model)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.min_new, args.max_new + 1, (args.requests,), generator=g).tolist()
    system_ids = workload.tokenizer.encode(SYSTEM, add_special_tokens=False)

    def prompt(i: int):  # a workload's prompts are texts, or token ids (a random-weight model's)
        p = workload.prompts[i % len(workload.prompts)]
        if not args.shared_prefix:
            return p
        return SYSTEM + p if isinstance(p, str) else system_ids + list(p)

    requests = [{"prompt": prompt(i), "max_tokens": n, "temperature": 0,
                 "stream": True, "stream_options": {"include_usage": True}} for i, n in enumerate(lengths)]
    print(f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; {args.workload} "
          f"({sum(p.numel() for p in decoder.parameters()) / 1e6:.1f} M parameters), {args.requests} requests, "
          f"max_tokens {min(lengths)}–{max(lengths)}, greedy, streamed; think time {args.think_ms:g} ms (mean); "
          f"{args.device}, {args.dtype}; decode step {'compiled' if args.compile else 'eager'}; KV blocks of {args.block_size or 'the default'} unless an entry says"
          + (f"; every prompt after the same {len(system_ids)}-token system text"
             if args.shared_prefix else ""), flush=True)
    context = multiprocessing.get_context("spawn")
    print(f"\n{'streams':>7} {'entry':<16}{'tokens/s':>10}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}"
          f"{'ITL p99':>9}{'eTTFT p50':>10}{'tok p50':>9}{'tok p99':>9}{'KV empty':>10}{'cached':>8}  answers   "
          f"(TTFT, ITL: the client's; eTTFT, tok: the engine's)",
          flush=True)
    for streams in [int(x) for x in args.streams.split(",")]:
        reference = None
        for entry in args.entries.split(","):
            if entry == "hf-continuous" and importlib.util.find_spec("accelerate") is None:
                print(f"{streams:>7} {entry:<16}skipped: `transformers serve` needs accelerate (pip install accelerate)")
                continue
            if entry == "hf-continuous":
                texts = [workload.tokenizer.decode(r["prompt"], skip_special_tokens=True) if not isinstance(r["prompt"], str)
                         else r["prompt"] for r in requests]
                kept = sum(workload.tokenizer(t)["input_ids"] == list(r["prompt"]) for t, r in zip(texts, requests))
                with hf_server(workload, args.device) as (url, name):
                    results = drive(url, [{**r, "prompt": t, "model": name} for r, t in zip(requests, texts)],
                                    streams, args.think_ms, context)
                produced, submitted, kv_waste, cached = {}, {}, None, None
                note = f"; {len(requests) - kept} prompts re-tokenize to other ids" if kept < len(requests) else ""
            else:
                results, produced, submitted, kv_waste, cached = serve_ours(entry, streams, args, workload, decoder, requests,
                                                                  context)
                note = ""
            wall = max(r["ended"] for r in results.values()) - min(r["sent"] for r in results.values())
            tokens = sum(r["tokens"] for r in results.values())
            ttft = [r["chunks"][0] - r["sent"] for r in results.values() if r["chunks"]]
            itl = [b - a for r in results.values() for a, b in zip(r["chunks"], r["chunks"][1:])]
            engine_itl = [b - a for times in produced.values() for a, b in zip(times, times[1:])]
            answers = [results[i]["text"] for i in range(len(requests))]
            reference = reference or answers
            same = sum(a == b for a, b in zip(answers, reference))
            engine_ttft = [times[0] - submitted[r] for r, times in produced.items() if r in submitted]
            engine = (f"{percentile(engine_ttft, .5) * 1e3:>8.0f}ms{percentile(engine_itl, .5) * 1e3:>7.0f}ms"
                      f"{percentile(engine_itl, .99) * 1e3:>7.0f}ms" if engine_itl else f"{'—':>10}{'—':>9}{'—':>9}")
            memory = f"{kv_waste:>10.1%}{cached:>8.0%}" if kv_waste is not None else f"{'—':>10}{'—':>8}"
            print(f"{streams:>7} {entry:<16}{tokens / wall:>10.1f}{percentile(ttft, .5) * 1e3:>8.0f}ms"
                  f"{percentile(ttft, .99) * 1e3:>8.0f}ms{percentile(itl, .5) * 1e3:>7.0f}ms"
                  f"{percentile(itl, .99) * 1e3:>7.0f}ms{engine}{memory}  {same}/{len(answers)} equal the "
                  f"first entry's{note}", flush=True)


def serve_ours(entry: str, streams: int, args, workload, decoder, requests: list[dict], context):
    """One overdrive entry (`GenerationServer` in a thread of this process) under the load; its results, when the
    engine produced each request's tokens and when it took each request, its KV cache's empty share and its
    prefix-cache hit rate."""
    from overdrive.generate import SamplingParams
    from overdrive.generate.continuous import ContinuousGenerator
    from overdrive.serve.generation import GenerationServer, listening

    entry_, _, block = entry.partition(":b")
    name, _, budget = entry_.partition("/")
    name, nocache = name.removesuffix("-nocache"), name.endswith("-nocache")
    batch = 1 if name == "one-at-a-time" else streams
    chunk = {"max_prefill_tokens": int(budget)} if budget else {}
    gen = ContinuousGenerator(decoder, workload.tokenizer, max_batch_size=batch, compile=args.compile, **chunk,
                              prefix_caching=not nocache, **({"block_size": int(block or args.block_size)}
                                                             if block or args.block_size else {}),
                              scheduling="static" if name == "static" else "continuous",
                              defaults=SamplingParams(stop_token_ids=(workload.tokenizer.eos_token_id,)))
    sizes = sorted({min(1 << k, batch) for k in range(batch.bit_length() + 1)})
    for size in sizes:  # warm-up: the compiled shapes the load will meet
        gen.generate([workload.prompts[0]] * size, SamplingParams(max_new_tokens=args.max_new))
    produced: dict[int, list[float]] = {}  # request id -> when the engine produced each of its tokens
    submitted: dict[int, float] = {}  # request id -> when the engine took it (its thread, between steps)
    step, submit = gen.step, gen.submit

    def timed_step():
        events = step()
        now = time.perf_counter()
        for e in events:
            produced.setdefault(e.request_id, []).append(now)
        return events

    def timed_submit(*args, **kwargs):
        request_id = submit(*args, **kwargs)
        submitted[request_id] = time.perf_counter()
        return request_id

    def reset():
        gen.stats = type(gen.stats)()
        produced.clear()
        submitted.clear()

    gen.step, gen.submit = timed_step, timed_submit
    server = GenerationServer(gen, args.workload, max_waiting=10 * args.requests)
    with listening(server.app) as url:
        results = drive(url, requests, streams, args.think_ms, context, on_warm=reset)
    server.engine.stop()
    return results, produced, submitted, gen.stats.kv_waste, gen.stats.prefix_hit_rate

if __name__ == "__main__":
    main()
