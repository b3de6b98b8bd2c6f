"""SPLADE's fused vocabulary head and pooling (`models/bi_encoder/splade_head.py`): the embedding and the gradients
of the head's inputs, weight and bias equal autograd through the logits (`pooling.splade_pooled`) in float64 within
1e-10, for max and sum, relu and log1p_relu, blocks of tokens that divide nothing, padded and empty rows; nothing
of the logits' size is kept for the backward; a masked LM's head is swapped in place, its weight still tied and
its parameters under their names."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from tests.hf_folders import architecture_folder
from tests.needs import needs
from titan_contrastive.models.bi_encoder.pooling import splade_pooled
from titan_contrastive.models.bi_encoder.splade_head import VocabularyHead, splade_head_pooled

B, L, H, V = 4, 9, 6, 13


def _problem(seed: int) -> tuple[torch.Tensor, nn.Linear, torch.Tensor, torch.Tensor]:
    """Head inputs, the head (half its logits positive), a mask with right padding and an empty row, and the
    weights of a loss that is linear in the embedding."""
    gen = torch.Generator().manual_seed(seed)
    head = nn.Linear(H, V).double()
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=gen, dtype=torch.float64))
        head.bias.copy_(torch.randn(V, generator=gen, dtype=torch.float64))
    x = torch.randn(B, L, H, generator=gen, dtype=torch.float64)
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[1, 5:], mask[2, 1:], mask[3, :] = False, False, False
    return x, head, mask, torch.randn(B, V, generator=gen, dtype=torch.float64)


def _grads(x, head, mask, weights, pool) -> list[torch.Tensor]:
    x = x.clone().requires_grad_(True)
    head.zero_grad()
    out = pool(x, head, mask)
    (out * weights).sum().backward()
    return [out.detach(), x.grad, head.weight.grad.clone(), head.bias.grad.clone()]


@pytest.mark.parametrize("activation", ["relu", "log1p_relu"])
@pytest.mark.parametrize("strategy", ["max", "sum"])
@pytest.mark.parametrize("block", [1, 2, 4, L + 3])
def test_equals_autograd_through_the_logits(strategy: str, activation: str, block: int) -> None:
    x, head, mask, weights = _problem(block)

    def reference(x, head, mask):
        return splade_pooled(head(x), mask, strategy, activation)

    def fused(x, head, mask):
        return splade_head_pooled(x, VocabularyHead(head), mask, strategy, activation, block)

    want, got = _grads(x, head, mask, weights, reference), _grads(x, head, mask, weights, fused)
    assert (want[0] > 0).float().mean() > 0.3 and (want[0] == 0).any()  # active entries, and inactive ones
    assert torch.equal(want[0][3], torch.zeros(V)) and torch.equal(got[1][3], torch.zeros(L, H))  # the empty row
    for name, a, b in zip(("embedding", "dx", "dW", "db"), got, want, strict=True):
        assert (a - b).abs().max() <= 1e-10 * max(b.abs().max().item(), 1.0), name


def test_the_backward_keeps_nothing_of_the_logits_size() -> None:
    """The tensors autograd saves for the backward: none holds B x L x V numbers (the reference keeps several)."""
    x, head, mask, _ = _problem(0)
    x.requires_grad_(True)

    def saved(pool) -> list[int]:
        sizes: list[int] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
            pool()
        return sizes

    logits = B * L * V
    reference = saved(lambda: splade_pooled(head(x), mask))
    fused = saved(lambda: splade_head_pooled(x, VocabularyHead(head), mask))
    assert sum(n >= logits for n in reference) >= 2 and max(fused) < logits


def test_bfloat16_stays_close_to_float32() -> None:
    """bf16 inputs: the logits in bf16, the activation, pooling and gradients accumulated in fp32."""
    x, head, mask, weights = _problem(3)
    want = _grads(x.float(), head.float(), mask, weights.float(), lambda x, h, m: splade_pooled(h(x), m))
    low = head.to(torch.bfloat16)
    got = _grads(
        x.bfloat16(), low, mask, weights.bfloat16(), lambda x, h, m: splade_head_pooled(x, VocabularyHead(h), m)
    )
    for name, a, b in zip(("embedding", "dx", "dW", "db"), got, want, strict=True):
        assert a.dtype == torch.bfloat16 and (a.float() - b).abs().max() <= 0.05 * b.abs().max(), name


@needs("hf")
def test_a_masked_lm_gets_the_fused_head_in_place(tmp_path: Path) -> None:
    """The tower's output layer becomes a VocabularyHead holding the same (tied) weight, under the same names; the
    plain masked LM's logits pooled give the same embedding."""
    from transformers import AutoModelForMaskedLM

    from titan_contrastive.models.bi_encoder.splade_head import fused_head
    from titan_contrastive.models.bi_encoder.tower import load_text_tower

    folder = str(architecture_folder(tmp_path, "bert-mlm", 0.0))
    tower, plain = load_text_tower(folder, masked_lm=True).eval(), AutoModelForMaskedLM.from_pretrained(folder).eval()
    head = fused_head(tower)
    assert head is not None and head.weight is tower.get_input_embeddings().weight
    assert tower.state_dict().keys() == plain.state_dict().keys()
    ids = torch.tensor([[2, 7, 9, 11, 3, 0], [2, 5, 3, 0, 0, 0]])
    mask = ids != 0
    with torch.no_grad():
        want = splade_pooled(plain(input_ids=ids, attention_mask=mask.long()).logits, mask)
        got = splade_head_pooled(tower(input_ids=ids, attention_mask=mask.long()).logits, head, mask)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max() and (want > 0).any()
