"""overdrive.core.transformer: layer detection for the BERT family and nn.MultiheadAttention
layers (torchvision ViT, nn.TransformerEncoderLayer), the lossless MHA → split-q/k/v rewrite,
and prune-heads / prune-ffn on a tiny torchvision ViT (tests/conftest.py's make_vit_workload).

Removing a head is exactly zeroing its columns of the attention output projection, and removing
an FFN neuron its column of the MLP's second Linear, so pruned ViTs are compared against those
masked models, as tests/test_prune_transformer.py does for BERT.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

from overdrive.core.attention import SplitQKVAttention
from overdrive.core.transformer import BertLayer, Layout, MultiheadLayer, encoder_layers, find_blocks
from overdrive.techniques import get_technique
from overdrive.techniques.pruning.ffn import PruneFFNConfig
from overdrive.techniques.pruning.heads import PruneHeadsConfig
from overdrive.techniques.pruning.recovery import num_parameters, save_checkpoint
from overdrive.train.launch import DistEnv
from overdrive.techniques.compose import build
from tests.conftest import make_conv_workload, make_vit_workload, tiny_bert_embedder, tiny_vit

CPU = torch.device("cpu")
HIDDEN, HEADS, HEAD_SIZE, MLP, LAYERS = 32, 4, 8, 64, 2


def _apply(name, model, config, workload):
    out = get_technique(name).apply(model, config, workload=workload, device=CPU)
    return out, out.__dict__.pop("overdrive_report")


def _images(workload, n=8):
    return (torch.stack(list(workload.samples[:n])),)


def _kept_rows(pruned: torch.Tensor, original: torch.Tensor) -> list[int]:
    return [int((original == row).all(1).nonzero()[0]) for row in pruned]


def _torch_encoder() -> nn.TransformerEncoder:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(HIDDEN, HEADS, MLP, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=True).eval()


# -- detection ------------------------------------------------------------------------------------------


def test_detects_bert_layers():
    layers = encoder_layers(tiny_bert_embedder())
    assert [type(b) for b in layers] == [BertLayer, BertLayer]
    assert [b.name for b in layers] == ["encoder.encoder.layer.0", "encoder.encoder.layer.1"]
    block = layers[0]
    assert block.layout is Layout.BERT and (block.num_heads, block.head_size) == (HEADS, HEAD_SIZE)
    assert block.query is block.layer.attention.self.query and block.intermediate.out_features == 128
    assert block.weight_key("output") == "encoder.encoder.layer.0.output.dense.weight"


def test_detects_vit_encoder_blocks():
    model = tiny_vit()
    layers = encoder_layers(model)
    assert [type(b) for b in layers] == [MultiheadLayer, MultiheadLayer]
    block = layers[1]
    assert block.name == "encoder.layers.encoder_layer_1" and block.layout is Layout.MULTIHEAD
    assert (block.num_heads, block.head_size) == (HEADS, HEAD_SIZE)
    assert block.intermediate is block.layer.mlp[0] and block.output is block.layer.mlp[3]
    assert block.attention_output is block.layer.self_attention.out_proj
    with pytest.raises(RuntimeError, match="split_attention"):
        block.query  # noqa: B018 - packed in in_proj_weight until split
    assert find_blocks(model)[0] == "encoder.layers"


def test_detects_torch_transformer_encoder_layers():
    model = _torch_encoder()
    layers = encoder_layers(model)
    assert [b.name for b in layers] == ["layers.0", "layers.1"]
    assert layers[0].paths()["intermediate"] == "linear1" and layers[0].paths()["output"] == "linear2"
    assert find_blocks(model)[0] == "layers"


def test_detects_nothing_in_models_without_encoder_layers():
    assert encoder_layers(make_conv_workload().model) == []
    decoder = nn.TransformerDecoderLayer(HIDDEN, HEADS, MLP, batch_first=True)  # self- and cross-attention
    assert encoder_layers(decoder) == []
    mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    assert find_blocks(mlp) == ("", mlp)  # the plain-Sequential fallback


# -- nn.MultiheadAttention -> SplitQKVAttention, before any pruning ------------------------------------


def _masks(batch: int, length: int, source: int, heads: int, kind: str):
    g = torch.Generator().manual_seed(3)
    padding = torch.zeros(batch, source, dtype=torch.bool)
    padding[0, -2:] = True  # row 0 ignores its last two keys (never all of them)
    padding[-1, 1] = True
    if kind == "none":
        return None, None
    if kind == "padding":
        return padding, None
    if kind == "float-2d":
        return None, torch.randn(length, source, generator=g)
    if kind == "causal-bool-2d":
        return None, torch.ones(length, source, dtype=torch.bool).triu(1)
    if kind == "bool-3d+padding":
        attn = torch.rand(batch * heads, length, source, generator=g) < 0.3
        attn[..., 0] = False  # every query may attend to key 0
        padding[:, 0] = False
        return padding, attn
    raise AssertionError(kind)


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("need_weights,average", [(False, True), (True, True), (True, False)])
@pytest.mark.parametrize("masks", ["none", "padding", "float-2d", "causal-bool-2d", "bool-3d+padding"])
def test_split_attention_equals_multihead_attention(batch_first, need_weights, average, masks):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(HIDDEN, HEADS, batch_first=batch_first).eval()
    with torch.no_grad():
        mha.in_proj_bias.normal_()
        mha.out_proj.bias.normal_()
    split = SplitQKVAttention.from_multihead(mha)
    batch, length = 3, 7
    x = torch.randn(batch, length, HIDDEN) if batch_first else torch.randn(length, batch, HIDDEN)
    key_padding_mask, attn_mask = _masks(batch, length, length, HEADS, masks)
    kwargs = dict(key_padding_mask=key_padding_mask, attn_mask=attn_mask, need_weights=need_weights,
                  average_attn_weights=average)
    for grad in (True, False):  # with grad: the functional path; without: nn.MultiheadAttention's fast path where it applies
        with torch.set_grad_enabled(grad):
            want, want_weights = mha(x, x, x, **kwargs)
            got, got_weights = split(x, x, x, **kwargs)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        if need_weights:
            torch.testing.assert_close(got_weights, want_weights, rtol=1e-5, atol=1e-6)
        else:
            assert got_weights is None and want_weights is None


def test_split_attention_cross_attention_unbatched_no_bias_and_causal_hint():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(HIDDEN, HEADS, bias=False, kdim=16, vdim=24).eval()  # separate projections
    split = SplitQKVAttention.from_multihead(mha)
    assert split.query.bias is None and split.key.in_features == 16 and split.value.in_features == 24
    q, k, v = torch.randn(5, 2, HIDDEN), torch.randn(9, 2, 16), torch.randn(9, 2, 24)
    padding = torch.tensor([[False] * 8 + [True], [True] + [False] * 8])
    torch.testing.assert_close(split(q, k, v, key_padding_mask=padding)[0], mha(q, k, v, key_padding_mask=padding)[0])
    torch.testing.assert_close(split(q[:, 0], k[:, 0], v[:, 0])[1], mha(q[:, 0], k[:, 0], v[:, 0])[1])  # unbatched
    self_attention = nn.MultiheadAttention(HIDDEN, HEADS, batch_first=True).eval()
    x, causal = torch.randn(2, 6, HIDDEN), nn.Transformer.generate_square_subsequent_mask(6)
    want = self_attention(x, x, x, attn_mask=causal, is_causal=True, need_weights=False)[0]
    got = SplitQKVAttention.from_multihead(self_attention)(x, x, x, attn_mask=causal, is_causal=True, need_weights=False)[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="is_causal"):
        split(q, k, v, is_causal=True)


def test_split_attention_gradients_and_training_dropout_path():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(HIDDEN, HEADS, batch_first=True)  # training mode, dropout 0
    split = SplitQKVAttention.from_multihead(mha)
    assert split.training
    x = torch.randn(2, 5, HIDDEN, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    mha(x, x, x)[0].square().sum().backward()
    split(x2, x2, x2)[0].square().sum().backward()
    torch.testing.assert_close(x2.grad, x.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(split.out_proj.weight.grad, mha.out_proj.weight.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat([split.query.weight.grad, split.key.weight.grad, split.value.weight.grad]),
                               mha.in_proj_weight.grad, rtol=1e-5, atol=1e-5)


def test_splitting_whole_models_is_lossless():
    vit = tiny_vit()
    images = torch.randn(4, 3, 32, 32)
    encoder = _torch_encoder()
    tokens = torch.randn(3, 6, HIDDEN)
    padding = torch.tensor([[False] * 6, [False] * 4 + [True] * 2, [False] * 2 + [True] * 4])
    with torch.no_grad():
        want_vit, want_tokens = vit(images), encoder(tokens, src_key_padding_mask=padding)
        for model in (vit, encoder):
            for block in encoder_layers(model):
                block.split_attention(model)
        assert all(isinstance(b.attention, SplitQKVAttention) for m in (vit, encoder) for b in encoder_layers(m))
        torch.testing.assert_close(vit(images), want_vit, rtol=1e-5, atol=1e-5)
        # the unsplit encoder ran its nested-tensor fast path, which leaves zeros at the pads: compare real tokens
        real = ~padding
        torch.testing.assert_close(encoder(tokens, src_key_padding_mask=padding)[real], want_tokens[real], rtol=1e-5,
                                   atol=1e-5)
    assert not encoder.use_nested_tensor


# -- prune-heads / prune-ffn on a tiny ViT ------------------------------------------------------------------


@pytest.mark.parametrize("importance", ["l2", "taylor", "activation"])
def test_prune_heads_on_a_vit_matches_masking_the_removed_heads(importance):
    workload = make_vit_workload()
    model = workload.model
    config = PruneHeadsConfig(ratio=0.5, importance=importance, reconstruct=False, finetune_steps=0)
    pruned, report = _apply("prune-heads", copy.deepcopy(model), config, workload)
    assert report["importance"] == importance and report["params_after"] == num_parameters(pruned)
    masked = copy.deepcopy(model)
    for block in encoder_layers(masked):
        block.split_attention(masked)
    for block, original in zip(encoder_layers(pruned), encoder_layers(masked)):
        assert isinstance(block.attention, SplitQKVAttention) and block.num_heads == 2 and block.layer.num_heads == 2
        rows = _kept_rows(block.query.weight, original.query.weight)
        heads = sorted({r // HEAD_SIZE for r in rows})
        assert len(heads) == 2 and rows == [h * HEAD_SIZE + i for h in heads for i in range(HEAD_SIZE)]
        drop = torch.ones(HEADS * HEAD_SIZE, dtype=torch.bool)
        drop[rows] = False
        with torch.no_grad():
            original.attention_output.weight[:, drop] = 0.0
    inputs = _images(workload)
    with torch.no_grad():
        assert pruned(*inputs).shape == (8, 5)
        torch.testing.assert_close(pruned(*inputs), masked(*inputs), rtol=1e-5, atol=1e-5)
    removed_per_layer = 3 * (HIDDEN * 16 + 16) + HIDDEN * 16  # q/k/v rows with bias, output-projection columns
    assert num_parameters(model) - num_parameters(pruned) == LAYERS * removed_per_layer
    assert report["flops_per_sample_after"] < report["flops_per_sample_before"]


@pytest.mark.parametrize("importance", ["l2", "taylor", "activation"])
def test_prune_ffn_on_a_vit_matches_masking_the_removed_neurons(importance):
    workload = make_vit_workload()
    model = workload.model
    config = PruneFFNConfig(ratio=0.5, round_to=16, importance=importance, reconstruct=False, finetune_steps=0)
    pruned, report = _apply("prune-ffn", copy.deepcopy(model), config, workload)
    assert report["importance"] == importance
    masked = copy.deepcopy(model)
    for block, original in zip(encoder_layers(pruned), encoder_layers(masked)):
        assert block.intermediate.out_features == 32 and block.output.in_features == 32
        assert isinstance(block.attention, nn.MultiheadAttention)  # FFN pruning leaves the attention packed
        rows = _kept_rows(block.intermediate.weight, original.intermediate.weight)
        drop = torch.ones(MLP, dtype=torch.bool)
        drop[rows] = False
        with torch.no_grad():
            original.output.weight[:, drop] = 0.0
    inputs = _images(workload)
    with torch.no_grad():
        torch.testing.assert_close(pruned(*inputs), masked(*inputs), rtol=1e-5, atol=1e-5)
    assert num_parameters(model) - num_parameters(pruned) == LAYERS * (MLP - 32) * (2 * HIDDEN + 1)


def test_activation_importance_drops_a_vit_head_that_adds_nothing():
    workload = make_vit_workload()
    with torch.no_grad():
        for block in encoder_layers(workload.model):
            block.attention.out_proj.weight[:, HEAD_SIZE:2 * HEAD_SIZE] = 0.0  # head 1 writes nothing
            block.attention.in_proj_weight[HEAD_SIZE:2 * HEAD_SIZE] *= 10.0  # but has large query weights
    pruned, report = _apply("prune-heads", copy.deepcopy(workload.model), PruneHeadsConfig(ratio=0.25, finetune_steps=0),
                            workload)
    assert report["importance"] == "activation" and report["reconstructed"] is True
    for block in encoder_layers(pruned):
        assert block.num_heads == 3
        rows = _kept_rows(block.query.weight, workload.model.get_submodule(block.name).self_attention.in_proj_weight)
        assert sorted({r // HEAD_SIZE for r in rows}) == [0, 2, 3]


@pytest.mark.parametrize("name,config", [("prune-heads", PruneHeadsConfig(ratio=0.1, finetune_steps=0)),
                                         ("prune-ffn", PruneFFNConfig(ratio=0.3, round_to=64, finetune_steps=0))])
def test_a_ratio_that_keeps_the_full_width_changes_nothing(name, config):
    workload = make_vit_workload()
    model = copy.deepcopy(workload.model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    get_technique(name).prune(model, config, workload=workload, device=CPU)
    assert all(isinstance(b.attention, nn.MultiheadAttention) for b in encoder_layers(model))  # not even split
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    with pytest.raises(RuntimeError, match="nothing could be pruned"):
        get_technique(name).apply(copy.deepcopy(workload.model), config, workload=workload, device=CPU)


@pytest.mark.parametrize("name,config", [("prune-ffn", PruneFFNConfig(ratio=0.5, round_to=16, finetune_steps=0)),
                                         ("prune-heads", PruneHeadsConfig(ratio=0.5, finetune_steps=0))])
def test_refit_brings_the_pruned_vit_closer(name, config):
    workload = make_vit_workload(num_train=128)
    inputs = _images(workload, n=24)
    with torch.no_grad():
        reference = workload.model(*inputs)
    errors = {}
    for reconstruct in (False, True):
        pruned, report = _apply(name, copy.deepcopy(workload.model), dataclasses.replace(config, reconstruct=reconstruct),
                                workload)
        assert report["reconstructed"] is reconstruct
        with torch.no_grad():
            errors[reconstruct] = nn.functional.mse_loss(pruned(*inputs), reference).item()
    assert errors[True] < 0.85 * errors[False], errors


def test_pruned_vit_reloads_from_a_checkpoint_and_exports(tmp_path):
    workload = make_vit_workload()
    steps = [PruneHeadsConfig(ratio=0.5, finetune_steps=0), PruneFFNConfig(ratio=0.5, round_to=16, finetune_steps=0)]
    paths = []
    for k in (1, 2):  # a step's checkpoint is the model after it (as `plan.resolve_steps` writes them)
        model, _ = build(workload, steps[:k], CPU)
        paths.append(tmp_path / f"after_{k}.pt")
        save_checkpoint(model, paths[-1], steps[k - 1].name)
    pruned = model
    fresh = copy.deepcopy(workload.model)
    for (name, config_cls), path in zip((("prune-heads", PruneHeadsConfig), ("prune-ffn", PruneFFNConfig)), paths):
        fresh, report = _apply(name, fresh, config_cls(checkpoint=str(path)), workload)
        assert report["source"] == f"checkpoint {path}"
    assert [(b.num_heads, b.intermediate.out_features) for b in encoder_layers(fresh)] == [(2, 32)] * LAYERS
    assert num_parameters(fresh) == num_parameters(pruned) < num_parameters(workload.model)
    inputs = _images(workload)
    with torch.no_grad():
        torch.testing.assert_close(fresh(*inputs), pruned(*inputs))
    exported = torch.export.export(fresh, inputs)
    with torch.no_grad():
        torch.testing.assert_close(exported.module()(*inputs), pruned(*inputs))


def test_prune_heads_and_ffn_on_torch_transformer_encoder_layers():
    encoder = _torch_encoder()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randn(40, 6, HIDDEN, generator=g)
    workload = dataclasses.replace(make_vit_workload(), name="tiny-encoder", model=encoder,
                                   samples=list(tokens[:16]), labels=None, train_samples=list(tokens[16:]),
                                   train_labels=None, fidelity_key="min_cosine")
    model, _ = _apply("prune-heads", copy.deepcopy(encoder), PruneHeadsConfig(ratio=0.5, finetune_steps=0), workload)
    model, _ = _apply("prune-ffn", model, PruneFFNConfig(ratio=0.5, round_to=16, finetune_steps=0), workload)
    assert [(b.num_heads, b.intermediate.out_features) for b in encoder_layers(model)] == [(2, 32)] * LAYERS
    padding = torch.zeros(4, 6, dtype=torch.bool)
    padding[1, 4:] = True
    with torch.no_grad():
        assert model(tokens[:4], src_key_padding_mask=padding).shape == (4, 6, HIDDEN)


def test_refusals_name_both_layouts():
    conv = make_conv_workload()
    for name in ("prune-heads", "prune-ffn"):
        reason = get_technique(name).unsupported_reason(conv, CPU)
        assert "BERT-style encoder layers" in reason and "nn.MultiheadAttention" in reason and "ViT" in reason
    assert "fixed shape" in get_technique("remove-padding").unsupported_reason(make_vit_workload(), CPU)


def test_tensor_parallel_refuses_packed_multihead_attention():
    from overdrive.train.parallel import apply_tensor_parallel

    env = DistEnv(rank=0, local_rank=0, world_size=2, device=CPU)
    with pytest.raises(ValueError, match="packs q/k/v into one in_proj_weight"):
        apply_tensor_parallel(tiny_vit(), env)
