"""A draft model derived from the target, for speculative decoding: layers dropped, then a short distillation.

Speculative decoding (Leviathan et al., 2023; Chen et al., 2023) needs a draft that guesses the target's next
tokens at a fraction of its cost. Rather than ask the user for a second model of the same vocabulary, overdrive
derives one from the target as structured pruning does (`techniques/pruning`): it keeps a few of the target's
decoder layers, evenly spaced, the first and the last among them (`draft_layers`), with the target's embeddings,
final norm and LM head (the layer-skipping drafts of Draft & Verify, Zhang et al., 2023, and LayerSkip, Elhoushi et
al., 2024), then recovers what the dropped layers did by distillation toward the target: the draft's next-token
distribution is trained to the target's (the KL divergence from the target's softmax, Hinton et al., 2015) on text
apart from the prompts the figures are timed on, as pruning's recovery loop distils a pruned model toward the
unpruned one.

The draft never decides a token: the target verifies every guess (`engine.Generator`, `speculative.verify`), so
the tokens are the target's own greedy ones, or for sampled requests distributed as the target's sampling
(rejection sampling). A better draft only raises the share of guesses kept, and with it the speed.

The distilled weights are kept in overdrive's cache (`files.cache`), keyed by the target's weights, the layers
kept, the steps, the texts and this module's source: `bench`, `run` and `serve` of a plan rebuild the same draft
without training it again (or train it again, deterministically, where the cache is gone).
"""

from __future__ import annotations

import copy
import hashlib
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

SEED = 0
WINDOW = 128
BATCH = 8
LEARNING_RATE = 1e-3
DEFAULT_STEPS = 100


def draft_layers(num_layers: int, keep: int | None = None) -> list[int]:
    """The target's layers a draft keeps: `keep` of them (default: a quarter, at least 1, rounded up), evenly
    spaced from the first to the last."""
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"the target's layer count is a positive integer, got {num_layers!r}")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int)):
        raise ValueError(f"a draft keeps a whole number of layers, got {keep!r}")
    keep = max(1, math.ceil(num_layers / 4)) if keep is None else keep
    if not 1 <= keep <= num_layers:
        raise ValueError(f"a draft keeps 1 to {num_layers} of the target's layers, not {keep}")
    if keep == 1:
        return [0]
    return sorted({round(i * (num_layers - 1) / (keep - 1)) for i in range(keep)})


def _layer_list(hf_model: nn.Module) -> tuple[nn.Module, str, str]:
    """(the module holding the decoder layers, the ModuleList's attribute, the config's layer-count name)."""
    kind = getattr(hf_model.config, "model_type", None)
    if kind == "gpt2":
        return hf_model.transformer, "h", "n_layer"
    return hf_model.model, "layers", "num_hidden_layers"


def derive(hf_model: nn.Module, layers: Sequence[int]) -> nn.Module:
    """A copy of the Hugging Face causal LM `hf_model` with only `layers` of its decoder layers (in order), its
    embeddings, final norm and LM head kept: the undistilled draft. The target is left as it was.

    Raises:
        ValueError: not a causal LM of `decoder.FAMILIES`, layer indices out of range or repeated, or a model whose
            layers depend on their index (GPT-2 with `scale_attn_by_inverse_layer_idx`).
    """
    from overdrive.generate.decoder import FAMILIES

    config = getattr(hf_model, "config", None)
    if getattr(config, "model_type", None) not in FAMILIES or not hasattr(hf_model, "generation_config"):
        raise ValueError(f"a draft is derived from a Hugging Face causal LM of the {', '.join(FAMILIES)} families "
                         f"(e.g. LlamaForCausalLM); got {type(hf_model).__name__}")
    if getattr(config, "scale_attn_by_inverse_layer_idx", False):
        raise ValueError("a GPT-2 that scales attention by the layer's index cannot drop layers")
    holder, attribute, count_name = _layer_list(hf_model)
    total = len(getattr(holder, attribute))
    layers = list(layers)
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in layers) or not layers or \
            sorted(set(layers)) != layers or layers[0] < 0 or layers[-1] >= total:
        raise ValueError(f"a draft's layers are increasing indices in [0, {total}), got {layers}")
    draft = copy.deepcopy(hf_model)
    draft_holder, _, _ = _layer_list(draft)
    kept = nn.ModuleList(getattr(draft_holder, attribute)[i] for i in layers)
    setattr(draft_holder, attribute, kept)
    setattr(draft.config, count_name, len(layers))
    for new, block in enumerate(kept):
        for module in block.modules():
            if hasattr(module, "layer_idx"):
                module.layer_idx = new  # Hugging Face indexes its cache by it
    layer_types = getattr(draft.config, "layer_types", None)
    if isinstance(layer_types, list) and len(layer_types) == total:
        draft.config.layer_types = [layer_types[i] for i in layers]
    return draft.eval()


