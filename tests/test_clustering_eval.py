"""Clustering evaluation (`components/clustering_eval.py`, `[eval] clustering_path`, `python -m
titan_contrastive.evaluate --clustering`): MTEB's V-measure of each row's k-means clusters, averaged; clusters apart in
the embedding found exactly (1.0), labels the embedding does not separate scored below; each sentence embedded once
whatever rows repeat it; 2 gloo processes give what 1 gives; through the trainer and the command, with the best
checkpoint kept by it; bad input is one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from tests.eval_runs import keep_best_run
from tests.needs import needs
from tests.test_retrieval_metrics import write_beir
from titan_contrastive.components.clustering_eval import evaluate_clustering, load_clustering
from titan_contrastive.datasets.base import DataError

pytestmark = needs("hf")  # scikit-learn comes with the [hf] extra

APART = {
    "a": ["aaaa b", "aaa bb", "aaaaa", "aaaab", "baaaa"],
    "z": ["zzzz y", "zzz yy", "zzzzz", "zzzzy", "yzzzz"],
    "m": ["mmmm n", "mmm nn", "mmmmm", "mmmmn", "nmmmm"],
}
ROWS = [
    {"sentences": [s for group in APART.values() for s in group], "labels": [k for k, g in APART.items() for _ in g]},
    {"sentences": ["aaaa b", "zzzz y", "aaa bb", "zzz yy"], "labels": [1, 1, 2, 2]},  # labels across the groups
    {"sentences": ["mmmmm", "aaaaa"], "labels": ["x", "x"]},  # one label: 1.0, as mteb counts it
]


def write_rows(file: Path, rows: list[dict] = ROWS) -> Path:
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return file


def _letters(texts: list[str]) -> torch.Tensor:
    """A fixed embedding of each text without a model: counts of its letters (a..z)."""
    return torch.tensor([[t.count(c) for c in "abcdefghijklmnopqrstuvwxyz"] for t in texts], dtype=torch.float64)


def test_clusters_apart_are_found_and_the_rest_scored_as_mteb(tmp_path: Path) -> None:
    from sklearn.cluster import MiniBatchKMeans
    from sklearn.metrics import v_measure_score

    task = load_clustering(str(write_rows(tmp_path / "clusters.jsonl")))
    assert len(task.rows) == 3 and len(task.sentences) == 15  # row 2 repeats row 1's sentences; row 3 not embedded
    got = evaluate_clustering(task, _letters, batch_size=4, dims=(3,))
    want = []
    for row in ROWS[:2]:  # mteb 2's AbsTaskClusteringLegacy and ClusteringEvaluator, written out
        vectors = np.stack([_letters([s])[0].numpy() for s in row["sentences"]])
        kmeans = MiniBatchKMeans(n_clusters=len(set(row["labels"])), batch_size=500, n_init="auto", random_state=42)
        want.append(v_measure_score(row["labels"], kmeans.fit(vectors).labels_))
    want.append(1.0)  # a row of one label
    assert want[0] == 1.0 and want[1] < 1.0  # the groups apart are found; labels across them are not
    assert got["clustering/v_measure"] == pytest.approx(np.mean(want), abs=1e-12)
    assert 0 <= got["dim3/clustering/v_measure"] <= 1  # the first 3 letters (a, b, c): z and m look alike there
    assert got["dim3/clustering/v_measure"] < got["clustering/v_measure"]


def _on_ranks(file: str, out: str) -> None:
    dist.init_process_group("gloo")
    results = evaluate_clustering(load_clustering(file), _letters, batch_size=2, rank=dist.get_rank(), world_size=2)
    torch.save(results, Path(out) / f"rank{dist.get_rank()}.pt")


def test_two_processes_give_what_one_gives(tmp_path: Path) -> None:
    file = write_rows(tmp_path / "clusters.jsonl")
    one = evaluate_clustering(load_clustering(str(file)), _letters, batch_size=2)
    run_distributed(_on_ranks, 2, str(file), str(tmp_path))
    for rank in range(2):
        assert torch.load(tmp_path / f"rank{rank}.pt") == one


def test_training_and_the_command_measure_it(tmp_path: Path) -> None:
    from titan_contrastive.evaluate import main

    file = write_rows(tmp_path / "clusters.jsonl")
    evals = keep_best_run(tmp_path, "clustering_path", file, "clustering/v_measure")
    assert all(0 <= e["clustering/v_measure"] <= 1 for e in evals)
    out = tmp_path / "out.json"
    beir = write_beir(tmp_path / "beir")
    assert main(["", "--beir", str(beir), "--clustering", str(file), "--out", str(out)]) == 0  # the bundled MiniLM
    assert 0 <= json.loads(out.read_text())["clustering/v_measure"] <= 1


def test_bad_files_are_one_line(tmp_path: Path) -> None:
    (tmp_path / "columns.jsonl").write_text(json.dumps({"sentences": ["a"], "label": ["x"]}) + "\n")
    uneven = write_rows(tmp_path / "uneven.jsonl", [{"sentences": ["a", "b"], "labels": ["x"]}])
    single = write_rows(tmp_path / "single.jsonl", [{"sentences": ["a", "b"], "labels": ["x", "x"]}])
    for path, message in (
        (tmp_path / "missing.jsonl", "does not exist; give a .jsonl, .json or .parquet file of sentences, labels"),
        (tmp_path / "columns.jsonl", "row 0 has no column labels; its rows hold sentences, labels"),
        (uneven, "row 0 holds 2 sentence(s) and 1 label(s); give a text and a label for each"),
        (single, "no row with two labels or more"),
    ):
        with pytest.raises(DataError) as err:
            load_clustering(str(path))
        assert str(err.value).startswith(f"eval.clustering_path='{path}'") and message in str(err.value)
        assert "\n" not in str(err.value)


def test_a_late_interaction_model_is_refused_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The command on a ColBERT folder with sets that compare one vector per text: one line naming them, exit 2."""
    from tests.colbert_folders import colbert_encoder, pylate_folder
    from titan_contrastive.evaluate import main

    folder = pylate_folder(colbert_encoder(tmp_path), 8)
    file = write_rows(tmp_path / "clusters.jsonl")
    capsys.readouterr()  # the folder's writing
    assert main([str(folder), "--clustering", str(file), "--sts", str(file.with_name("none.jsonl"))]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("error: ") and "none.jsonl" in err  # the files are read first
    from tests.test_sts_eval import write_sts

    sts = write_sts(tmp_path / "sts.jsonl")
    capsys.readouterr()
    assert main([str(folder), "--clustering", str(file), "--sts", str(sts)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --sts --clustering: ") and "embeds a text as its tokens (ColBERT)" in err, err
    assert "\n" not in err
