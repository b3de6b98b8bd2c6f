"""The sigmoid loss (SigLIP's) in the families that start from pretrained weights, which learn its bias b beside the
temperature: bi_encoder with one vector per text and as ColBERT (over MaxSim), and static; every step kind's loss and
every parameter gradient, the bias's included, against the loss written one (query, column) at a time in float64
(`tests/test_objectives.py`, `tests/test_late_sigmoid.py`), hard negatives and a false-negative mask on. ColQwen's is
in tests/test_colqwen.py. The settings: SigLIP's t = 10 and b = -10 by default, `[loss]` overrides, the count."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.needs import needs
from tests.test_colbert import COLBERT, DIM, KINDS, dense_with
from tests.test_hard_negatives import pairs_file, step_against
from tests.test_late_sigmoid import reference as late_reference
from tests.test_objectives import reference_sigmoid
from titan_contrastive.losses import FalseNegatives

SIGLIP = ["--loss.name=siglip", "--loss.mask_relative=0.8"]
MASK = FalseNegatives(relative=0.8)


def _reference(late: bool, normalize: bool = False):
    """The sigmoid loss over every sample by its definition, the relative mask at 0.8 (asserted to remove
    something)."""

    def reference(trainer, every: dict) -> tuple[float, dict[str, torch.Tensor]]:
        ids = torch.arange(3 * len(every["query"]))

        def loss_of(q, p, n, s, b, masking=MASK):
            if late:
                return late_reference(q, p, n, s, b, ids, masking, normalize, dim=DIM)
            return reference_sigmoid(q, p, n, s, b, ids, masking)

        unmasked = dense_with(trainer, every, lambda *z: loss_of(*z, masking=FalseNegatives()))[0]
        loss, want = dense_with(trainer, every, loss_of)
        assert abs(loss - unmasked) > 1e-4, "the mask removes nothing here"
        assert "logit_bias" in want and want["logit_bias"].abs().item() > 0
        return loss, want

    return reference


@needs("hf")
@pytest.mark.parametrize("kind", list(KINDS))
def test_one_vector_in_every_step_kind(tmp_path: Path, kind: str) -> None:
    pairs_file(tmp_path)
    trainer = step_against(tmp_path, KINDS[kind], *SIGLIP, reference=_reference(late=False))
    assert "siglip loss (sigmoid" in trainer.gradient_step.describe()


@needs("hf")
@pytest.mark.parametrize("kind", list(KINDS))
def test_colbert_in_every_step_kind(tmp_path: Path, kind: str) -> None:
    pairs_file(tmp_path)
    options = [*COLBERT, *SIGLIP, "--loss.maxsim_normalize=true"]
    trainer = step_against(tmp_path, KINDS[kind], *options, reference=_reference(late=True, normalize=True))
    assert "sigmoid over late interaction, MaxSim of 8-wide tokens" in trainer.gradient_step.describe()


@needs("hf")
def test_the_bias_starts_as_siglips_and_is_counted(tmp_path: Path) -> None:
    """t = 10 and b = -10 unless `[loss]` says otherwise; a fixed bias does not train; the count includes it; an
    objective without a bias gives a model without one."""
    from tests.test_colbert import _configured
    from titan_contrastive.models.bi_encoder import BiEncoder

    args, _ = _configured("--loss.name=siglip")
    assert (args.init_scale, args.init_logit_bias, args.learn_logit_bias) == (pytest.approx(10.0), -10.0, True)
    model = BiEncoder(args)
    assert (model.logit_bias.item(), model.logit_scale.exp().item()) == (-10.0, pytest.approx(10.0))
    assert args.num_params() == sum(p.numel() for p in model.parameters())
    fixed, _ = _configured(
        "--loss.name=siglip", "--loss.init_logit_bias=-4", "--loss.learn_logit_bias=false", "--loss.init_logit_scale=1"
    )
    fixed_model = BiEncoder(fixed)
    assert (fixed_model.logit_bias.item(), fixed_model.logit_bias.requires_grad) == (-4.0, False)
    assert fixed.init_scale == pytest.approx(torch.e) and fixed_model.logit_scale.requires_grad
    plain, _ = _configured()
    assert plain.init_logit_bias is None and BiEncoder(plain).logit_bias is None
    assert plain.num_params() == args.num_params() - 1


@needs("hf")
def test_static_in_every_step_kind(tmp_path: Path) -> None:
    """A static table under the sigmoid loss, its bias trained: GradCache and global negatives."""
    from tests.test_static import KINDS as STATIC_KINDS
    from tests.test_static import assert_step_is, defined_embeddings, float64_copy, static_run

    for kind in ("gradcache", "global"):
        local, ga, args = STATIC_KINDS[kind]
        trainer = static_run(
            tmp_path / kind,
            f"--training.local_batch_size={local}",
            f"--training.global_batch_size={local * ga}",
            "--loss.name=siglip",
            *args,
        )
        data = trainer.train_set
        steps = [data.__getitems__(list(range(j * local, (j + 1) * local))) for j in range(ga)]
        model = float64_copy(trainer)
        every = {k: torch.cat([s[k] for s in steps]) for k in steps[0]}
        q = defined_embeddings(model.query_embedding.weight, every["query"])
        p = defined_embeddings(model.doc_embedding.weight, every["doc"])
        n = defined_embeddings(model.doc_embedding.weight, every["neg"].flatten(0, 1))
        ids = torch.arange(len(p) + len(n))
        want = reference_sigmoid(q, p, n, model.logit_scale.exp(), model.logit_bias, ids, FalseNegatives())
        assert_step_is(trainer, steps, model, want)