def distillation_texts(tokenizer, limit: int = 4000) -> list[list[int]]:
    """Real text for distilling a draft, as token ids of `tokenizer`: the first `limit` sentences of the standard
    library's docstrings (`files.sentences`), which every machine has and none of the built-in workloads' prompts
    come from (theirs are the language reference's held-out sentences). A draft learns from them to guess its
    target's next tokens; what it guesses wrong only costs speed, since the target verifies every guess."""
    from overdrive.files.sentences import python_docstring_sentences

    sentences = list(python_docstring_sentences())[:limit]
    return [ids for ids in tokenizer(sentences, add_special_tokens=False)["input_ids"] if ids]


def windows(texts: Sequence[Sequence[int]], eos: int | None, window: int = WINDOW) -> torch.Tensor:
    """Token-id texts joined (by `eos` where there is one) and cut into rows of `window`: int64 [N, window]; the
    last, shorter piece is dropped unless it is the only one."""
    stream: list[int] = []
    for ids in texts:
        if isinstance(ids, str) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError(f"distillation texts are lists of token ids (a tokenizer's input_ids), got {ids!r:.60}")
        stream += list(ids) + ([eos] if eos is not None else [])
    if not stream:
        raise ValueError("no text to distil a draft on")
    rows = len(stream) // window
    if rows == 0:
        return torch.tensor([stream])
    return torch.tensor(stream[: rows * window]).view(rows, window)


def distill(draft: nn.Module, target: nn.Module, rows: torch.Tensor, *, steps: int, seed: int = SEED,
            learning_rate: float = LEARNING_RATE, batch_size: int = BATCH,
            log: Callable[[str], None] | None = None) -> dict:
    """Trains `draft` (in place) toward `target`'s next-token distributions on `rows` int64 [N, T] for `steps`
    steps: the mean over positions of KL(target ‖ draft) at temperature 1, AdamW with a warm-up and a cosine
    schedule, seeded (the same rows and steps give the same draft).

    Returns:
        {"steps", "kl_before", "kl_after": the mean KL on a fixed batch of the rows, nats per token, "seconds"}.
    """
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    probe = rows[:batch_size]
    kl_before = _kl(draft, target, probe)
    optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=learning_rate,
                                  weight_decay=0.0, betas=(0.9, 0.95))
    warm = max(1, steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / max(1, steps)))))
    draft.train()
    started = time.perf_counter()
    for step in range(steps):
        loss = _step(draft, target, rows[torch.randint(0, len(rows), (min(batch_size, len(rows)),), generator=g)])
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if log and (step % 25 == 0 or step == steps - 1):
            log(f"draft: step {step + 1}/{steps}, KL {loss:.3f}, {time.perf_counter() - started:.0f} s")
    draft.eval()
    return {"steps": steps, "kl_before": kl_before, "kl_after": _kl(draft, target, probe),
            "seconds": time.perf_counter() - started}


def _step(draft: nn.Module, target: nn.Module, batch: torch.Tensor) -> float:
    """One distillation step's forward and backward (gradients left in `draft`); returns its loss."""
    with torch.no_grad():
        teacher = torch.log_softmax(target(input_ids=batch, use_cache=False).logits.float(), dim=-1)
    student = torch.log_softmax(draft(input_ids=batch, use_cache=False).logits.float(), dim=-1)
    loss = nn.functional.kl_div(student, teacher, log_target=True, reduction="none").sum(-1).mean()
    loss.backward()
    return float(loss.detach())


