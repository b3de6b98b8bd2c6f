"""The model card `export` leaves (`model_card.py`): read back by huggingface_hub's `ModelCard` as the Hub reads it;
the target library's own card kept (sentence-transformers' usage), its metadata completed; the evaluation table the
values the checkpoint's manifest recorded; the settings' overrides rebuild the run's config through `parse_args`;
the base model named only where `model.path` names a Hugging Face model; no card for a source that is not ours."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import asdict
from pathlib import Path

import pytest

from tests.needs import needs
from titan_contrastive.config import parse_args
from titan_contrastive.model_card import BUNDLED, base_model, eval_results, overrides, write_card


def _without_job(config: dict) -> dict:
    return {section: values for section, values in config.items() if section != "job"}


@pytest.mark.parametrize(
    ("path", "family", "want"),
    [
        ("", "bi_encoder", BUNDLED),
        ("", "clip", None),  # built from scratch
        ("BAAI/bge-small-en-v1.5", "bi_encoder", "BAAI/bge-small-en-v1.5"),  # a hub id (from the local cache)
        ("/cache/hub/models--Qwen--Qwen2-VL-2B-Instruct/snapshots/0a1b", "qwen_vl", "Qwen/Qwen2-VL-2B-Instruct"),
        ("/models/my-encoder", "bi_encoder", None),  # a folder of one's own
    ],
)
def test_the_base_model(path: str, family: str, want: str | None) -> None:
    assert base_model(path, family) == want


def test_a_local_folder_named_like_a_hub_id_is_no_base_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "org" / "model").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert base_model("org/model", "bi_encoder") is None


def test_the_overrides_rebuild_the_config() -> None:
    cfg = parse_args(
        [
            "--data.dataset=emoji",
            "--training.steps=7",
            "--optimizer.lr=3e-05",
            "--loss.matryoshka_dims=16,8",
            "--model.query_prompt=query: a, b ",
            "--lr_scheduler.decay_ratio=0.25",
            "--eval.freq=2",
            "--job.description=left out",
        ]
    )
    args = overrides(asdict(cfg))
    assert "--training.steps=7" in args and "--loss.matryoshka_dims=[16, 8]" in args
    assert not any(a.startswith("--job.") for a in args)
    rebuilt = parse_args(shlex.split(shlex.join(args)))  # as the card's shell block hands them over
    assert _without_job(asdict(rebuilt)) == _without_job(asdict(cfg))
    assert overrides({"model": {"no_such_key": 1}, "nowhere": {"x": 2}}) == []  # keys of another version


def test_a_local_base_model_is_replaced_or_dropped(tmp_path: Path) -> None:
    """PEFT's card names the folder the base was loaded from, which the Hub cannot read: the run's hub id in its
    place (in the adapter tag too), or nothing where the run names none."""
    from huggingface_hub import ModelCard

    peft = "---\nbase_model: /data/base\ntags:\n- base_model:adapter:/data/base\n- lora\n---\n\n# Model Card\n"
    for path, want in (("/hf/hub/models--BAAI--bge-small-en-v1.5/snapshots/1", "BAAI/bge-small-en-v1.5"), ("/x", None)):
        src, out = tmp_path / "step-3", tmp_path / f"out-{want is None}"
        src.mkdir(exist_ok=True)
        epochs = {} if want else {"epochs": 2}  # a run given in epochs: its steps field is not its length
        config = {"model": {"path": path}, "training": {"local_batch_size": 4, "steps": 5, **epochs}}
        (src / "manifest.json").write_text(json.dumps({"step": 3, "model": {"family": "bi_encoder"}, "config": config}))
        out.mkdir()
        (out / "README.md").write_text(peft)
        write_card(src, out, "peft", "adapter")
        card = ModelCard.load(out / "README.md")
        assert card.data.base_model == want and card.data.library_name == "peft"
        adapter = [f"base_model:adapter:{want}"] if want else []
        assert card.data.tags == ["lora", "titan-contrastive", *adapter], card.data.tags
        length = "5 steps." if want else "a run of 2 epoch(s)."
        assert "# Model Card" in card.text and f"from checkpoint `step-3` of {length}" in card.text


def test_a_source_that_is_not_ours_gets_no_card(tmp_path: Path) -> None:
    write_card(tmp_path / "hf-clip", tmp_path, "hf", "out")
    assert not (tmp_path / "README.md").exists()


@needs("hf")
def test_exports_carry_the_run_card(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from huggingface_hub import ModelCard

    from tests.test_hf_text import folder_run
    from titan_contrastive.export import main as export_main

    triplets = tmp_path / "my_triplets.jsonl"
    rows = [("a cat", "cats", "a car"), ("the sea", "an ocean", "a desert"), ("red", "crimson", "blue")]
    triplets.write_text("".join(json.dumps(dict(zip(("anchor", "positive", "negative"), r))) + "\n" for r in rows))
    run = folder_run(
        tmp_path, "encoder", "--training.local_batch_size=4", "--training.global_batch_size=8", "--training.steps=2",
        "--checkpoint.enable=true", "--eval.enable=true", f"--data.val_path={tmp_path / 'pairs.jsonl'}",
        "--eval.freq=1", "--model.query_prompt=query: ", f"--eval.triplet_path={triplets}",
    )  # fmt: skip
    run.train()
    run.metrics.close()
    step = tmp_path / "run-encoder" / "checkpoint" / "step-2"
    manifest = json.loads((step / "manifest.json").read_text())
    for to, library in (("sentence-transformers", "sentence-transformers"), ("hf", "transformers")):
        out = tmp_path / to
        assert export_main([str(step), "--to", to, "--out", str(out)]) == 0
        card = ModelCard.load(out / "README.md")
        assert card.data.library_name == library and "titan-contrastive" in card.data.tags
        assert card.data.base_model is None  # a tiny folder of the test's own
        assert "from checkpoint `step-2` of 2 steps" in card.text
        assert "A step's batch: 8 (4 a microbatch x 2 accumulation steps x 1 data-parallel rank(s))." in card.text
        table = dict(re.findall(r"^\| (\S+) \| ([-\d.]+) \|$", card.text, re.MULTILINE))
        recorded = {k: v for k, v in manifest["eval"].items() if k != "num_samples"}
        assert table.keys() == recorded.keys() and recorded
        assert all(abs(float(table[k]) - v) <= 5e-5 for k, v in recorded.items())
        (result,) = card.data.eval_results  # the set's, in the Hub's model-index; the run's own split's in the table
        assert (result.task_type, result.dataset_name, result.metric_type) == (
            "triplet",
            "my_triplets",
            "cosine_accuracy",
        )
        assert result.metric_value == recorded["triplet/cosine_accuracy"] and result.dataset_split is None
        assert card.data.model_name == to
        block = card.text.split("```bash\n")[-1].split("```")[0]  # ours, the last
        args = shlex.split(block.replace("\\\n", " "))[3:]  # after `python -m titan_contrastive.train`
        assert _without_job(asdict(parse_args(args))) == _without_job(manifest["config"])
        assert "README.md" in json.loads(next(out.glob(".titan_contrastive_export*")).read_text())["files"]
    assert "model = SentenceTransformer(" in ModelCard.load(tmp_path / "sentence-transformers" / "README.md").text
    assert 'AutoModel.from_pretrained("hf")' in ModelCard.load(tmp_path / "hf" / "README.md").text
    capsys.readouterr()


def test_the_sets_scores_are_the_hubs_results() -> None:
    """Only the keys of the evaluation sets (`EVAL_SETS`) become model-index results; a folder's split is named."""
    config = {"eval": {"beir_path": "/data/scifact/", "beir_split": "test", "sts_path": "/data/stsb.csv"}}
    scores = {"beir/ndcg@10": 0.5, "dim64/beir/ndcg@10": 0.4, "sts/spearman_cosine": 0.8, "r@1": 0.9, "loss": 1.2}
    got = [
        (r.task_type, r.dataset_name, r.dataset_split, r.metric_type, r.metric_value)
        for r in eval_results(scores, config)
    ]
    assert got == [
        ("information-retrieval", "scifact", "test", "ndcg@10", 0.5),
        ("semantic-similarity", "stsb", None, "spearman_cosine", 0.8),
    ]
    assert eval_results(scores, {"eval": {}}) == []
