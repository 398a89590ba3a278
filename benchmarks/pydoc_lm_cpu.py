"""pydoc-lm, the built-in LM of issue 32: its held-out perplexity, and overdrive's engine against Hugging Face
`generate` on it: greedy tokens for 64 held-out prompts (each sentence's first six words), each prompt alone and
in batches of 16 of mixed lengths, counted equal or not; a few continuations printed. Then weight-only int8
(`generate/quantize.py`) on every linear layer and on the layers its per-layer search keeps, judged by the
generation guard (`generate/fidelity.py`). Then speculative decoding by prompt lookup (`generate/speculative.py`)
against plain greedy decoding, each prompt alone (batch 1), overdrive's engine eager and compiled beside Hugging
Face `generate` with and without `prompt_lookup_num_tokens`: tokens/s, tokens equal to plain greedy, acceptance.

Trains pydoc-lm first when the cache does not hold it (about 11 minutes on 2 cores).

    .venv/bin/python benchmarks/pydoc_lm_cpu.py [--prompts 64] [--new-tokens 24] [--int8-kl 1e-3]
        [--sections equality,int8,speculative,kv-int8] [--spec-tokens 64] [--draft-tokens 4]
"""

from __future__ import annotations

import argparse
import time

from overdrive.generate import Decoder, Generator, PromptLookup, SamplingParams
from overdrive.workloads.pydoc_lm import build_pydoc_lm, facts_line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--int8-kl", type=float, default=1e-3, help="the per-layer searches' mean-KL budget, nats per token")
    parser.add_argument("--sections", default="equality,int8,speculative,kv-int8")
    parser.add_argument("--spec-tokens", type=int, default=64, help="new tokens per prompt in the speculative section")
    parser.add_argument("--draft-tokens", type=int, default=4, help="prompt lookup's draft tokens per verification")
    args = parser.parse_args()
    sections = set(args.sections.split(","))
    lm = build_pydoc_lm()
    print(facts_line(lm.facts))
    tok, hf = lm.tokenizer, lm.model
    hf.generation_config.pad_token_id = tok.eos_token_id
    hf.generation_config.eos_token_id = None  # no early stop on either side: every prompt runs its max tokens
    prompts = [" ".join(s.split()[:6]) for s in lm.held_out[:args.prompts]]
    generator = Generator(Decoder.from_hf(hf), tok, max_batch_size=16)
    if "speculative" in sections:
        speculative_section(lm, prompts, args)
    if "kv-int8" in sections:
        kv_int8_section(lm, generator, prompts, args)
    if "equality" not in sections:
        if "int8" in sections:
            int8_section(lm, generator, prompts, args)
        return
    started = time.perf_counter()
    reference = []
    for prompt in prompts:
        ids = tok(prompt, return_tensors="pt")
        out = hf.generate(**ids, max_new_tokens=args.new_tokens, do_sample=False)
        reference.append(out[0, ids["input_ids"].shape[1]:].tolist())
    hf_s = time.perf_counter() - started
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
    if "int8" in sections:
        int8_section(lm, generator, prompts, args)


def kv_int8_section(lm, reference, prompts: list[str], args) -> None:
    """The KV cache in int8 (a float32 scale per token and head) judged by the generation guard against the fp32
    cache: greedy tokens on the prompts (batches of 16), KL and held-out perplexity with the int8 cache, the batch
    probe; and the cache's bytes."""
    import torch

    from overdrive.generate import KVCache
    from overdrive.generate.fidelity import batch_invariance, judge_generation

    tok = lm.tokenizer
    ids = [tok(s)["input_ids"] for s in lm.held_out]
    held_out = [x for x in ids[args.prompts + 32:args.prompts + 160] if len(x) >= 2]
    prompt_ids = [tok(p)["input_ids"] for p in prompts]
    candidate = Generator(reference.model, tok, max_batch_size=16, cache_dtype=torch.int8)
    fid = judge_generation(reference, candidate, prompt_ids, max_new_tokens=args.new_tokens, held_out=held_out)
    probe = batch_invariance(candidate, prompt_ids[:16], max_new_tokens=args.new_tokens)
    c = reference.model.config
    sizes = {d: KVCache(c, 1, 1024, device="cpu", dtype=d).nbytes() for d in (torch.float32, torch.int8)}
    print(f"\nKV cache in int8 against fp32, {len(prompt_ids)} prompts × {args.new_tokens} greedy tokens, perplexity on "
          f"{len(held_out)} held-out sentences: {fid.diverged_beyond_ties} / {fid.diverged} prompts changed (beyond near "
          f"ties / all); mean KL {fid.mean_kl:.2e}, max {fid.max_kl:.2e}; perplexity {fid.perplexity_reference:.2f} → "
          f"{fid.perplexity:.2f} ({fid.perplexity_change:+.2%}); batch probe {len(probe.differ_beyond_ties)} / "
          f"{len(probe.differ)} of {probe.prompts} differ; KV bytes per 1,024 slots {sizes[torch.float32] / 2**20:.2f} MiB "
          f"→ {sizes[torch.int8] / 2**20:.2f} MiB", flush=True)


