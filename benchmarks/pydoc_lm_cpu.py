"""pydoc-lm, the built-in LM of issue 32: its held-out perplexity, and overdrive's engine against Hugging Face
`generate` on it: greedy tokens for 64 held-out prompts (each sentence's first six words), each prompt alone and
in batches of 16 of mixed lengths, counted equal or not; a few continuations printed.

Trains pydoc-lm first when the cache does not hold it (about 11 minutes on 2 cores).

    .venv/bin/python benchmarks/pydoc_lm_cpu.py [--prompts 64] [--new-tokens 24]
"""

from __future__ import annotations

import argparse
import time

from overdrive.generate import Decoder, Generator, SamplingParams
from overdrive.workloads.pydoc_lm import build_pydoc_lm, facts_line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=24)
    args = parser.parse_args()
    lm = build_pydoc_lm()
    print(facts_line(lm.facts))
    tok, hf = lm.tokenizer, lm.model
    hf.generation_config.pad_token_id = tok.eos_token_id
    hf.generation_config.eos_token_id = None  # no early stop on either side: every prompt runs its max tokens
    prompts = [" ".join(s.split()[:6]) for s in lm.held_out[:args.prompts]]
    started = time.perf_counter()
    reference = []
    for prompt in prompts:
        ids = tok(prompt, return_tensors="pt")
        out = hf.generate(**ids, max_new_tokens=args.new_tokens, do_sample=False)
        reference.append(out[0, ids["input_ids"].shape[1]:].tolist())
    hf_s = time.perf_counter() - started
    generator = Generator(Decoder.from_hf(hf), tok, max_batch_size=16)
    params = SamplingParams(max_new_tokens=args.new_tokens)
    started = time.perf_counter()
    alone = [generator.generate([p], params)[0].token_ids for p in prompts]
    alone_s = time.perf_counter() - started
    started = time.perf_counter()
    batched = generator.generate(prompts, params)
    batched_s = time.perf_counter() - started
    lengths = [len(tok(p)["input_ids"]) for p in prompts]
    print(f"{len(prompts)} held-out prompts of {min(lengths)}-{max(lengths)} tokens, {args.new_tokens} new, greedy, fp32")
    print(f"Hugging Face generate, one at a time: {hf_s:.1f} s")
    print(f"overdrive, one at a time: {alone_s:.1f} s; equal to generate: {sum(a == r for a, r in zip(alone, reference))}"
          f" / {len(prompts)}")
    print(f"overdrive, batches of 16: {batched_s:.1f} s; equal to generate: "
          f"{sum(c.token_ids == r for c, r in zip(batched, reference))} / {len(prompts)}")
    for prompt, completion in list(zip(prompts, batched))[:4]:
        print(f"  {prompt!r} → {completion.text!r}")


if __name__ == "__main__":
    main()