def seconds_per_step(hf_model: nn.Module, layers: Sequence[int], texts: Sequence[Sequence[int]],
                     eos: int | None = None) -> float:
    """What one distillation step of a draft keeping `layers` takes here, seconds (one step timed on a copy,
    after one untimed): for choosing the steps a time budget allows."""
    draft, rows = derive(hf_model, layers).train(), _rows(hf_model, texts, eos)[:BATCH]
    for timed in (False, True):
        started = time.perf_counter()
        _step(draft, hf_model, rows)
        draft.zero_grad(set_to_none=True)
    return time.perf_counter() - started


@torch.no_grad()
def _kl(draft: nn.Module, target: nn.Module, rows: torch.Tensor) -> float:
    teacher = torch.log_softmax(target(input_ids=rows, use_cache=False).logits.float(), dim=-1)
    student = torch.log_softmax(draft(input_ids=rows, use_cache=False).logits.float(), dim=-1)
    return float(nn.functional.kl_div(student, teacher, log_target=True, reduction="none").sum(-1).mean())


def _window(hf_model: nn.Module) -> int:
    """Distillation rows: `WINDOW` tokens, or the model's whole context where it is shorter."""
    config = hf_model.config
    context = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    return min(WINDOW, context) if context else WINDOW


def _rows(hf_model: nn.Module, texts: Sequence[Sequence[int]], eos: int | None) -> torch.Tensor:
    """The distillation rows of `texts` for `hf_model`. Raises ValueError: token ids outside its vocabulary."""
    rows = windows(texts, eos, _window(hf_model))
    vocab = hf_model.config.vocab_size
    if rows.numel() and (int(rows.max()) >= vocab or int(rows.min()) < 0):
        raise ValueError(f"the distillation texts hold token ids up to {int(rows.max())}, outside the model's vocabulary "
                         f"of {vocab}: they are not the model's tokenizer's")
    return rows


def build_draft(hf_model: nn.Module, layers: Sequence[int], texts: Sequence[Sequence[int]], *, steps: int,
                eos: int | None = None, log: Callable[[str], None] | None = None) -> tuple[nn.Module, dict]:
    """The distilled draft of `hf_model` keeping `layers`, from overdrive's cache or made now (`derive`, then
    `distill` for `steps` on `texts`: token-id texts apart from the timed prompts; 0 steps: not distilled).

    Returns:
        (the draft: a Hugging Face model like the target, eval mode, fp32, on the CPU; its facts: "layers",
        "steps", "kl_before", "kl_after", "seconds", "parameters", "cached").
    """
    from overdrive.core.digest import weights_fingerprint
    from overdrive.files.cache import cached, versions

    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"a draft's distillation steps are an integer ≥ 0, got {steps!r}")
    layers = list(layers)
    rows = _rows(hf_model, texts, eos)
    key = {"code": hashlib.sha256(Path(__file__).read_bytes()).hexdigest(), "target": weights_fingerprint(hf_model),
           "layers": layers, "steps": steps, "recipe": [SEED, WINDOW, BATCH, LEARNING_RATE],
           "texts": hashlib.sha256(rows.numpy().tobytes()).hexdigest(), "versions": versions("torch", "transformers")}
    made: dict = {}

    def make(folder: Path) -> dict:
        draft = derive(hf_model, layers)
        facts = distill(draft, hf_model, rows, steps=steps, log=log) if steps else \
            {"steps": 0, "kl_before": _kl(draft, hf_model, rows[:BATCH]), "kl_after": None, "seconds": 0.0}
        facts.update(layers=layers, parameters=sum(p.numel() for p in draft.parameters()))
        torch.save(draft.state_dict(), folder / "draft.pt")
        made["draft"] = draft
        return facts

    entry = cached("draft", key, make)
    facts = {**entry.meta, "cached": "draft" not in made}
    if "draft" in made:
        return made["draft"], facts
    draft = derive(hf_model, layers)
    draft.load_state_dict(torch.load(entry.folder / "draft.pt", map_location="cpu", weights_only=True))
    return draft.eval(), facts
