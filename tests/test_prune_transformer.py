"""prune-heads and prune-ffn on a tiny BERT with MiniLM's module layout (tests/conftest.py).

Removing a head is exactly zeroing its columns of the attention output projection, and removing
an FFN neuron is exactly zeroing its column of the output Linear; the tests compare the pruned
model against that masked model, check the parameter counts and the config, prune in several
steps, reload the pruned weights into a fresh model, and export the pruned model.
"""

from __future__ import annotations

import copy

import pytest
import torch

from overdrive.core.transformer import encoder_layers as find_blocks
from overdrive.core.workload import pad_token_ids
from overdrive.techniques import get_technique
from overdrive.techniques.pruning.encoder import kept_count
from overdrive.techniques.pruning.ffn import PruneFFNConfig
from overdrive.techniques.pruning.heads import PruneHeadsConfig
from overdrive.techniques.pruning.recovery import num_parameters, save_checkpoint
from overdrive.techniques.compose import build
from tests.conftest import make_conv_workload, make_text_workload

CPU = torch.device("cpu")
HIDDEN, HEADS, HEAD_SIZE, FFN, LAYERS = 32, 4, 8, 128, 2


def _inputs(workload, n=8):
    return pad_token_ids(workload.samples[:n])


def _kept_rows(pruned: torch.Tensor, original: torch.Tensor) -> list[int]:
    return [int((original == row).all(1).nonzero()[0]) for row in pruned]


def _apply(name, model, config, workload):
    out = get_technique(name).apply(model, config, workload=workload, device=CPU)
    return out, out.__dict__.pop("overdrive_report")


