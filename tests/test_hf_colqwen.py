"""transformers' own ColQwen2 folders (`ColQwen2ForRetrieval`, vidore's `-hf` ports: the Qwen2-VL under `vlm.`, the
projection `embedding_proj_layer`) read as the colpali-engine folder of the same weights: the tower, the projection
and the width; a text query's token embeddings equal transformers' own model's on it (their positions agree where
there is no image); a run and the evaluation command take it as ColQwen."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from tests.hf_folders import vl_folder
from tests.needs import require
from tests.test_qwen_vl import vl_run

require("hf")


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, object]:
    """(transformers' ColQwen2 folder, the colpali-engine folder of the same weights, the ColQwen2ForRetrieval)."""
    from transformers import AutoConfig
    from transformers.models.colqwen2 import ColQwen2Config, ColQwen2ForRetrieval

    from titan_contrastive.models.bi_encoder.tower import load_text_tower
    from titan_contrastive.models.qwen_vl.colpali import write_colpali

    root = tmp_path_factory.mktemp("hf-colqwen")
    base = vl_folder(root, "qwen2_vl", dropout=0.0)
    tower = load_text_tower(str(base))
    torch.manual_seed(3)
    theirs = ColQwen2ForRetrieval(
        ColQwen2Config(vlm_config=AutoConfig.from_pretrained(base).to_dict(), embedding_dim=8)
    )
    theirs.vlm.load_state_dict(tower.state_dict())
    theirs.save_pretrained(root / "hf")
    write_colpali(tower, theirs.embedding_proj_layer, root / "colpali")
    for out in (root / "hf", root / "colpali"):
        for file in base.iterdir():  # the tokenizer and the image processor
            if not (out / file.name).exists():
                (out / file.name).write_bytes(file.read_bytes())
    return root / "hf", root / "colpali", theirs.eval()


def test_the_folder_reads_as_the_colpali_folder_of_its_weights(folders) -> None:  # noqa: ANN001
    from titan_contrastive.models.bi_encoder.folder import load_config
    from titan_contrastive.models.bi_encoder.tower import load_text_tower
    from titan_contrastive.models.qwen_vl.colpali import read_projection

    hf, colpali, theirs = folders
    assert load_config(str(hf)).model_type == "qwen2_vl"
    mine, want = load_text_tower(str(hf)).state_dict(), theirs.vlm.state_dict()
    assert mine.keys() == want.keys() and all(torch.equal(mine[k], want[k]) for k in want)
    projection = read_projection(str(hf))
    assert torch.equal(projection["weight"], theirs.embedding_proj_layer.weight)
    assert torch.equal(projection["bias"], theirs.embedding_proj_layer.bias)
    assert json_type(hf) == "colqwen2"  # the folder itself is left as it was


def json_type(folder: Path) -> str:
    import json

    return json.loads((folder / "config.json").read_text())["model_type"]


def test_a_run_on_it_is_a_run_on_the_colpali_folder(tmp_path: Path, folders) -> None:  # noqa: ANN001
    """qwen_vl runs on both folders (ColBERT pooling) build the same args but the path, the same weights, and the
    same embeddings of a text query, which transformers' ColQwen2ForRetrieval gives too."""
    hf, colpali, theirs = folders
    runs = [
        vl_run(
            tmp_path / name, "qwen2_vl", f"--model.path={folder}", "--model.pooling=colbert", "--training.dtype=float64"
        )
        for name, folder in (("hf", hf), ("colpali", colpali))
    ]
    a, b = (dataclasses.replace(r.model.args, path="") for r in runs)
    assert a == b and a.colbert_dim == 8
    mine, other = (r.model.state_dict() for r in runs)
    assert all(torch.equal(mine[k], other[k]) for k in other)
    model = runs[0].model.eval()
    ids = model.args.processor().proc.encode("{text}", ["a photo of a cat"], None)["ids"]
    with torch.no_grad():
        ours = model.embed(ids, side="query").view(1, -1, 8)[:, : ids.shape[1]]
        want = theirs.double()(input_ids=ids, attention_mask=torch.ones_like(ids)).embeddings
    torch.testing.assert_close(ours, want, rtol=1e-10, atol=1e-12)
    for run in runs:
        run.metrics.close()


def test_the_evaluation_command_reads_it_as_colqwen(folders) -> None:  # noqa: ANN001
    from titan_contrastive.evaluate import is_vl_folder, load_vl_model

    hf, _, _ = folders
    assert is_vl_folder(str(hf))
    args, model = load_vl_model(str(hf))
    assert args.pooling == "colbert" and model.token_dim == 8
