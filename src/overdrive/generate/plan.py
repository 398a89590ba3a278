"""A generation plan: the steps `optimize` kept for a causal LM, saved as JSON, rebuilt into a `Generator` by
`bench`, `run` and `overdrive.load`.

Steps, each a dict with its "name" and settings, applied in this order whatever order they are listed in:
`bf16` (the decoder's weights and activations in bfloat16), one weight form (`int8-weight`, `int8-rowwise`,
`fp16-weight`: the "layers" it holds, `generate/quantize.py`), `kv-int8` (the KV cache in int8),
`compile-decode` (torch.compile of the decode step), and at most one speculative step: `prompt-lookup` ("num_tokens"
drafted from the prompt) or `draft-model` ("num_tokens" drafted by a draft derived from the target: the target's
"layers" it keeps, distilled for "steps" on CPython's text, `generate/draft.py`; rebuilt from overdrive's cache, or
distilled again, deterministically, where the cache lacks it).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from overdrive.core.errors import ConfigError, arg
from overdrive.generate.quantize import FORMS

KIND = "generation"
SPECULATIVE = ("prompt-lookup", "draft-model")  # verify one sequence at a time: no continuous batching
STEP_NAMES = ("bf16", *FORMS, "kv-int8", "compile-decode", *SPECULATIVE)
_SETTINGS = {"prompt-lookup": {"name", "num_tokens"}, "draft-model": {"name", "num_tokens", "layers", "steps"}}


@dataclass
class GenerationPlan:
    """What `optimize` chose for a causal LM.

    Attributes:
        workload: the generation workload's name (`generate.workload`).
        device: "cpu" or "cuda[:N]".
        batch_size: sequences decoded together (the batch the plan was chosen at).
        max_new_tokens: new tokens per sequence in the timings.
        steps: the kept steps (module docstring).
        measured: the plan's figures against the baseline (tokens/s, the gain and its interval, the guard's).
    """

    workload: str
    device: str
    batch_size: int
    max_new_tokens: int
    steps: list[dict] = field(default_factory=list)
    measured: dict = field(default_factory=dict)
    kind: str = KIND

    @property
    def names(self) -> list[str]:
        return [s["name"] for s in self.steps]

    def to_dict(self) -> dict:
        return asdict(self)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def from_dict(cls, data: dict) -> GenerationPlan:
        """Raises: ConfigError for a plan that is not a generation plan or names an unknown step."""
        if data.get("kind") != KIND:
            raise ConfigError(f"not a generation plan (kind {data.get('kind')!r})")
        check_steps(data.get("steps", []))
        for name in ("batch_size", "max_new_tokens"):
            value = data.get(name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"a generation plan's {name} is a positive integer, got {value!r}")
        fields = {k: data[k] for k in ("workload", "device", "batch_size", "max_new_tokens", "steps", "measured") if k in data}
        return cls(**fields)

    @classmethod
    def load(cls, path: str | Path) -> GenerationPlan:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"{arg('plan', str(path))}: no such file")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{arg('plan', str(path))} is not JSON: {exc}") from exc
        return cls.from_dict(data)


def is_generation_plan(path: str | Path) -> bool:
    """Whether the JSON file at `path` is a generation plan (False for anything unreadable: its own loader says why)."""
    try:
        return json.loads(Path(path).read_text()).get("kind") == KIND
    except (OSError, ValueError, AttributeError):
        return False


def check_steps(steps) -> None:
    """Raises ConfigError (a ValueError) for steps that are not a list of {"name": one of `STEP_NAMES`, ...} with at
    most one weight form, a form without its "layers" list, or a setting a step does not take."""
    if not isinstance(steps, list) or not all(isinstance(s, dict) for s in steps):
        raise ConfigError(f"a generation plan's steps are a list of objects with a \"name\", got {steps!r:.120}")
    unknown = [s.get("name") for s in steps if s.get("name") not in STEP_NAMES]
    if unknown:
        raise ConfigError(f"the plan names unknown generation steps {unknown}; known: {', '.join(STEP_NAMES)}")
    forms = [s["name"] for s in steps if s["name"] in FORMS]
    if len(forms) > 1:
        raise ConfigError(f"a plan holds one weight form, this one holds {forms}")
    drafters = [s["name"] for s in steps if s["name"] in SPECULATIVE]
    if len(drafters) > 1:
        raise ConfigError(f"a plan holds one speculative step, this one holds {drafters}")
    for step in steps:
        allowed = {"name", "layers"} if step["name"] in FORMS else _SETTINGS.get(step["name"], {"name"})
        extra = sorted(set(step) - allowed)
        if extra:
            raise ConfigError(f"the step {step['name']!r} takes no {extra}")
        if step["name"] in FORMS and not isinstance(step.get("layers"), list):
            raise ConfigError(f"the step {step['name']!r} needs the list of its \"layers\"")
        if step["name"] == "draft-model":
            layers, count = step.get("layers"), step.get("steps")
            if not (isinstance(layers, list) and layers and all(isinstance(i, int) and not isinstance(i, bool) for i in layers)):
                raise ConfigError(f"the step 'draft-model' needs the target's \"layers\" it keeps (integers), got {layers!r}")
            if not isinstance(count, int) or isinstance(count, bool) or count < 0:
                raise ConfigError(f"the step 'draft-model' needs its distillation \"steps\" (an integer ≥ 0), got {count!r}")


def build_generator(hf_model, tokenizer, steps: list[dict], *, device: str | torch.device = "cpu",
                    max_batch_size: int = 16, max_new_tokens: int | None = None, continuous: bool = False):
    """A `Generator` for `hf_model` (a Hugging Face causal LM that `Decoder.from_hf` takes) with `steps` applied
    (the module docstring). The Hugging Face model is left as it was. A `generate` call without sampling params is
    greedy, ends at the tokenizer's end-of-text token (as Hugging Face's `generate` ends) and at `max_new_tokens`
    (default: `SamplingParams`'s). With `continuous`, a `ContinuousGenerator` (continuous batching over a paged KV
    cache) of up to `max_batch_size` sequences.

    Raises:
        ValueError: a model `Decoder.from_hf` does not take, steps `check_steps` refuses (ConfigError), or
            `continuous` with a speculative step (its drafts are verified one sequence at a time), a draft's layers
            outside the model's; KeyError: a weight form naming layers the model lacks.
    """
    from overdrive.generate import Decoder, Generator, PromptLookup, SamplingParams
    from overdrive.generate.continuous import ContinuousGenerator
    from overdrive.generate.quantize import quantize_linears

    check_steps(steps)
    by_name = {s["name"]: s for s in steps}
    speculative = next((by_name[n] for n in SPECULATIVE if n in by_name), None)
    if continuous and speculative:
        raise ConfigError(f"{speculative['name']} verifies one sequence at a time: it does not batch continuously")
    decoder = Decoder.from_hf(hf_model).to(device)
    if "bf16" in by_name:
        decoder = decoder.to(torch.bfloat16)
        decoder.inv_freq = decoder.inv_freq.float()
    for form in FORMS:
        if form in by_name:
            quantize_linears(decoder, by_name[form]["layers"], form=form)
    drafter = None
    if speculative and speculative["name"] == "prompt-lookup":
        drafter = PromptLookup(num_tokens=speculative.get("num_tokens", 4))
    elif speculative:
        drafter = _draft_model(hf_model, tokenizer, speculative, like=decoder)
    eos = getattr(tokenizer, "eos_token_id", None)
    defaults = SamplingParams(**({"max_new_tokens": max_new_tokens} if max_new_tokens else {}),
                              stop_token_ids=(eos,) if isinstance(eos, int) else ()) if max_new_tokens else None
    settings = dict(max_batch_size=max_batch_size, defaults=defaults, compile="compile-decode" in by_name,
                    cache_dtype=torch.int8 if "kv-int8" in by_name else None)
    if continuous:
        return ContinuousGenerator(decoder, tokenizer, **settings)
    return Generator(decoder, tokenizer, **settings, speculative=drafter)


def _draft_model(hf_model, tokenizer, step: dict, *, like: torch.nn.Module, log=None):
    """The `DraftModel` of a "draft-model" step: the draft `generate.draft.build_draft` gives (cached), as a decoder
    on the target decoder `like`'s device and in its dtype."""
    from overdrive.generate import Decoder, DraftModel
    from overdrive.generate.draft import build_draft, distillation_texts

    eos = getattr(tokenizer, "eos_token_id", None)
    draft, facts = build_draft(hf_model, step["layers"], distillation_texts(tokenizer), steps=step["steps"],
                               eos=eos if isinstance(eos, int) else None, log=log)
    reference = next(like.parameters())
    decoder = Decoder.from_hf(draft).to(device=reference.device, dtype=reference.dtype)
    decoder.inv_freq = decoder.inv_freq.float()
    return DraftModel(decoder, num_tokens=step.get("num_tokens", 4), layers=list(step["layers"]), facts=facts)
