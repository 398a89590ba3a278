"""remove-padding: position-wise encoder work on real tokens only, same outputs at real tokens."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from overdrive.core.workload import pad_token_ids
from overdrive.techniques import default_config, get_technique
from overdrive.techniques.graph.remove_padding import PaddingFreeEncoder, bert_encoders
from overdrive.techniques.compose import build
from tests.conftest import make_conv_workload, make_text_workload, tiny_bert_embedder

CPU = torch.device("cpu")


def padded_batch(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return pad_token_ids([torch.randint(1, 50, (n,), generator=g).tolist() for n in lengths])


def rewritten(model):
    return get_technique("remove-padding").apply(model, None, workload=None, device=CPU)


def test_position_wise_layers_see_only_the_real_tokens():
    model = tiny_bert_embedder()
    fast = rewritten(model)
    rows = []
    for layer in fast.encoder.inner.encoder.layer:
        layer.intermediate.dense.register_forward_hook(lambda m, args, out: rows.append(args[0].shape))
    ids, mask = padded_batch([3, 17, 9, 30])
    with torch.inference_mode():
        fast(ids, mask)
    assert ids.numel() == 4 * 30
    assert rows == [torch.Size([3 + 17 + 9 + 30, 32])] * 2  # [T, H], not [B, L, H]


@pytest.mark.parametrize("lengths", [[3, 17, 9, 30], [12, 12, 12], [1], [5, 1, 29, 2, 2]])
def test_real_token_states_equal_the_encoder_and_pads_are_zero(lengths):
    encoder = tiny_bert_embedder().encoder
    fast = PaddingFreeEncoder(encoder).eval()
    ids, mask = padded_batch(lengths)
    token_types = (torch.arange(ids.shape[1]) % 2).expand_as(ids).contiguous()
    with torch.inference_mode():
        want = encoder(input_ids=ids, attention_mask=mask, token_type_ids=token_types).last_hidden_state
        got = fast(input_ids=ids, attention_mask=mask, token_type_ids=token_types).last_hidden_state
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-5)
    assert (got[~real] == 0).all()
    assert torch.equal(fast(ids, mask)[0], fast(ids, mask).last_hidden_state)  # indexes like BaseModelOutput


def test_pooled_embeddings_equal_and_the_workload_model_is_rewritten_in_place():
    workload = make_text_workload()
    reference, _ = build(workload, [], CPU)
    fast, _ = build(workload, [default_config("remove-padding")], CPU)
    assert isinstance(fast.encoder, PaddingFreeEncoder) and not bert_encoders(fast)  # once, not twice
    ids, mask = padded_batch([2, 29, 7, 15, 15, 3])
    with torch.inference_mode():
        torch.testing.assert_close(fast(ids, mask), reference(ids, mask), rtol=1e-5, atol=1e-6)


def test_composes_with_bf16_and_with_pruned_heads():
    workload = make_text_workload()
    ids, mask = padded_batch([2, 29, 7, 15])
    for steps in (["bf16"], ["prune-heads"], ["prune-heads", "bf16"]):
        torch.manual_seed(0)
        plain, _ = build(workload, [default_config(s) for s in steps], CPU)
        torch.manual_seed(0)
        fast, _ = build(workload, [default_config(s) for s in [*steps, "remove-padding"]], CPU)
        with torch.inference_mode():
            cosine = F.cosine_similarity(fast(ids, mask), plain(ids, mask)).min().item()
        assert cosine > 0.999, (steps, cosine)


def test_refused_without_a_bert_encoder_or_for_a_decoder():
    technique = get_technique("remove-padding")
    assert "fixed shape" in technique.unsupported_reason(make_conv_workload(), CPU)
    workload = make_text_workload()
    workload.model.encoder.config.is_decoder = True
    assert "BERT-layout encoder" in technique.unsupported_reason(workload, CPU)


def test_training_mode_runs_the_original_encoder():
    encoder = tiny_bert_embedder().encoder
    fast = PaddingFreeEncoder(encoder).train()
    ids, mask = padded_batch([4, 9])
    torch.manual_seed(1)
    want = encoder(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.manual_seed(1)
    got = fast(ids, mask).last_hidden_state
    torch.testing.assert_close(got, want)


def test_composes_with_int8_dynamic_applied_before_it():
    workload = make_text_workload()
    ids, mask = padded_batch([2, 29, 7, 15])
    int8, _ = build(workload, [default_config("int8-dynamic")], CPU)
    fast, _ = build(workload, [default_config("int8-dynamic"), default_config("remove-padding")], CPU)
    assert any(isinstance(m, PaddingFreeEncoder) for m in fast.modules())
    with torch.inference_mode():
        assert F.cosine_similarity(fast(ids, mask), int8(ids, mask)).min().item() > 0.999


def test_the_pooler_output_of_an_encoder_with_a_pooler_is_kept():
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    encoder = BertModel(BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=128, max_position_embeddings=64)).eval()
    fast = PaddingFreeEncoder(encoder)
    ids, mask = padded_batch([3, 11, 6])
    with torch.inference_mode():
        torch.testing.assert_close(fast(input_ids=ids, attention_mask=mask).pooler_output,
                                   encoder(input_ids=ids, attention_mask=mask).pooler_output, rtol=1e-5, atol=1e-5)
