"""Mixed precision searched per layer: `mixed-int8` (CPU and CUDA) and `mixed-fp8` (CUDA, compute
capability ≥ 8.9).

The layers that carry the error stay in fp32; the rest run in low precision (`quantized_linear`:
int8 or fp8, activations quantised per row, so a row's answer never depends on its batch-mates).
Which layers is the search's (`sensitivity.search`, on the workload's training rows), unless the
config names them: `optimize` writes the chosen layers into plan.json (`resolve`), so `bench`,
`serve`, `run` and `export` rebuild the same model without searching again.

The model is then compiled with Inductor on its first call (`CompiledOnFirstCall`): eager, the
separate quantisation passes make int8 slower than fp32 on a CPU, and compiled they are fused.
A `compile` step cannot follow it (`includes`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import pickle
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from overdrive.core.workload import Workload
from overdrive.techniques.graph_programs import CONV_OPS, LINEAR_OPS, missing_layers_reason
from overdrive.techniques.precision import pt2e_static
from overdrive.techniques.precision.quantized_layers import describe_layer, fp8_reason, layer_reason, quantize_layers, torchao_available
from overdrive.techniques.precision.sensitivity import (
    Candidates,
    LayerChoice,
    SearchResult,
    SwappedLayers,
    calibration_batches,
    search,
)
from overdrive.techniques.registry import ForwardWrapper, Stage, Technique, TechniqueConfig, register
from overdrive.techniques.runtime.torch_compile import default_dynamic

CALIBRATION_ROWS = 128
# The search aims at 1 − (1 − floor) × SEARCH_MARGIN on the calibration rows, so that the floor still
# holds on the evaluation rows, which the tuner judges next (0.9975 for the default floor 0.99). Measured on
# MiniLM: the whole-model figure was 0.9962 on 128 calibration rows and 0.9899 on the 512 evaluation rows.
SEARCH_MARGIN = 0.25
_CACHE_SIZE = 64  # search results are small (names and figures), and a re-search could choose other layers
_CACHE: OrderedDict[tuple, SearchResult] = OrderedDict()
_COMPILE_LOCK = threading.Lock()


@dataclass(frozen=True, kw_only=True)
class MixedPrecisionConfig(TechniqueConfig):
    """Fields of a searched precision step.

    Attributes:
        layers: module paths of the nn.Linear / nn.Conv2d layers in low precision; None: search (the tuner's
            case), and `optimize` writes the search's answer here in plan.json.
        min_fidelity: the floor the search keeps on the calibration rows, with its margin; None: the
            guard's `min_fidelity` (0.99 unless given).
        calibration_rows: training rows the search measures on.
        compile: compile the model with Inductor on its first call (False: eager, slower on CPU).
    """

    layers: tuple[str, ...] | None = None
    min_fidelity: float | None = None
    calibration_rows: int = CALIBRATION_ROWS
    compile: bool = True

    def __post_init__(self):
        if self.layers is not None:
            if isinstance(self.layers, str) or not all(isinstance(n, str) and n for n in self.layers):
                raise ValueError(f"{type(self).__name__}.layers must be a list of module paths, not {self.layers!r}")
            if not self.layers or len(set(self.layers)) != len(self.layers):
                raise ValueError(f"{type(self).__name__}.layers must name at least one layer, each once, not {list(self.layers)!r}")
            object.__setattr__(self, "layers", tuple(self.layers))
        if self.min_fidelity is not None and not 0.0 <= self.min_fidelity <= 1.0:
            raise ValueError(f"{type(self).__name__}.min_fidelity must be in [0, 1], not {self.min_fidelity!r}")
        if not isinstance(self.calibration_rows, int) or self.calibration_rows < 1:
            raise ValueError(f"{type(self).__name__}.calibration_rows must be a positive integer, not {self.calibration_rows!r}")
        if not isinstance(self.compile, bool):
            raise ValueError(f"{type(self).__name__}.compile must be true or false, not {self.compile!r}")

    def to_dict(self) -> dict[str, Any]:
        data = super().to_dict()
        if self.layers is not None:
            data["layers"] = list(self.layers)
        return data


@dataclass(frozen=True, kw_only=True)
class MixedInt8Config(MixedPrecisionConfig):
    name: ClassVar[str] = "mixed-int8"


@dataclass(frozen=True, kw_only=True)
class MixedFp8Config(MixedPrecisionConfig):
    name: ClassVar[str] = "mixed-fp8"


@dataclass(frozen=True, kw_only=True)
class MixedInt8StaticConfig(MixedPrecisionConfig):
    """MixedPrecisionConfig, and `checkpoint`: the quantised program (`torch.export.save`) `optimize` writes next to
    the plan; when set, `apply` loads it instead of calibrating again, so the rebuilt model has the measured scales."""
    name: ClassVar[str] = "mixed-int8-static"

    checkpoint: str | None = None


class CompiledOnFirstCall(ForwardWrapper):
    """Compiles `inner` with Inductor at its first call, after every later plan step changed it.
    With `freezing`, Inductor treats the weights as constants (what turns PT2E's quantize / dequantize
    pairs into int8 kernels); every call runs under that setting, recompilations included."""

    def __init__(self, inner: nn.Module, *, dynamic: bool | None, freezing: bool = False):
        super().__init__(inner)
        self.dynamic, self.freezing = dynamic, freezing
        self.__dict__["_compiled"] = None  # not a submodule: its parameters are inner's
        self.__dict__["_shapes"] = set()  # input shapes called before (with freezing: each compiled its graph)

    def forward(self, *args):
        compiled = self.__dict__["_compiled"]
        if compiled is None:
            with _COMPILE_LOCK:
                if self.__dict__["_compiled"] is None:
                    self.__dict__["_compiled"] = torch.compile(self.inner, backend="inductor", dynamic=self.dynamic)
                compiled = self.__dict__["_compiled"]
        if not self.freezing:
            return compiled(*args)
        import torch._inductor.config as inductor_config

        shapes = tuple((a.shape, a.dtype, a.device) if isinstance(a, torch.Tensor) else type(a) for a in args)
        if shapes in self.__dict__["_shapes"]:
            with inductor_config.patch(freezing=True):
                return compiled(*args)
        # A new shape compiles a graph (PT2E's path compiles one per batch size): Inductor's int8 lowerings warn
        # about their own code there (`pt2e_static.NOISE`), which is no news to the user. Under the lock, so that
        # the warning filters of two threads' first calls do not interleave.
        with _COMPILE_LOCK, pt2e_static.quiet(), inductor_config.patch(freezing=True):
            out = compiled(*args)
        self.__dict__["_shapes"].add(shapes)
        return out


def rows_fingerprint(rows: list[Any]) -> str:
    """A digest of the calibration rows (token lists, strings, tensors): equal rows, equal digest."""
    try:
        return hashlib.sha256(pickle.dumps(rows, protocol=4)).hexdigest()
    except Exception:  # noqa: BLE001 - rows that do not pickle: no reuse across row objects
        return f"id:{id(rows)}"


class MixedPrecision(Technique):
    """Base of the searched precision techniques: subclasses say which layers, how a candidate is built
    (`candidates`) and how the final model is (`lower`)."""
    setup_cost = "search"  # `tuning.budget`: what building it costs before its first timed pass

    scheme: ClassVar[str]
    form: ClassVar[str]  # how activations are quantised, for the report
    freezing: ClassVar[bool] = False  # compile with Inductor's freezing (PT2E)
    stage = Stage.PRECISION
    lossless = False
    group = "precision"
    rewrites_modules = True
    layer_types: ClassVar[tuple[type[nn.Module], ...]] = (nn.Linear,)

    # -- what subclasses provide -----------------------------------------------------------------

    def layer_reason(self, layer: nn.Module, device: torch.device) -> str | None:
        return layer_reason(layer, self.scheme, device)

    def candidates(self, model: nn.Module, names: list[str], batches, device: torch.device,
                   workload: Workload) -> tuple[nn.Module, Candidates]:
        """(the unchanged model the search compares with, the candidates)."""
        return model, SwappedLayers(model, names, self.scheme, device, batches[0])

    def lower(self, model: nn.Module, layers: list[str], workload: Workload, device: torch.device,
              config: MixedPrecisionConfig) -> nn.Module:
        return quantize_layers(model, layers, self.scheme, device)

    # -- shared ----------------------------------------------------------------------------------

    def compile_dynamic(self, workload: Workload) -> bool | None:
        return default_dynamic(workload)

    def layers_of(self, model: nn.Module) -> list[str]:
        """Paths of the plain layers of the kinds this technique switches (subclasses may change forward: left alone)."""
        return [name for name, module in model.named_modules() if isinstance(module, self.layer_types) and name]

    def includes(self, config: TechniqueConfig) -> tuple[str, ...]:
        return ("compile",) if config.compile else ()

    def applicability(self, workload: Workload, device: torch.device) -> str | None:
        if not self.layers_of(workload.model):
            kinds = " or ".join(f"nn.{t.__name__}" for t in self.layer_types)
            ops = LINEAR_OPS + (CONV_OPS if nn.Conv2d in self.layer_types else ())
            return missing_layers_reason(workload.model, layers=kinds, ops=ops,
                                         rewrites=f"{self.name} switches {kinds} layers to {self.scheme}")
        return None

    def needs_rows(self, config: TechniqueConfig | None) -> bool:
        """Whether building needs training rows: to search (a plan that names its layers needs none)."""
        return config is None or config.layers is None

    def unsupported_reason(self, workload: Workload, device: torch.device,
                           config: TechniqueConfig | None = None) -> str | None:
        reason = super().unsupported_reason(workload, device, config)
        if reason is None and not workload.train_samples and self.needs_rows(config):
            return (f"not applicable: {self.name} calibrates on the workload's training rows, and it has none "
                    "(pass --data, or an example, with 100+ rows: a fifth is kept apart for calibration)")
        return reason

    def for_guard(self, config: MixedPrecisionConfig, guard) -> MixedPrecisionConfig:
        if config.layers is None and config.min_fidelity is None:
            return dataclasses.replace(config, min_fidelity=guard.min_fidelity)
        return config

    def searched(self, model: nn.Module, config: MixedPrecisionConfig, workload: Workload,
                 device: torch.device) -> SearchResult:
        """The search's answer for this model (in-process cache: the tuner builds a candidate several times)."""
        from overdrive.techniques.pruning.recovery import fingerprint

        rows = list(workload.train_samples or [])[:config.calibration_rows]
        key = (self.name, workload.name, str(device), fingerprint(model), rows_fingerprint(rows),
               dataclasses.replace(config, compile=True))
        if key in _CACHE:
            _CACHE.move_to_end(key)
            return _CACHE[key]
        def run_search(folder=None) -> dict:
            batches = calibration_batches(workload, rows, device)
            modules = dict(model.named_modules())
            layers = [LayerChoice(name=n, shape=describe_layer(modules[n]), note=self.layer_reason(modules[n], device) or "")
                      for n in self.layers_of(model)]
            reference, candidates = self.candidates(model, [c.name for c in layers if not c.note], batches, device, workload)
            floor = config.min_fidelity if config.min_fidelity is not None else 0.99
            found = search(workload, batches, reference, candidates, layers, scheme=self.scheme, floor=floor,
                           margin=SEARCH_MARGIN, calibration_rows=len(rows))
            return {**{k: v for k, v in vars(found).items() if k != "layers"}, "layers": [c.to_dict() for c in found.layers]}

        result = self._stored_search(model, config, workload, device, rows, run_search)
        _CACHE[key] = result
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
        return result

    def _stored_search(self, model, config, workload, device, rows, run_search) -> SearchResult:
        """The search's table from the cache folder (`files.cache`) when this model, these calibration
        rows, this config, this machine and thread count were searched before; else searched now and
        kept. The layers' time saved is this machine's, so the machine is in the key."""
        from overdrive.core.devices import describe
        from overdrive.files.cache import cached, model_key, versions

        try:
            parts = {"technique": self.name, "model": model_key(model), "rows": rows_fingerprint(rows),
                     "config": dataclasses.replace(config, compile=True).to_dict(), "device": describe(device),
                     "threads": torch.get_num_threads(), "versions": versions("torchao")}
        except Exception:  # noqa: BLE001 - a model whose key cannot be made is searched, not cached
            parts = None
        if parts is None or parts["rows"].startswith("id:"):
            stored = run_search()
        else:
            stored = cached("sensitivity", parts, lambda folder: run_search(folder)).meta
        return SearchResult(**{**stored, "layers": [LayerChoice(**c) for c in stored["layers"]]})

    def apply(self, model, config, *, workload, device):
        total = len(self.layers_of(model))
        if config.layers is None:
            result = self.searched(model, config, workload, device)
            if not result.chosen:
                raise RuntimeError(f"no layer can take {self.scheme} without taking {result.key} below "
                                   f"{result.target:.4f} on {result.calibration_rows} training rows")
            layers = result.chosen
            report = {"technique": self.name, "scheme": self.scheme, "layers": [c.to_dict() for c in result.layers],
                      "chosen": layers, "total": total, "key": result.key, "search_fidelity": result.fidelity,
                      "target": result.target, "calibration_rows": result.calibration_rows, "search_s": result.seconds}
        else:
            layers = list(config.layers)
            report = {"technique": self.name, "scheme": self.scheme, "chosen": layers, "total": total}
        model = self.lower(model, layers, workload, device, config)
        if pt2e_static.notes_of(model):  # what PT2E / torchao said while quantising, as report text
            report["notes"] = pt2e_static.notes_of(model)
        if config.compile:
            model = CompiledOnFirstCall(model, dynamic=self.compile_dynamic(workload), freezing=self.freezing)
        model.overdrive_report = report
        return model

    def resolve(self, step: MixedPrecisionConfig, before: list[TechniqueConfig], *, workload: Workload,
                device: torch.device, folder) -> MixedPrecisionConfig:
        """The step with the search's layers written in, so a reloaded plan rebuilds without searching."""
        if step.layers is not None:
            return step
        from overdrive.techniques.compose import build

        reports: list[dict] = []
        build(workload, before + [step], device, reports)  # the search is cached; compiling waits for a call
        chosen = next(r["chosen"] for r in reports if r.get("technique") == self.name)
        return dataclasses.replace(step, layers=tuple(chosen))

    def describe_report(self, report: dict[str, Any], fidelity_key: str) -> str:
        n, total = len(report["chosen"]), report["total"]
        head = f"{self.name}: {n} of {total} layers in {report['scheme']} ({self.form}), {total - n} in fp32"
        said = "".join(f"\n    PT2E said while quantising: {note}" for note in report.get("notes", []))
        if "layers" not in report:
            return head + " (the plan's layers; no search)" + said
        head += (f"; searched on {report['calibration_rows']} training rows in {report['search_s']:.0f} s, "
                 f"{report['key']} {report['search_fidelity']:.4f} on them (target ≥ {report['target']:.4f})")
        rows = ["layer | shape | sensitivity (1 − fidelity alone) | saved ms/batch (eager) | precision"]
        for c in sorted(report["layers"], key=lambda c: (c["precision"] != "fp32", -(c["drop"] or 0))):
            drop = "–" if c["drop"] is None else f"{c['drop']:.5f}"
            saved = "–" if c["saved_ms"] is None else f"{c['saved_ms']:.2f}"
            why = f" ({c['note']})" if c["note"] else ""
            rows.append(f"{c['name']} | {c['shape']} | {drop} | {saved} | {c['precision']}{why}")
        return head + "\n" + "\n".join("    " + r for r in rows) + said