def speculative_section(lm, prompts: list[str], args) -> None:
    """Each prompt alone, greedy, --spec-tokens new tokens, no early stop; entries interleaved over 2 rounds (the
    faster round counts); a warm-up prompt first for each (compilation apart). Equality is against overdrive's plain
    eager greedy tokens (and Hugging Face's plain greedy ones against it)."""
    import torch

    tok, hf = lm.tokenizer, lm.model
    n = args.spec_tokens
    ids = [tok(p)["input_ids"] for p in prompts]
    decoder = Decoder.from_hf(hf)
    lookup = PromptLookup(num_tokens=args.draft_tokens)
    engines = {
        "overdrive, eager": Generator(decoder, tok),
        f"overdrive, eager, prompt lookup k={lookup.num_tokens}": Generator(decoder, tok, speculative=lookup),
        "overdrive, compiled decode step": Generator(decoder, tok, compile=True),
        f"overdrive, compiled, prompt lookup k={lookup.num_tokens}": Generator(decoder, tok, compile=True, speculative=lookup),
    }
    params = SamplingParams(max_new_tokens=n)

    def run_hf(lookup_tokens):
        out = []
        for x in ids:
            t = torch.tensor([x])
            extra = {"prompt_lookup_num_tokens": lookup_tokens} if lookup_tokens else {}
            y = hf.generate(input_ids=t, attention_mask=torch.ones_like(t), max_new_tokens=n, do_sample=False, **extra)
            out.append(y[0, len(x):].tolist())
        return out, None

    def run_ours(generator):
        out, drafted, kept = [], 0, 0
        for x in ids:
            out.append(generator.generate([x], params)[0].token_ids)
            drafted += sum(t.drafted for t in generator.timings)
            kept += sum(t.accepted for t in generator.timings)
        return out, (kept, drafted) if generator.speculative is not None else None

    entries = {"Hugging Face generate, eager": lambda: run_hf(0),
               f"Hugging Face generate, prompt lookup {lookup.num_tokens}": lambda: run_hf(lookup.num_tokens)}
    entries.update({name: (lambda g=g: run_ours(g)) for name, g in engines.items()})
    for name, g in engines.items():  # warm-up: compilation, the allocator
        g.generate([ids[0]], params)
    best: dict[str, float] = {}
    results = {}
    for _ in range(2):
        for name, fn in entries.items():
            started = time.perf_counter()
            results[name] = fn()
            best[name] = min(best.get(name, float("inf")), time.perf_counter() - started)
    plain = results["overdrive, eager"][0]
    base = best["Hugging Face generate, eager"]
    print(f"\nspeculative decoding by prompt lookup: {len(ids)} held-out prompts, each alone, {n} new tokens, greedy, fp32;"
          " the faster of 2 interleaved rounds")
    print("| entry | tokens/s | vs HF eager | prompts equal to plain greedy | drafts accepted |")
    print("|---|---:|---:|---:|---:|")
    for name, (out, acceptance) in results.items():
        rate = f"{acceptance[0]} / {acceptance[1]} ({acceptance[0] / max(acceptance[1], 1):.0%})" if acceptance else "—"
        print(f"| {name} | {len(ids) * n / best[name]:.1f} | {base / best[name]:.2f}× | "
              f"{sum(a == b for a, b in zip(out, plain))} / {len(ids)} | {rate} |", flush=True)


def int8_section(lm, reference, prompts: list[str], args) -> None:
    """Each low-precision form of `generate/quantize.py` judged by the generation guard: on every linear layer,
    then on the layers its per-layer search keeps within --int8-kl (its calibration: held-out sentences apart from
    the prompts and from the perplexity text); and the batch-invariance probe on the searched model."""
    from overdrive.generate.fidelity import batch_invariance, judge_generation
    from overdrive.generate.quantize import FORMS, copy_decoder, linear_names, quantize_linears, search_layers

    tok = lm.tokenizer
    ids = [tok(s)["input_ids"] for s in lm.held_out]
    calibration = [x for x in ids[args.prompts:args.prompts + 32] if len(x) >= 2]
    held_out = [x for x in ids[args.prompts + 32:args.prompts + 160] if len(x) >= 2]
    prompt_ids = [tok(p)["input_ids"] for p in prompts]
    every = linear_names(reference.model)
    print(f"\nlow-precision weights, judged on {len(prompt_ids)} prompts × {args.new_tokens} greedy tokens (batches of 16), "
          f"KL along the reference's path, perplexity on {len(held_out)} held-out sentences "
          f"({sum(map(len, held_out))} tokens); searches calibrate on {len(calibration)} other sentences")
    print("form | layers | greedy prompts changed (beyond near ties / all) | mean KL | max KL | perplexity (fp32 → form)"
          " | batch probe")
    for form in FORMS:
        started = time.perf_counter()
        searched, sensitivity, _ = search_layers(reference.model, calibration, max_mean_kl=args.int8_kl, form=form)
        search_s = time.perf_counter() - started
        worst = sorted(sensitivity, key=sensitivity.get)[-2:]
        for label, names in ((f"every linear ({len(every)})", every),
                             (f"searched ({len(searched)}; {search_s:.0f} s; most sensitive "
                              + ", ".join(f"{n} {sensitivity[n]:.1e}" for n in worst) + ")", searched)):
            model = copy_decoder(reference.model)
            quantize_linears(model, names, form=form)
            candidate = Generator(model, tok, max_batch_size=16)
            fid = judge_generation(reference, candidate, prompt_ids, max_new_tokens=args.new_tokens, held_out=held_out)
            probe = batch_invariance(candidate, prompt_ids[:16], max_new_tokens=args.new_tokens)
            print(f"  {form} | {label} | {fid.diverged_beyond_ties} / {fid.diverged} of {fid.prompts} | {fid.mean_kl:.2e} | "
                  f"{fid.max_kl:.2e} | {fid.perplexity_reference:.2f} → {fid.perplexity:.2f} ({fid.perplexity_change:+.2%}) | "
                  f"{len(probe.differ_beyond_ties)} / {len(probe.differ)} of {probe.prompts} differ", flush=True)

if __name__ == "__main__":
    main()
