"""`pydoc-lm`: a small Llama-architecture causal LM and its byte-level BPE tokenizer, both trained here on
CPython's own text, so that generation's accuracy claims are judged on a model with real weights and no
download.

The corpus: the standard library's docstrings (`python_docstring_sentences`, about 13,000 sentences) and
the language reference (`python_doc_sentences`, about 2,000); every 10th reference sentence is held out
(the prompts and the held-out perplexity), none of them trained on. The tokenizer: byte-level BPE
(Radford et al., 2019) with `VOCAB` tokens, trained on the training sentences. The model: a
`LlamaForCausalLM` of `SHAPE` (about 11 M parameters, embeddings tied), trained from seed `SEED` with
AdamW on windows of `WINDOW` tokens of the sentences joined by the end-of-text token, for `STEPS` steps
(minutes on 2 cores), once: the weights, tokenizer and held-out perplexity are kept in overdrive's cache
(`files.cache`), keyed by this module's source and the library versions.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from overdrive.files.cache import cached, versions
from overdrive.files.sentences import python_doc_sentences, python_docstring_sentences

SEED = 0
VOCAB = 4096
WINDOW = 128
BATCH = 16
STEPS = 500
LEARNING_RATE = 2e-3
HELD_OUT_EVERY = 10
EOS = "<|endoftext|>"
SHAPE = dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=6,
             num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True, rms_norm_eps=1e-5)


@dataclass
class PydocLM:
    """The trained model (eval mode, fp32, CPU), its tokenizer (a `PreTrainedTokenizerFast`), the held-out
    sentences, and the facts of its training: held-out perplexity, steps, seconds."""

    model: torch.nn.Module
    tokenizer: object
    held_out: list[str]
    facts: dict


def split() -> tuple[list[str], list[str]]:
    """(training sentences, held-out sentences): every `HELD_OUT_EVERY`-th reference sentence is held out."""
    reference = list(python_doc_sentences())
    held_out = reference[::HELD_OUT_EVERY]
    kept = set(held_out)
    return [s for s in reference if s not in kept] + list(python_docstring_sentences()), held_out


def _tokenizer(train: list[str]):
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(train, vocab_size=VOCAB, min_frequency=2, special_tokens=[EOS], show_progress=False)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS, pad_token=EOS, bos_token=EOS)


def _windows(tokenizer, texts: list[str]) -> torch.Tensor:
    """The texts' tokens joined by end-of-text, cut into rows of WINDOW + 1: int64 [N, WINDOW + 1]."""
    eos = tokenizer.convert_tokens_to_ids(EOS)
    stream: list[int] = []
    for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        stream += ids + [eos]
    rows = len(stream) // (WINDOW + 1)
    return torch.tensor(stream[: rows * (WINDOW + 1)]).view(rows, WINDOW + 1)


@torch.no_grad()
def perplexity(model, windows: torch.Tensor, batch_size: int = 32) -> float:
    """exp of the mean next-token cross-entropy over `windows` int64 [N, T + 1]."""
    total, count = 0.0, 0
    for first in range(0, len(windows), batch_size):
        rows = windows[first:first + batch_size]
        logits = model(input_ids=rows[:, :-1]).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1),
                                                 reduction="sum")
        total, count = total + float(loss), count + rows[:, 1:].numel()
    return math.exp(total / count)


def train(steps: int | None = None, *, log=None) -> PydocLM:
    """Trains the tokenizer and the model from scratch (seeded); `log(str)` gets progress lines."""
    import transformers

    steps = STEPS if steps is None else steps
    train_texts, held_out = split()
    tokenizer = _tokenizer(train_texts)
    data, held = _windows(tokenizer, train_texts), _windows(tokenizer, held_out)
    torch.manual_seed(SEED)
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.eos_token_id,
                                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id, **SHAPE)
    model = transformers.LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.1, betas=(0.9, 0.95))
    warm = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps))))
    g = torch.Generator().manual_seed(SEED)
    model.train()
    started = time.perf_counter()
    for step in range(steps):
        rows = data[torch.randint(0, len(data), (BATCH,), generator=g)]
        loss = model(input_ids=rows, labels=rows).loss  # WINDOW next-token predictions (HF shifts the labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if log and (step % 50 == 0 or step == steps - 1):
            log(f"pydoc-lm: step {step + 1}/{steps}, loss {loss.detach().item():.3f}, {time.perf_counter() - started:.0f} s")
    model.eval()
    facts = {"held_out_perplexity": perplexity(model, held), "train_perplexity_sample": perplexity(model, data[:64]),
             "steps": steps, "train_s": time.perf_counter() - started, "parameters": sum(p.numel() for p in model.parameters()),
             "train_tokens": int(data[:, :-1].numel()), "held_out_tokens": int(held[:, :-1].numel())}
    return PydocLM(model, tokenizer, held_out, facts)


def build_pydoc_lm(*, log=print) -> PydocLM:
    """The trained `pydoc-lm`, from the cache or trained now (once: minutes on 2 cores)."""
    import transformers

    key = {"code": hashlib.sha256(Path(__file__).read_bytes()).hexdigest(), "shape": SHAPE, "steps": STEPS,
           "recipe": [SEED, VOCAB, WINDOW, BATCH, LEARNING_RATE, HELD_OUT_EVERY],
           "versions": versions("torch", "transformers", "tokenizers"),
           "corpus": hashlib.sha256("\n".join(python_doc_sentences()).encode()).hexdigest()}

    def make(folder: Path) -> dict:
        if log:
            log(f"pydoc-lm: training the tokenizer and the model on CPython's text ({STEPS} steps, once; kept in the cache)")
        trained = train(STEPS, log=log)
        trained.model.save_pretrained(folder / "model")
        trained.tokenizer.save_pretrained(folder / "tokenizer")
        return trained.facts

    entry = cached("pydoc-lm", key, make)
    model = transformers.LlamaForCausalLM.from_pretrained(entry.folder / "model").eval()
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(entry.folder / "tokenizer")
    return PydocLM(model, tokenizer, split()[1], dict(entry.meta))


def build_tokenizer():
    """pydoc-lm's byte-level BPE tokenizer alone, as `train` makes it (the random-weight built-ins speak it): from
    the cache, or trained now (seconds)."""
    import transformers

    key = {"code": hashlib.sha256(Path(__file__).read_bytes()).hexdigest(), "recipe": [VOCAB, HELD_OUT_EVERY],
           "versions": versions("tokenizers", "transformers"),
           "corpus": hashlib.sha256("\n".join(python_doc_sentences()).encode()).hexdigest()}

    def make(folder: Path) -> dict:
        _tokenizer(split()[0]).save_pretrained(folder / "tokenizer")
        return {}

    entry = cached("pydoc-bpe", key, make)
    return transformers.PreTrainedTokenizerFast.from_pretrained(entry.folder / "tokenizer")


def facts_line(facts: dict) -> str:
    return (f"held-out perplexity {facts['held_out_perplexity']:.1f} over {facts['held_out_tokens']:,} tokens; "
            f"{facts['parameters'] / 1e6:.1f} M parameters, {facts['steps']} steps")


def main() -> None:  # pragma: no cover - `python -m overdrive.workloads.pydoc_lm`
    lm = build_pydoc_lm()
    print(facts_line(lm.facts))
    print(json.dumps(lm.facts, indent=1))


if __name__ == "__main__":
    main()