@register
class MixedInt8(MixedPrecision):
    config_cls = MixedInt8Config
    scheme = "int8"
    compute_dtype = "int8"
    form = "per-row dynamic activations"
    dtype_layers = (nn.Linear,)
    description = ("int8 nn.Linear layers (per-row activations, per-channel weights) chosen by a per-layer sensitivity "
                   "search under the fidelity floor; the rest fp32; compiled with Inductor")


@register
class MixedFp8(MixedPrecision):
    config_cls = MixedFp8Config
    scheme = "fp8"
    compute_dtype = "float8"
    dtype_layers = (nn.Linear,)
    form = "e4m3, per-row dynamic activations"
    devices = ("cuda",)
    description = ("fp8 (e4m3, per-row) nn.Linear layers through torchao, chosen by a per-layer sensitivity search "
                   "under the fidelity floor; compute capability ≥ 8.9")

    def applicability(self, workload: Workload, device: torch.device) -> str | None:
        return fp8_reason(device) or super().applicability(workload, device)


@register
class MixedInt8Static(MixedPrecision):
    """Static int8 of the chosen nn.Conv2d / nn.Linear layers through PT2E (`pt2e_static`), compiled by Inductor
    with freezing (oneDNN int8 kernels). For convolutional networks; calibrates on training rows at every build."""

    config_cls = MixedInt8StaticConfig
    scheme = "int8"
    compute_dtype = "int8"
    form = "static activations, PT2E X86InductorQuantizer"
    devices = ("cpu",)
    freezing = True
    layer_types = (nn.Conv2d, nn.Linear)
    description = ("static int8 nn.Conv2d / nn.Linear layers (PT2E X86InductorQuantizer, calibrated on training rows) "
                   "chosen by a per-layer sensitivity search; compiled with Inductor (freezing); convolutional models")

    def applicability(self, workload: Workload, device: torch.device) -> str | None:
        if not torchao_available():
            return "PT2E quantisation comes with torchao, which is not installed (pip install torchao)"
        if workload.is_text or workload.dynamic_dims:
            return ("not applicable: inputs whose length varies (text); per-row dynamic int8 suits them: mixed-int8")
        if not any(type(m) is nn.Conv2d for m in workload.model.modules()):
            return missing_layers_reason(workload.model, layers="nn.Conv2d", ops=CONV_OPS,
                                         rewrites=f"{self.name} is for convolutional models (mixed-int8 covers nn.Linear)")
        return None

    def needs_rows(self, config):
        return config is None or config.checkpoint is None  # without its program, a plan calibrates again

    def compile_dynamic(self, workload):
        # A graph per batch size: with a symbolic batch size, Inductor's int8 convolution (torch 2.14) is given an
        # output layout it then refuses ("expected ... stride"), measured on digits-cnn at batch 7 after 256 and 1.
        return False

    def layer_reason(self, layer, device):
        return pt2e_static.layer_reason(layer)

    def candidates(self, model, names, batches, device, workload):
        exported = pt2e_static.export(model, batches[0], workload.fixed_batch_size is not None)
        return exported, pt2e_static.StaticCandidates(exported, batches)

    def lower(self, model, layers, workload, device, config):
        if config.checkpoint:
            quantized = pt2e_static.load_program(config.checkpoint)
        else:
            eligible = {n for n in self.layers_of(model) if not self.layer_reason(model.get_submodule(n), device)}
            unknown = [n for n in layers if n not in eligible]
            if unknown:
                raise RuntimeError(f"the model has no plain nn.Conv2d / nn.Linear layer {unknown[0]!r} (the plan was made "
                                   "for another model?)")
            rows = list(workload.train_samples or [])[:config.calibration_rows]
            batches = calibration_batches(workload, rows, device)
            exported = pt2e_static.export(model, batches[0], workload.fixed_batch_size is not None)
            quantized = pt2e_static.quantize(exported, layers, batches)
        found = pt2e_static.quantized_layer_count(quantized)
        if found != len(layers):
            raise RuntimeError(f"the quantised graph runs {found} int8 convolution / linear layers, not the {len(layers)} "
                               "the step names")
        return quantized.to(device)

    def resolve(self, step, before, *, workload, device, folder):
        """The step with its layers and its quantised program (`folder/mixed-int8-static.pt2`) written in."""
        if step.checkpoint:
            return step
        from overdrive.techniques.compose import build

        reports: list[dict] = []
        model, _ = build(workload, before + [dataclasses.replace(step, compile=False)], device, reports)  # one export
        chosen = next(r["chosen"] for r in reports if r.get("technique") == self.name)
        step = dataclasses.replace(step, layers=tuple(chosen))
        rows = list(workload.train_samples or [])[:step.calibration_rows]
        example = calibration_batches(workload, rows, device)[0]
        path = Path(folder) / f"{self.name}.pt2"
        path.parent.mkdir(parents=True, exist_ok=True)
        pt2e_static.save_program(model, example, workload.fixed_batch_size is not None, path)
        return dataclasses.replace(step, checkpoint=str(path))

    def check_files(self, step):
        if step.checkpoint:
            try:
                pt2e_static.load_program(step.checkpoint)
            except RuntimeError as exc:
                raise RuntimeError(f"{self.name}: {exc}") from None
