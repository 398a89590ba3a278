"""Transformer layers: finding them, and shrinking their attention heads and FFN width.

Two layouts are recognised, each by its module structure:

- **Hugging Face BERT family** (BERT, RoBERTa, MiniLM, ELECTRA, XLM-R), `BertLayer`:

      layer.attention.self.{query,key,value}   Linear(hidden → heads × head_size), with the
                                               attributes num_attention_heads, attention_head_size
      layer.attention.output.dense             Linear(heads × head_size → hidden)
      layer.intermediate.dense                 Linear(hidden → intermediate)
      layer.output.dense                       Linear(intermediate → hidden)

  transformers ≥ 5 reshapes q/k/v with `view(..., -1, head_size)`, so the number of heads
  follows from the Linear widths; the attributes are updated too, for code that reads them.
  `is_bert_layer(..., quantized=True)` also accepts the layout with its projections replaced
  by other modules (the dynamically quantized Linears of `int8-dynamic`), for rewrites that
  only call them (remove-padding).

- **nn.MultiheadAttention layers**, `MultiheadLayer`: a module with exactly one
  `nn.MultiheadAttention` child (self-attention; packed `in_proj_weight` [3E, E], `out_proj`)
  and an MLP of two Linears, either an `nn.Sequential` child holding exactly two `nn.Linear`
  (torchvision's ViT `EncoderBlock`: `mlp[0]` Linear(E → mlp_dim), `mlp[3]` Linear(mlp_dim → E))
  or `linear1`/`linear2` (`nn.TransformerEncoderLayer`). Head pruning first replaces the
  attention, losslessly, with `SplitQKVAttention` (separate q/k/v Linears), whose head count
  follows from the projection widths (`MultiheadLayer.split_attention`).

`encoder_layers(model)` returns one adapter per layer (`EncoderLayer`), which exposes the
projections, the head and FFN geometry, the module paths (tensor parallel plans, state-dict
keys) and the surgery: `keep_heads` (Michel et al., "Are Sixteen Heads Really Better than
One?", NeurIPS 2019) and `keep_ffn`, each optionally refitting the output Linear by least
squares (`refit`, Kwon et al., NeurIPS 2022). `find_blocks(model)` is the one finder of a
model's repeated blocks (activation checkpointing, FSDP units, pipeline stages).
"""

from __future__ import annotations

import enum

import torch
from torch import nn

from overdrive.core.attention import SplitQKVAttention

SUPPORTED_LAYOUTS = ("BERT-style encoder layers (attention.self.query/key/value, intermediate.dense) or "
                     "nn.MultiheadAttention encoder layers (torchvision ViT EncoderBlock, nn.TransformerEncoderLayer: "
                     "self-attention plus an MLP of two Linears)")


class Layout(str, enum.Enum):
    BERT = "bert"  # Hugging Face BERT family
    MULTIHEAD = "multihead"  # nn.MultiheadAttention (or its SplitQKVAttention) + a two-Linear MLP


# -- Linear surgery ---------------------------------------------------------------------------------


@torch.no_grad()
def keep_out_features(linear: nn.Linear, index: torch.Tensor) -> None:
    """Keep only output features `index` (int64 [k]: rows of the weight, entries of the bias), in place."""
    linear.weight = nn.Parameter(linear.weight[index].clone())
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias[index].clone())
    linear.out_features = len(index)


@torch.no_grad()
def keep_in_features(linear: nn.Linear, index: torch.Tensor) -> None:
    """Keep only input features `index` (int64 [k]: columns of the weight), in place."""
    linear.weight = nn.Parameter(linear.weight[:, index].clone())
    linear.in_features = len(index)


@torch.no_grad()
def refit(linear: nn.Linear, kept: torch.Tensor, gram: torch.Tensor, *, ridge: float = 1e-3) -> None:
    """Keep input features `kept` (int64 [k]) of `linear` and re-solve its weight and bias by
    least squares so that, on the calibration inputs, it reproduces the output it had with all
    its inputs (the layer-wise reconstruction of Kwon et al., "A Fast Post-Training Pruning
    Framework for Transformers", NeurIPS 2022), with ridge `ridge` × the mean diagonal. In place.

    Args:
        gram: float64 [in + 1, in + 1], the Gram matrix of the Linear's inputs augmented with a
            constant 1 feature (`overdrive.techniques.pruning.encoder.input_gram`).
    """
    n = linear.in_features
    has_bias = linear.bias is not None
    full = linear.weight.double()
    if has_bias:
        full = torch.cat([full, linear.bias.double().unsqueeze(1)], dim=1)  # [out, n + 1]
        rows = torch.cat([kept.to(gram.device), torch.tensor([n], device=gram.device)])
        columns = gram
    else:
        rows, columns = kept.to(gram.device), gram[:n, :n]
    lhs = gram[rows][:, rows]
    lhs = lhs + ridge * lhs.diagonal().mean() * torch.eye(len(rows), dtype=lhs.dtype, device=lhs.device)
    solution = torch.linalg.solve(lhs, columns[rows] @ full.T)  # [k (+1), out]
    weight = solution[: len(kept)].T
    linear.weight = nn.Parameter(weight.to(linear.weight.dtype).contiguous())
    if has_bias:
        linear.bias = nn.Parameter(solution[-1].to(linear.bias.dtype).contiguous())
    linear.in_features = len(kept)


