"""WordNet pairs bundle and the bi_encoder family (pretrained MiniLM; optional `.[hf]` extra).

The bundle checks need nothing extra; the model checks skip cleanly without transformers and
the offline weights package.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest
import torch

from tests.needs import needs
from titan_contrastive.datasets import DataError, build_dataset
from titan_contrastive.datasets.wordnet import BUNDLE_DIR, load_pairs, load_rows
from titan_contrastive.losses import InfoNCE, split_documents
from titan_contrastive.losses.base import columns

REL = 1e-10


def write_wordnet(folder: Path, train: list[str], test: list[str]) -> Path:
    """A `data.path` folder in the bundle's format from its lines (`definition<TAB>lemma[<TAB>negative]`)."""
    folder.mkdir(parents=True, exist_ok=True)
    for split, lines in (("train", train), ("test", test)):
        (folder / f"pairs_{split}.tsv.gz").write_bytes(gzip.compress("".join(f"{x}\n" for x in lines).encode()))
    return folder


def bundle_subset(folder: Path, rows: int = 200) -> Path:
    """The bundle's first `rows` training and test lines (mined negatives included): a trainer
    test pre-tokenizes a few hundred pairs, not all 117,659."""
    train, test = (["\t".join(row) for row in load_rows(BUNDLE_DIR, split)[:rows]] for split in ("train", "test"))
    return write_wordnet(folder, train, test)


def test_bundle_split_is_held_out_with_unique_lemmas() -> None:
    train_defs, train_lemmas = load_pairs(BUNDLE_DIR, "train")
    test_defs, test_lemmas = load_pairs(BUNDLE_DIR, "test")
    assert len(test_defs) == 2000 and len(train_defs) == 115_659
    assert len({lemma.lower() for lemma in test_lemmas}) == 2000  # one right answer per definition
    assert not {lemma.lower() for lemma in test_lemmas} & {lemma.lower() for lemma in train_lemmas}
    assert not set(test_defs) & set(train_defs)
    assert (BUNDLE_DIR / "LICENSE").read_text().startswith("Format:")


def test_dataset_and_tokenizer_pairing_errors(tmp_path: Path) -> None:
    with pytest.raises(
        DataError, match="data.dataset='wordnet' is text-to-text and needs a model family with a tokenizer"
    ):
        build_dataset("wordnet", "test")
    with pytest.raises(DataError, match="data.dataset='fashion_mnist' is image-text"):
        build_dataset("fashion_mnist", "test", tokenizer=object())
    with pytest.raises(DataError, match="pairs_test.tsv.gz not found"):
        build_dataset("wordnet", "test", path=str(tmp_path), tokenizer=object())


@needs("hf")
def test_bi_encoder_params_shapes_and_gradcache_with_real_dropout(tmp_path: Path) -> None:
    """GradCache in the trainer on MiniLM (which has dropout) == dense autograd over the same
    chunks with the same RNG sequence, float64; the bundle's mined negative is a column of every query."""
    from titan_contrastive.config import parse_args
    from titan_contrastive.train import Trainer

    data = bundle_subset(tmp_path / "wordnet")

    def make(name: str, *extra: str) -> Trainer:
        return Trainer(
            parse_args(
                [
                    "--model.name=bi_encoder",
                    "--model.flavor=shared",
                    "--data.dataset=wordnet",
                    f"--data.path={data}",
                    "--training.dtype=float64",
                    "--training.max_norm=0",
                    "--training.local_batch_size=6",
                    "--data.context_length=24",
                    "--metrics.enable_tensorboard=false",
                    f"--job.dump_folder={tmp_path / name}",
                    *extra,
                ]
            )
        )

    cached = make("cached", "--gradcache.enabled=true", "--gradcache.chunk_sizes=4")
    model = cached.model
    assert cached.model_args.num_params() == sum(p.numel() for p in model.parameters())
    batch = cached.train_set.__getitems__(list(range(6)))
    q, d, scale = model(batch["query"], batch["doc"])
    assert q.shape == d.shape == (6, 384) and torch.allclose(q.norm(dim=1), torch.ones(6, dtype=q.dtype))
    init = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(7)
    out = cached.train_step([batch])
    got = {n: p.grad.clone() for n, p in model.named_parameters()}

    model.load_state_dict(init)
    model.zero_grad()
    torch.manual_seed(7)
    parts = [cached.step_context.encode({k: v[s : s + 4] for k, v in batch.items()}) for s in (0, 4)]
    assert batch["neg"].shape[:2] == (6, 1)
    docs = columns(*split_documents(torch.cat([p[1] for p in parts])))  # positives, then the negatives
    loss = InfoNCE().dense(torch.cat([p[0] for p in parts]), docs, parts[0][2])
    loss.backward()
    assert abs(out["loss"] - loss.item()) <= REL * loss.item()
    for name, p in model.named_parameters():
        err = ((got[name] - p.grad).norm() / p.grad.norm()).item()
        assert err <= REL, f"{name}: {err:.2e}"
    cached.metrics.close()
