"""MMEB's evaluation (`[eval] mmeb_path`, VLM2Vec's MMEB-eval rows): sets read in the hub's layout and as a file, each
in the mode its items hold, VLM2Vec's image placeholders out of the texts; a run's `mmeb/.../hit@1` equal to the
share of rows whose query, embedded alone, scores its first candidate, embedded alone, highest; on 2 and 4 gloo
processes the same; what cannot be read is one line."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from tests.dist_utils import TWO_AND_FOUR, run_distributed
from tests.hf_folders import vl_folder
from tests.needs import require
from tests.test_qwen_vl import vl_run
from tests.test_qwen_vl_pairs import _vl_pairs
from titan_contrastive.components.mmeb_eval import hits
from titan_contrastive.datasets.base import DataError
from titan_contrastive.datasets.mmeb_sets import read_mmeb

require("data")

LABELS = ["cat", "dog", "frozen water", "roof"]


def _mmeb(root: Path) -> Path:
    """A folder of two MMEB sets over `_vl_pairs`' images: `cls` in the hub's layout (`cls/test-....parquet`: an
    image and an instruction a query, the labels its candidates, the right one first) and `ret.jsonl` (a caption a
    query, three image-and-instruction candidates), image paths relative to `root`/data, VLM2Vec's placeholders in
    the texts."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    _vl_pairs(root / "data")
    (root / "mmeb" / "cls").mkdir(parents=True)
    rows = {c: [] for c in ("qry_text", "qry_img_path", "tgt_text", "tgt_img_path")}
    for i in range(7):
        rows["qry_text"].append("<|image_1|>\nRepresent the given image for classification")
        rows["qry_img_path"].append(f"img/q{i}.png")
        rows["tgt_text"].append(LABELS[i % 4 :] + LABELS[: i % 4])
        rows["tgt_img_path"].append([""] * 4)
    pq.write_table(pa.table(rows), root / "mmeb" / "cls" / "test-00000-of-00001.parquet")
    lines = []
    for i in range(6):
        others = [(i + 1) % 9, (i + 4) % 9]
        lines.append(
            {
                "qry_text": f"Find me an everyday image that matches the given caption: a dog {i}",
                "qry_img_path": "",
                "tgt_text": ["<|image_1|>\nRepresent the given image."] * 3,
                "tgt_img_path": [f"img/d{j}.png" for j in (i, *others)],
            }
        )
    (root / "mmeb" / "ret.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return root / "mmeb"


def test_the_sets_are_read_each_in_its_mode(tmp_path: Path) -> None:
    folder = _mmeb(tmp_path)
    sets = read_mmeb(str(folder), str(tmp_path / "data"))
    assert list(sets) == ["ret", "cls"]  # the folder's files, then its sub-folders
    cls, ret = sets["cls"], sets["ret"]
    assert (cls.mode, ret.mode) == ("m2t", "t2m")
    assert cls.queries[0] == ("Represent the given image for classification", str(tmp_path / "data/img/q0.png"))
    assert cls.candidates == [(label, "") for label in LABELS]  # each label once
    assert cls.rows[1][0] == 1 and cls.rows[1][1].tolist() == [1, 2, 3, 0] and len(cls.rows) == 7
    assert ret.candidates[0] == ("Represent the given image.", str(tmp_path / "data/img/d0.png"))
    assert ret.rows[2][1][0] == ret.candidates.index(("Represent the given image.", str(tmp_path / "data/img/d2.png")))
    assert len(ret.candidates) == len({j for i in range(6) for j in (i, (i + 1) % 9, (i + 4) % 9)})
    assert list(read_mmeb(str(folder / "ret.jsonl"), str(tmp_path / "data"))) == ["ret"]


def test_hits_are_the_first_candidate_scored_highest() -> None:
    queries = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    candidates = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    assert hits(queries, candidates, [(0, [0, 1]), (1, [0, 1]), (0, [2, 0]), (1, [1, 2])]) == [True, False, True, True]


def _reference(process, model, sets, m: int = 0) -> dict[str, float]:  # noqa: ANN001
    """Each set's share of rows whose query, embedded alone by `model` (its inputs made by `process`, its side
    processor), scores its right candidate, embedded alone, highest (the first of equal scores); with `m`, each
    embedding's first m dims normalized again (keys `dim{m}/...`)."""
    import numpy as np

    from titan_contrastive.datasets.image_transforms import decode_image
    from titan_contrastive.datasets.retrieval import side_kinds

    def one(item, side: str, kind: str) -> torch.Tensor:
        text, path = item
        image = [np.asarray(decode_image(Path(path).read_bytes()))] if kind != "text" else None
        ids = process.proc.encode(process.template(side, mode), [text if kind != "image" else ""], image)
        grid = (ids["pixel_values"].double(), ids["image_grid_thw"]) if image else (None, None)
        vector = model.embed(ids["ids"], *grid, side)[0]
        return vector[:m] / vector[:m].norm() if m else vector

    out = {}
    model.eval()
    with torch.no_grad():
        for name, task in sets.items():
            mode, kinds = task.mode, side_kinds(task.mode)
            right = 0
            for q, own in task.rows:
                query = one(task.queries[q], "query", kinds["query"])
                scores = torch.stack([one(task.candidates[c], "doc", kinds["doc"]) @ query for c in own])
                right += int(scores.argmax()) == 0
            out[f"{f'dim{m}/' if m else ''}mmeb/{name}/hit@1"] = right / len(task.rows)
    return out


def _trainer(tmp: Path, *extra: str):
    rows = tmp / "train" / "pairs.jsonl"
    if not rows.is_file():
        _vl_pairs(tmp / "train")
    return vl_run(
        tmp,
        "qwen2_vl",
        "--data.dataset=vl_pairs",
        f"--data.path={rows}",
        "--data.retrieval_mode=m2i",
        "--eval.enable=true",
        f"--eval.mmeb_path={tmp / 'mmeb'}",
        f"--eval.mmeb_image_root={tmp / 'data'}",
        "--eval.batch_size=3",
        "--training.local_batch_size=2",
        "--training.dtype=float64",  # no near tie of a random model's scores turned by another batch's rounding
        *extra,
        sizes=(),
    )


def test_a_run_scores_each_set_as_its_items_alone(tmp_path: Path) -> None:
    """The run (trained in m2i) evaluates an m2t and a t2m set in batches of 3: each set's hit@1 is the reference's,
    at the embeddings' first 16 dims too (`eval.dims`), the mean is theirs, and the query counts are the rows'."""
    _mmeb(tmp_path)
    trainer = _trainer(tmp_path, "--eval.dims=16")
    results = trainer.evaluate()
    for m, cut in ((0, ""), (16, "dim16/")):
        want = _reference(trainer.model_args.processor(), trainer.model, trainer.text_evals.mmeb, m)
        for key, value in want.items():
            assert results[key] == pytest.approx(value, abs=1e-12), key
        assert results[f"{cut}mmeb/hit@1"] == pytest.approx(sum(want.values()) / 2, abs=1e-12)
    assert (results["mmeb/cls/num_queries"], results["mmeb/ret/num_queries"]) == (7, 6)
    assert 0 < results["mmeb/cls/hit@1"] < 1 or 0 < results["mmeb/ret/hit@1"] < 1  # the scores decide something
    trainer.metrics.close()


def _ranks(tmp: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    trainer = _trainer(Path(tmp) / "ranks")
    results = trainer.evaluate()
    if dist.get_rank() == 0:
        (Path(tmp) / "ranks.json").write_text(json.dumps({k: v for k, v in results.items() if k.startswith("mmeb")}))
    trainer.metrics.close()


@pytest.mark.parametrize("world", TWO_AND_FOUR)
def test_ranks_score_as_one(tmp_path: Path, world: int) -> None:
    """On 2 and 4 gloo processes (each embedding its shard of every set's queries and candidates, some shards one
    short) the metrics are one process's."""
    _mmeb(tmp_path / "one")
    _vl_pairs(tmp_path / "one" / "train")
    vl_folder(tmp_path / "one", "qwen2_vl")
    shutil.copytree(tmp_path / "one", tmp_path / "ranks")  # the same model, rows and images
    trainer = _trainer(tmp_path / "one")
    one = {k: v for k, v in trainer.evaluate().items() if k.startswith("mmeb")}
    trainer.metrics.close()
    run_distributed(_ranks, world, str(tmp_path))
    assert json.loads((tmp_path / "ranks.json").read_text()) == pytest.approx(one, abs=1e-12)


def test_what_cannot_be_read_is_one_line(tmp_path: Path) -> None:
    folder = _mmeb(tmp_path)
    gone = (
        r"^eval.mmeb_path: .*ret.jsonl: 9 image\(s\) not found, the first .*mmeb/img/d0.png'; set eval.mmeb_image_root"
    )
    with pytest.raises(DataError, match=gone):
        read_mmeb(str(folder))  # the images are beside data/, not the files
    with pytest.raises(DataError, match=r"^eval.mmeb_path='.*nowhere' is neither a file nor a folder"):
        read_mmeb(str(tmp_path / "nowhere"))
    (tmp_path / "bad.jsonl").write_text(json.dumps({"qry_text": "a", "tgt_text": ["b"]}) + "\n")
    with pytest.raises(
        DataError, match=r"^eval.mmeb_path: .*bad.jsonl: row 0 has no column qry_img_path, tgt_img_path;"
    ):
        read_mmeb(str(tmp_path / "bad.jsonl"))
    row = {"qry_text": "a", "qry_img_path": "", "tgt_text": ["b", "c"], "tgt_img_path": ["img/d0.png", ""]}
    (tmp_path / "mixed.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(DataError, match=r"^eval.mmeb_path: .*mixed.jsonl: a doc without an image \('c'\) beside"):
        read_mmeb(str(tmp_path / "mixed.jsonl"), str(tmp_path / "data"))
    from titan_contrastive.components.text_evals import TextEvals
    from titan_contrastive.config import ConfigError
    from titan_contrastive.config.job_config import Eval

    ev = Eval(mmeb_path=str(folder), mmeb_image_root=str(tmp_path / "data"))
    with pytest.raises(ConfigError, match=r"^eval.mmeb_path='.*': MMEB's .* evaluate it with a qwen_vl model"):
        TextEvals.from_config(ev, lambda batch: batch, None)  # a text model's pair tokenizer fills no sides
    from titan_contrastive.config import parse_args

    best = ["--checkpoint.enable=true", "--checkpoint.interval=2", "--eval.freq=2", "--checkpoint.keep_best=mmeb/hit@1"]
    parse_args([*best, f"--eval.mmeb_path={folder}"])  # an MMEB set is something to evaluate
    with pytest.raises(ConfigError, match=r"keep_best='mmeb/hit@1' is an MMEB metric and eval.mmeb_path is empty"):
        parse_args([*best, "--data.val_path=x.jsonl"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"^eval.mmeb_path='.*empty': no set in it"):
        read_mmeb(str(tmp_path / "empty"))


def test_the_command_scores_a_qwen_vl_folder_as_its_items_alone(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`python -m titan_contrastive.evaluate FOLDER --mmeb DIR` (no BEIR set unless asked) on a Qwen-VL folder in
    float64: each set's hit@1 the reference's; its bad input one line."""
    from titan_contrastive.evaluate import load_vl_model, main

    folder = vl_folder(tmp_path, "qwen2_vl", dropout=0.0)
    mmeb, out = _mmeb(tmp_path), tmp_path / "out.json"
    argv = [str(folder), "--mmeb", str(mmeb), "--batch-size", "3", "--dtype", "float64"]
    assert main([*argv, "--mmeb-image-root", str(tmp_path / "data"), "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    assert "beir" not in got and not any(k.startswith("ndcg") for k in got)
    args, model = load_vl_model(str(folder))
    want = _reference(args.processor(), model.double(), read_mmeb(str(mmeb), str(tmp_path / "data")))
    for name, value in want.items():
        assert got[name] == pytest.approx(value, abs=1e-12), name
    for bad, message in [
        (argv, "--mmeb: .*ret.jsonl: 9 image\\(s\\) not found, .* set --mmeb-image-root to"),
        (["", "--mmeb", str(mmeb), "--mmeb-image-root", str(tmp_path / "data")], "--mmeb: for a Qwen-VL model folder"),
    ]:
        assert main(bad) == 2
        err = capsys.readouterr().err.strip()
        assert re.match(f"^error: {message}", err) and "\n" not in err, err