def _keep_inputs(linear: nn.Linear, index: torch.Tensor, gram: torch.Tensor | None) -> None:
    if gram is not None:
        refit(linear, index, gram)
    else:
        keep_in_features(linear, index.to(linear.weight.device))


# -- the per-layer adapters ---------------------------------------------------------------------------


class EncoderLayer:
    """One transformer encoder layer's prunable parts, whatever its layout.

    Attributes:
        name: the layer's path in `model.named_modules()` ("" for the model itself).
        layer: the whole layer (its output is a distillation hint).

    Properties (looked up on `layer` each time, so they follow module replacements):
    `attention` (the self-attention module), `query`/`key`/`value` (nn.Linear [heads ×
    head_size, hidden]), `attention_output` (nn.Linear [hidden, heads × head_size]),
    `intermediate` and `output` (the FFN's Linear(hidden → width) and Linear(width → hidden)),
    `num_heads`, `head_size`.
    """

    layout: Layout

    def __init__(self, name: str, layer: nn.Module):
        self.name, self.layer = name, layer

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, heads={self.num_heads}, head_size={self.head_size}, " \
               f"ffn={self.intermediate.out_features})"

    def paths(self) -> dict[str, str]:
        """Module paths relative to `layer`, by role: query, key, value, attention_output,
        intermediate, output (tensor-parallel plans, state-dict keys)."""
        raise NotImplementedError

    def weight_key(self, role: str) -> str:
        """The state-dict key of role `role`'s weight in the whole model."""
        return ".".join(p for p in (self.name, self.paths()[role], "weight") if p)

    @property
    def attention(self) -> nn.Module:
        raise NotImplementedError

    @property
    def query(self) -> nn.Linear:
        return self.layer.get_submodule(self.paths()["query"])

    @property
    def key(self) -> nn.Linear:
        return self.layer.get_submodule(self.paths()["key"])

    @property
    def value(self) -> nn.Linear:
        return self.layer.get_submodule(self.paths()["value"])

    @property
    def attention_output(self) -> nn.Linear:
        return self.layer.get_submodule(self.paths()["attention_output"])

    @property
    def intermediate(self) -> nn.Linear:
        return self.layer.get_submodule(self.paths()["intermediate"])

    @property
    def output(self) -> nn.Linear:
        return self.layer.get_submodule(self.paths()["output"])

    @property
    def num_heads(self) -> int:
        return self.query.out_features // self.head_size

    @property
    def head_size(self) -> int:
        raise NotImplementedError

    def split_attention(self, model: nn.Module | None = None) -> None:
        """Make the heads prunable in place (query/key/value become Linears); lossless. A no-op
        where they already are."""

    def keep_heads(self, heads: torch.Tensor, gram: torch.Tensor | None = None) -> None:
        """Keep attention heads `heads` (sorted int64 indices): q/k/v rows and output-projection
        columns, in place; given the output projection's input `gram` (`refit`), its kept
        columns are refit by least squares instead of copied. Splits an nn.MultiheadAttention
        first (`split_attention`)."""
        self.split_attention()
        size = self.head_size
        index = (heads.unsqueeze(1) * size + torch.arange(size, device=heads.device)).flatten()
        for linear in (self.query, self.key, self.value):
            keep_out_features(linear, index.to(linear.weight.device))
        _keep_inputs(self.attention_output, index, gram)
        self._heads_changed(len(heads))

    def keep_ffn(self, neurons: torch.Tensor, gram: torch.Tensor | None = None) -> None:
        """Keep FFN neurons `neurons` (sorted int64 indices): rows of `intermediate`, columns of
        `output`, in place; given `output`'s input `gram`, its kept columns are refit (`refit`)."""
        keep_out_features(self.intermediate, neurons.to(self.intermediate.weight.device))
        _keep_inputs(self.output, neurons, gram)

    def _heads_changed(self, num_heads: int) -> None:
        """Write the new head count into the attributes other code reads."""