def test_prune_heads_matches_masking_the_removed_heads():
    workload = make_text_workload()
    model = workload.model
    pruned, report = _apply("prune-heads", copy.deepcopy(model), PruneHeadsConfig(ratio=0.5, finetune_steps=0), workload)
    masked = copy.deepcopy(model)
    for block, original, masked_block in zip(find_blocks(pruned), find_blocks(model), find_blocks(masked)):
        assert block.num_heads == 2 and block.attention.num_attention_heads == 2 and block.attention.all_head_size == 16
        rows = _kept_rows(block.attention.query.weight, original.attention.query.weight)
        heads = sorted({r // HEAD_SIZE for r in rows})
        assert len(heads) == 2 and rows == [h * HEAD_SIZE + i for h in heads for i in range(HEAD_SIZE)]
        drop = torch.ones(HEADS * HEAD_SIZE, dtype=torch.bool)
        drop[rows] = False
        with torch.no_grad():
            masked_block.attention_output.weight[:, drop] = 0.0
    with torch.no_grad():
        torch.testing.assert_close(pruned(*_inputs(workload)), masked(*_inputs(workload)), rtol=1e-5, atol=1e-5)
    removed_per_layer = 3 * (HIDDEN * 16 + 16) + HIDDEN * 16  # q/k/v rows with bias, output columns
    assert num_parameters(model) - num_parameters(pruned) == LAYERS * removed_per_layer
    assert report["params_after"] == num_parameters(pruned)
    config = pruned.encoder.config
    assert config.num_attention_heads == 2 and config.head_dim == HEAD_SIZE
    assert config.overdrive_pruning["heads_per_layer"] == [2, 2]


def test_prune_ffn_matches_masking_the_removed_neurons_and_rounds_the_width():
    workload = make_text_workload()
    model = workload.model
    config = PruneFFNConfig(ratio=0.4, round_to=16, finetune_steps=0)
    pruned, _ = _apply("prune-ffn", copy.deepcopy(model), config, workload)
    masked = copy.deepcopy(model)
    width = kept_count(FFN, 0.4, 16)
    assert width == 80
    for block, original, masked_block in zip(find_blocks(pruned), find_blocks(model), find_blocks(masked)):
        assert block.intermediate.out_features == width and block.output.in_features == width
        rows = _kept_rows(block.intermediate.weight, original.intermediate.weight)
        drop = torch.ones(FFN, dtype=torch.bool)
        drop[rows] = False
        with torch.no_grad():
            masked_block.output.weight[:, drop] = 0.0
    with torch.no_grad():
        torch.testing.assert_close(pruned(*_inputs(workload)), masked(*_inputs(workload)), rtol=1e-5, atol=1e-5)
    assert num_parameters(model) - num_parameters(pruned) == LAYERS * (FFN - width) * (2 * HIDDEN + 1)
    assert pruned.encoder.config.intermediate_size == width


def _with_training_samples(workload, n=64):
    g = torch.Generator().manual_seed(1)
    workload.train_samples = [torch.randint(1, 50, (int(k),), generator=g).tolist() for k in torch.randint(2, 30, (n,), generator=g)]
    return workload


def test_activation_importance_drops_a_head_that_adds_nothing():
    # Head 2 of each layer has zero output-projection columns: it writes nothing to the residual
    # stream, so activation importance (‖context‖ × ‖W_out columns‖) must drop it first, while its
    # q/k/v weights would still give it a large L2 norm.
    workload = _with_training_samples(make_text_workload())
    with torch.no_grad():
        for block in find_blocks(workload.model):
            block.attention_output.weight[:, 2 * HEAD_SIZE:3 * HEAD_SIZE] = 0.0
            block.attention.query.weight[2 * HEAD_SIZE:3 * HEAD_SIZE] *= 10.0
    pruned, report = _apply("prune-heads", copy.deepcopy(workload.model), PruneHeadsConfig(ratio=0.25, finetune_steps=0),
                            workload)
    assert report["importance"] == "activation"
    for block, original in zip(find_blocks(pruned), find_blocks(workload.model)):
        rows = _kept_rows(block.attention.query.weight, original.attention.query.weight)
        assert sorted({r // HEAD_SIZE for r in rows}) == [0, 1, 3]
    _, l2_report = _apply("prune-heads", copy.deepcopy(workload.model), PruneHeadsConfig(ratio=0.25, importance="l2",
                                                                                          finetune_steps=0), workload)
    assert l2_report["importance"] == "l2"


def test_activation_importance_drops_dead_ffn_neurons():
    workload = _with_training_samples(make_text_workload())
    dead = torch.arange(0, FFN, 2)  # every other neuron never reaches the output
    with torch.no_grad():
        for block in find_blocks(workload.model):
            block.output.weight[:, dead] = 0.0
    pruned, report = _apply("prune-ffn", copy.deepcopy(workload.model),
                            PruneFFNConfig(ratio=0.5, round_to=16, finetune_steps=0), workload)
    assert report["importance"] == "activation"
    for block, original in zip(find_blocks(pruned), find_blocks(workload.model)):
        rows = _kept_rows(block.intermediate.weight, original.intermediate.weight)
        assert rows == list(range(1, FFN, 2))


def test_refit_is_exact_when_the_dropped_input_is_a_combination_of_kept_ones():
    from overdrive.core.transformer import refit
    from overdrive.techniques.pruning.encoder import input_gram

    torch.manual_seed(0)
    linear = torch.nn.Linear(8, 5)
    x = torch.randn(200, 8)
    x[:, 7] = 0.5 * x[:, 0] - 2.0 * x[:, 3] + 1.0  # feature 7 carries nothing new (the constant goes to the bias)
    expected = linear(x)
    gram = input_gram(linear, linear, [(x,)])
    refit(linear, torch.arange(7), gram, ridge=1e-9)
    assert linear.in_features == 7 and linear.weight.shape == (5, 7)
    with torch.no_grad():
        torch.testing.assert_close(linear(x[:, :7]), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name,config", [("prune-ffn", PruneFFNConfig(ratio=0.5, round_to=16, finetune_steps=0)),
                                         ("prune-heads", PruneHeadsConfig(ratio=0.5, finetune_steps=0))])
def test_reconstruction_brings_the_pruned_outputs_closer(name, config):
    import dataclasses

    workload = _with_training_samples(make_text_workload(), n=128)
    inputs = _inputs(workload, n=40)
    with torch.no_grad():
        reference = workload.model(*inputs)
    errors = {}
    for reconstruct in (False, True):
        pruned, report = _apply(name, copy.deepcopy(workload.model), dataclasses.replace(config, reconstruct=reconstruct),
                                workload)
        assert report["reconstructed"] is reconstruct
        with torch.no_grad():
            errors[reconstruct] = torch.nn.functional.mse_loss(pruned(*inputs), reference).item()
    assert errors[True] < 0.7 * errors[False], errors


def test_heads_pruned_over_several_steps():
    workload = make_text_workload()
    model = copy.deepcopy(workload.model)
    counts = []
    for _ in range(3):
        model, _ = _apply("prune-heads", model, PruneHeadsConfig(ratio=0.3, finetune_steps=0), workload)
        counts.append([b.num_heads for b in find_blocks(model)])
    assert counts == [[3, 3], [2, 2], [1, 1]]
    with torch.no_grad():
        assert model(*_inputs(workload)).shape == (8, HIDDEN)
    assert model.encoder.config.num_attention_heads == 1


def test_pruned_encoder_reloads_from_a_checkpoint_and_exports(tmp_path):
    workload = make_text_workload()
    steps = [PruneHeadsConfig(ratio=0.5, finetune_steps=0),
             PruneFFNConfig(ratio=0.5, round_to=8, finetune_steps=0)]
    # a step's checkpoint is the model after it (as `plan.resolve_steps` writes them)
    paths = []
    for k in (1, 2):
        model, _ = build(workload, steps[:k], CPU)
        paths.append(tmp_path / f"after_{k}.pt")
        save_checkpoint(model, paths[-1], steps[k - 1].name)
    pruned = model
    fresh = copy.deepcopy(workload.model)
    for (name, config_cls), path in zip((("prune-heads", PruneHeadsConfig), ("prune-ffn", PruneFFNConfig)), paths):
        fresh, report = _apply(name, fresh, config_cls(checkpoint=str(path)), workload)
        assert report["source"] == f"checkpoint {path}"
    inputs = _inputs(workload)
    with torch.no_grad():
        torch.testing.assert_close(fresh(*inputs), pruned(*inputs))
    exported = torch.export.export(fresh, inputs)
    with torch.no_grad():
        torch.testing.assert_close(exported.module()(*inputs), pruned(*inputs))


def test_prune_heads_runs_its_distillation_recovery():
    workload = _with_training_samples(make_text_workload(), n=200)
    config = PruneHeadsConfig(ratio=0.5, finetune_steps=60, learning_rate=3e-3, finetune_batch_size=16)
    _, report = _apply("prune-heads", copy.deepcopy(workload.model), config, workload)
    assert report["fine_tune"]["objective"].startswith("distillation")
    assert report["fine_tune"]["last_loss"] < report["fine_tune"]["first_loss"]
    assert report["fine_tune"]["steps"] == 60 and report["after_recovery"]["mean_cosine"] > 0.99


def test_transformer_pruning_refuses_a_conv_net():
    workload = make_conv_workload()
    for name in ("prune-heads", "prune-ffn"):
        assert "no BERT-style encoder layers" in get_technique(name).unsupported_reason(workload, CPU)


def test_config_validation():
    with pytest.raises(ValueError):
        PruneHeadsConfig(ratio=0.0)
    with pytest.raises(ValueError):
        PruneFFNConfig(round_to=0)
    with pytest.raises(ValueError):
        PruneFFNConfig(finetune_steps=-1)
    assert PruneHeadsConfig.from_dict(PruneHeadsConfig(importance="taylor").to_dict()).importance.value == "taylor"