class BertLayer(EncoderLayer):
    """A Hugging Face BERT-family layer (module docstring)."""

    layout = Layout.BERT
    _PATHS = {"query": "attention.self.query", "key": "attention.self.key", "value": "attention.self.value",
              "attention_output": "attention.output.dense", "intermediate": "intermediate.dense", "output": "output.dense"}

    def paths(self) -> dict[str, str]:
        return dict(self._PATHS)

    @property
    def attention(self) -> nn.Module:
        return self.layer.attention.self

    @property
    def head_size(self) -> int:
        return self.attention.attention_head_size

    def _heads_changed(self, num_heads: int) -> None:
        self.attention.num_attention_heads = num_heads
        self.attention.all_head_size = num_heads * self.head_size


class MultiheadLayer(EncoderLayer):
    """A layer around an nn.MultiheadAttention (or the SplitQKVAttention it became) and a
    two-Linear MLP: torchvision's ViT EncoderBlock, nn.TransformerEncoderLayer (module docstring).

    Args:
        attention_name: the attention's attribute on the layer ("self_attention", "self_attn").
        ffn_paths: (first Linear, second Linear) paths relative to the layer.
    """

    layout = Layout.MULTIHEAD

    def __init__(self, name: str, layer: nn.Module, attention_name: str, ffn_paths: tuple[str, str]):
        super().__init__(name, layer)
        self.attention_name, self.ffn_paths = attention_name, ffn_paths

    def paths(self) -> dict[str, str]:
        a = self.attention_name
        return {"query": f"{a}.query", "key": f"{a}.key", "value": f"{a}.value", "attention_output": f"{a}.out_proj",
                "intermediate": self.ffn_paths[0], "output": self.ffn_paths[1]}

    @property
    def attention(self) -> nn.Module:
        return getattr(self.layer, self.attention_name)

    @property
    def is_split(self) -> bool:
        return isinstance(self.attention, SplitQKVAttention)

    @property
    def query(self) -> nn.Linear:
        self._require_split("query")
        return self.attention.query

    @property
    def key(self) -> nn.Linear:
        self._require_split("key")
        return self.attention.key

    @property
    def value(self) -> nn.Linear:
        self._require_split("value")
        return self.attention.value

    @property
    def num_heads(self) -> int:
        return self.attention.num_heads

    @property
    def head_size(self) -> int:
        return self.attention.head_dim

    def _require_split(self, role: str) -> None:
        if not self.is_split:
            raise RuntimeError(f"{self.name or 'the layer'}: nn.MultiheadAttention packs q/k/v into in_proj_weight; "
                               f"call split_attention() before using its {role} projection")

    def split_attention(self, model: nn.Module | None = None) -> None:
        """Replace the nn.MultiheadAttention by an equivalent SplitQKVAttention (lossless). Given
        the whole `model`, nn.TransformerEncoder containers of this layer stop using their
        nested-tensor fast path, which reads the packed in_proj_weight."""
        if self.is_split:
            return
        setattr(self.layer, self.attention_name, SplitQKVAttention.from_multihead(self.attention))
        for module in (model.modules() if model is not None else ()):
            if isinstance(module, nn.TransformerEncoder) and any(m is self.layer for m in module.layers):
                module.use_nested_tensor = False

    def _heads_changed(self, num_heads: int) -> None:
        if isinstance(getattr(self.layer, "num_heads", None), int):  # torchvision's EncoderBlock
            self.layer.num_heads = num_heads


# -- detection ---------------------------------------------------------------------------------------


def is_bert_layer(layer: nn.Module, *, quantized: bool = False) -> bool:
    """Whether `layer` has the Hugging Face BERT layer layout (module docstring) with an int
    `attention_head_size`: its six projections nn.Linear, or with `quantized`, the parts any
    modules (int8 dynamic Linears), as rewrites that only call them need."""
    try:
        attention = layer.attention.self
        head_size = attention.attention_head_size
        if quantized:
            parts = (attention.query, attention.key, attention.value, layer.attention.output, layer.intermediate, layer.output)
        else:
            parts = (attention.query, attention.key, attention.value, layer.attention.output.dense,
                     layer.intermediate.dense, layer.output.dense)
    except AttributeError:
        return False
    kind = nn.Module if quantized else nn.Linear
    return isinstance(head_size, int) and all(isinstance(p, kind) for p in parts)


def bert_encoder_layers(module: nn.Module, *, quantized: bool = True) -> nn.ModuleList | None:
    """The `encoder.layer` list of a Hugging Face BERT-family encoder (a module with
    `embeddings` and a non-empty `encoder.layer` of BERT layers, `is_bert_layer`); None for any
    other module."""
    layers = getattr(getattr(module, "encoder", None), "layer", None)
    if not isinstance(layers, nn.ModuleList) or not hasattr(module, "embeddings") or len(layers) == 0:
        return None
    return layers if all(is_bert_layer(layer, quantized=quantized) for layer in layers) else None


def _multihead_layer(name: str, module: nn.Module) -> MultiheadLayer | None:
    attentions = [(n, c) for n, c in module.named_children() if isinstance(c, (nn.MultiheadAttention, SplitQKVAttention))]
    if len(attentions) != 1:
        return None  # none, or self- and cross-attention (a decoder layer)
    attention_name, attention = attentions[0]
    if isinstance(attention, nn.MultiheadAttention) and (
            not attention._qkv_same_embed_dim or attention.bias_k is not None or attention.add_zero_attn):
        return None
    if isinstance(getattr(module, "linear1", None), nn.Linear) and isinstance(getattr(module, "linear2", None), nn.Linear):
        paths = ("linear1", "linear2")
    else:
        mlps = [(n, c) for n, c in module.named_children() if isinstance(c, nn.Sequential)
                and sum(isinstance(m, nn.Linear) for m in c) == 2]
        if len(mlps) != 1:
            return None
        mlp_name, mlp = mlps[0]
        first, second = (i for i, m in enumerate(mlp) if isinstance(m, nn.Linear))
        paths = (f"{mlp_name}.{first}", f"{mlp_name}.{second}")
    fc1, fc2 = module.get_submodule(paths[0]), module.get_submodule(paths[1])
    width = attention.embed_dim
    if not (fc1.in_features == width == fc2.out_features and fc1.out_features == fc2.in_features):
        return None
    return MultiheadLayer(name, module, attention_name, paths)


def encoder_layer(module: nn.Module, name: str = "") -> EncoderLayer | None:
    """The adapter for `module` if it is a supported transformer encoder layer (module
    docstring; projections plain nn.Linear), else None."""
    if is_bert_layer(module):
        return BertLayer(name, module)
    return _multihead_layer(name, module)


def encoder_layers(model: nn.Module) -> list[EncoderLayer]:
    """Every supported transformer encoder layer in `model`, in module order (empty when there
    is none)."""
    return [layer for name, module in model.named_modules() if (layer := encoder_layer(module, name)) is not None]


def find_blocks(model: nn.Module) -> tuple[str, nn.ModuleList | nn.Sequential]:
    """The model's repeated blocks, for activation checkpointing, FSDP units and pipeline stages:
    the nn.ModuleList or nn.Sequential holding all of its transformer encoder layers
    (`encoder_layers`; e.g. `encoder.encoder.layer` of a BERT, `encoder.layers` of a ViT);
    otherwise the ModuleList holding the most parameters, else the largest nn.Sequential.

    Returns:
        (qualified name, the container).

    Raises:
        ValueError: the model has neither.
    """
    containers = dict(model.named_modules())
    parents = {layer.name.rpartition(".")[0] for layer in encoder_layers(model) if layer.name}
    if len(parents) == 1:
        name = parents.pop()
        if isinstance(containers[name], (nn.ModuleList, nn.Sequential)):
            return name, containers[name]
    candidates = [(name, m) for name, m in containers.items() if isinstance(m, nn.ModuleList) and len(m) >= 1]
    if not candidates:
        candidates = [(name, m) for name, m in containers.items() if isinstance(m, nn.Sequential) and len(m) > 1]
    if not candidates:
        raise ValueError(f"{type(model).__name__} has no nn.ModuleList or nn.Sequential of blocks")
    return max(candidates, key=lambda nm: (sum(p.numel() for p in nm[1].parameters()), len(nm[1])))


def update_config(model: nn.Module, layers: list[EncoderLayer]) -> None:
    """Write the new widths into the model's Hugging Face config(s): num_attention_heads and
    intermediate_size where every layer agrees, head_dim (unchanged by head pruning, but no
    longer hidden ÷ heads), and the per-layer lists in `overdrive_pruning`. Models without one
    (torchvision) keep their widths in the modules alone."""
    if not layers:
        return
    heads = [b.num_heads for b in layers]
    widths = [b.intermediate.out_features for b in layers]
    configs = {id(m.config): m.config for m in model.modules() if hasattr(m, "config") and hasattr(m.config, "to_dict")}
    for config in configs.values():
        if len(set(heads)) == 1:
            config.num_attention_heads = heads[0]
        if len(set(widths)) == 1:
            config.intermediate_size = widths[0]
        config.head_dim = layers[0].head_size
        config.overdrive_pruning = {"heads_per_layer": heads, "intermediate_size_per_layer": widths}
