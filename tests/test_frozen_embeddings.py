"""A frozen model's embeddings written ahead (`[loss] teacher_embeddings`, `guide_embeddings`; `datasets/frozen.py`):
the file's two formats read alike, with or without sides; the data serves each row's own vectors (WordNet's rows
too, from a file no model wrote, vectors of any length); the step normalizes them (a file's vectors need not be
unit); what cannot work is a one-line error before any model is built; the `embed` command refuses bad arguments
in one line. That the step equals the definition with them is `tests/test_static_guide.py`'s."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from tests.needs import needs
from tests.test_static import ROWS, static_run
from titan_contrastive.datasets.base import DataError
from titan_contrastive.datasets.frozen import EmbeddingTable


def _write(path: Path, records: list[dict]) -> Path:
    """`records` as a .jsonl file, a .parquet one (embeddings as lists of float64), or an uncompressed .arrow one
    (lists of float32, in record batches of 4 rows)."""
    if path.suffix in (".parquet", ".arrow"):
        import pyarrow as pa
        import pyarrow.feather as feather
        import pyarrow.parquet as pq

        table = pa.Table.from_pylist(records)
        if path.suffix == ".parquet":
            pq.write_table(table, path)
        else:
            at = table.schema.get_field_index("embedding")
            table = table.set_column(at, "embedding", table.column(at).cast(pa.list_(pa.float32())))
            feather.write_feather(table, path, compression="uncompressed", chunksize=4)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _records(rows: list[tuple[str, ...]], width: int = 5, sided: bool = True, seed: int = 0) -> list[dict]:
    """Random vectors of norms 0.5 to 3 for every text of `rows`, per side (or one per text)."""
    g = torch.Generator().manual_seed(seed)
    keys = {("query" if sided else None, r[0]) for r in rows} | {
        ("document" if sided else None, t) for r in rows for t in r[1:]
    }
    out = []
    for side, text in sorted(keys, key=lambda k: (k[0] or "", k[1])):
        v = torch.randn(width, generator=g, dtype=torch.float64)
        v = v / v.norm() * (0.5 + 2.5 * torch.rand((), generator=g, dtype=torch.float64))
        out.append({"text": text, "embedding": v.tolist()} | ({"side": side} if sided else {}))
    return out


@needs("data")
@pytest.mark.parametrize("suffix", [".parquet", ".arrow"])
@pytest.mark.parametrize("sided", [True, False])
def test_the_formats_read_alike_and_find_each_rows_texts(tmp_path: Path, sided: bool, suffix: str) -> None:
    records = _records(ROWS, sided=sided)
    padded = [r | {"text": f" {r['text']}\t"} for r in records]  # surrounding whitespace is stripped, as data's is
    jsonl = EmbeddingTable.read(str(_write(tmp_path / "e.jsonl", padded)), "loss.teacher_embeddings")
    parquet = EmbeddingTable.read(str(_write(tmp_path / f"e{suffix}", records)), "loss.teacher_embeddings")
    every = torch.arange(len(records))
    assert torch.equal(jsonl.vectors[every], parquet.vectors[every]) and jsonl.sided == sided
    assert len(parquet.vectors.chunks) == (1 if suffix == ".parquet" else -(-len(records) // 4))
    keys = [(r.get("side", ""), r["text"]) for r in records]
    assert [jsonl.row(*k) for k in keys] == [parquet.row(*k) for k in keys] == list(range(len(records)))
    assert parquet.row("query" if sided else "", "not in the file") == -1
    queries, documents = parquet.find([q for q, _, _ in ROWS], [d for _, p, n in ROWS for d in (p, n)])
    at = torch.cat([queries[:, None], documents.view(len(ROWS), 2)], 1)
    for (q, p, n), row in zip(ROWS, at.tolist()):
        for side, text, i in (("query", q, row[0]), ("document", p, row[1]), ("document", n, row[2])):
            want = next(r for r in records if r["text"] == text and r.get("side", side) == side)["embedding"]
            assert parquet.vectors[i].tolist() == torch.tensor(want, dtype=torch.float32).tolist()


@needs("data")
def test_a_bad_file_is_one_line_naming_it(tmp_path: Path) -> None:
    good = _records(ROWS[:2])
    cases = [
        ("missing.parquet", None, r"not an existing \.parquet/\.jsonl/\.arrow file; write one with"),
        ("e.csv", good, r"not an existing \.parquet/\.jsonl/\.arrow file"),
        ("cols.jsonl", [{"text": "a", "vector": [1.0]}], "needs text and embedding"),
        ("ragged.jsonl", [*good[:1], {**good[1], "embedding": [1.0, 2.0]}], "embeddings of 2, 5 numbers"),
        ("zero.jsonl", [*good[:1], {**good[1], "embedding": [0.0] * 5}], "row 1's embedding is zero or not finite"),
        ("nan.parquet", [*good[:1], {**good[1], "embedding": [float("nan")] * 5}], "row 1's embedding is zero"),
        ("side.jsonl", [*good[:1], {**good[1], "side": "passage"}], "row 1's side is 'passage'; use query or document"),
        ("twice.jsonl", [*good, {**good[0], "embedding": [1.0] * 5}], "two different embeddings; keep one"),
        ("empty.jsonl", [], "no rows"),
    ]
    for name, records, message in cases:
        path = tmp_path / name if records is None else _write(tmp_path / name, records)
        with pytest.raises(DataError, match=rf"^loss.guide_embeddings={path}: ") as e:
            EmbeddingTable.read(str(path), "loss.guide_embeddings")
        assert "\n" not in str(e.value)
        assert e.match(message)
    table = EmbeddingTable.read(str(_write(tmp_path / "e.jsonl", good)), "loss.guide_embeddings")
    with pytest.raises(DataError, match=r"no embedding of 2 text\(s\) of the training data, e.g. document 'x'"):
        table.find([ROWS[0][0], ROWS[1][0]], [ROWS[0][1], "x", "y", ROWS[1][2]])


@needs("hf", "data")
def test_the_data_serves_each_rows_vectors_and_the_step_normalizes_them(tmp_path: Path) -> None:
    file = _write(tmp_path / "e.parquet", _records(ROWS, width=7))
    trainer = static_run(
        tmp_path, "--loss.symmetric=false", "--loss.distill=kl", f"--loss.teacher_embeddings={file}",
        "--training.local_batch_size=4",
    )  # fmt: skip
    assert trainer.step_context.guide is None and trainer.step_context.frozen_in_data
    table = EmbeddingTable.read(str(file), "loss.teacher_embeddings")
    batch = trainer.train_set.__getitems__([3, 0, 5])
    for i, row in enumerate([3, 0, 5]):
        q, p, n = ROWS[row]
        assert torch.equal(batch["frozen_query"][i], table.vectors[table.row("query", q)])
        assert torch.equal(batch["frozen_doc"][i, 0], table.vectors[table.row("document", p)])
        assert torch.equal(batch["frozen_doc"][i, 1], table.vectors[table.row("document", n)])
    guide = trainer.step_context.carried_guide([batch])
    assert guide.queries.dtype == torch.float64
    assert torch.allclose(guide.queries.norm(dim=-1), torch.ones(3, dtype=torch.float64), atol=1e-12, rtol=0)
    assert torch.allclose(guide.columns[:3], torch.nn.functional.normalize(batch["frozen_doc"][:, 0].double(), dim=-1))
    assert torch.isfinite(torch.tensor(trainer.train_step([batch])["loss"]))
    trainer.metrics.close()


@needs("hf", "data")
def test_wordnet_rows_are_served_from_a_file_no_model_wrote(tmp_path: Path) -> None:
    """One vector per text (no sides) for every text of the bundled WordNet train split, 3 numbers wide."""
    from titan_contrastive.datasets.wordnet import BUNDLE_DIR, load_rows

    rows = load_rows(BUNDLE_DIR, "train")
    texts = sorted({t for r in rows for t in r})
    vectors = torch.randn(len(texts), 3, generator=torch.Generator().manual_seed(0))
    import pyarrow as pa
    import pyarrow.parquet as pq

    file = tmp_path / "wordnet.parquet"
    pq.write_table(pa.table({"text": texts, "embedding": vectors.tolist()}), file)
    trainer = static_run(
        tmp_path, "--data.dataset=wordnet", "--data.path=", "--loss.guide_embeddings=" + str(file),
        "--loss.mask_margin=0.1",
    )  # fmt: skip
    picks = [0, 1234, len(rows) - 1]
    batch = trainer.train_set.__getitems__(picks)
    where = {t: i for i, t in enumerate(texts)}
    for i, row in enumerate(picks):
        assert torch.equal(batch["frozen_query"][i], vectors[where[rows[row][0]]])
        assert torch.equal(batch["frozen_doc"][i], vectors[[where[t] for t in rows[row][1:]]])


@needs("hf", "data")
def test_what_cannot_work_is_one_line_before_any_model(tmp_path: Path, guide_dir: Path) -> None:
    from titan_contrastive.config import ConfigError

    file = _write(tmp_path / "e.parquet", _records(ROWS))
    other = _write(tmp_path / "f.jsonl", _records(ROWS))
    kl = ["--loss.distill=kl", "--loss.symmetric=false"]
    cases = [
        (
            [*kl, f"--loss.teacher_embeddings={file}", f"--loss.teacher_model={guide_dir}"],
            r"^loss.teacher_model=.* and loss.teacher_embeddings=.*: a run holds one frozen model",
        ),
        (
            [*kl, f"--loss.teacher_embeddings={file}", f"--loss.guide_embeddings={other}", "--loss.mask_margin=0"],
            r"^loss.teacher_embeddings=.* and loss.guide_embeddings=.*: .*give both the same file",
        ),
        ([f"--loss.teacher_embeddings={file}"], r"^loss.teacher_embeddings=.* is empty: set loss.distill=kl"),
        ([f"--loss.guide_embeddings={file}"], r"^loss.guide_embeddings=.* neither is set: set loss.mask_margin"),
        (
            [*kl, f"--loss.teacher_embeddings={file}", "--data.dataset=synthetic"],  # its sides: image-text tests
            r"^data.dataset='synthetic' is image-text; the model family reads text pairs",
        ),
        (
            ["--loss.distill=margin_mse", f"--loss.teacher_embeddings={file}"],
            r"^loss.distill=margin_mse reads the data's scores .* and loss.teacher_embeddings scores every column",
        ),
    ]
    for extra, message in cases:
        with pytest.raises((ConfigError, DataError), match=message) as e:
            static_run(tmp_path, *extra)
        assert "\n" not in str(e.value)
    assert not (tmp_path / "run" / "checkpoint").exists()


@needs("hf", "data")
def test_the_embed_command_refuses_bad_arguments_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from tests.test_static import _rows
    from titan_contrastive.embed import main

    rows = _rows(tmp_path)
    (tmp_path / "taken.parquet").write_text("x")
    for argv, message in [
        ([str(rows), "--model", "m", "--out", str(tmp_path / "e.csv")], r"--out=.*e\.csv: write \.parquet/\.jsonl"),
        ([str(rows), "--model", "m", "--out", str(tmp_path / "taken.parquet")], "exists; choose a new file"),
        ([str(rows), "--model", "m", "--out", str(rows.with_suffix(".jsonl"))], "exists; choose a new file"),
        ([str(tmp_path / "no.jsonl"), "--model", "m", "--out", str(tmp_path / "e.jsonl")], "PAIRS=.*no.jsonl: not"),
        ([str(rows), "--model", str(tmp_path), "--out", str(tmp_path / "e.jsonl")], "--model=.*: not a bi_encoder"),
        ([str(rows), "--model", "m", "--out", str(tmp_path / "e.jsonl"), "--batch-size=0"], "--batch-size=0"),
    ]:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and re.search(message, err), err
    assert not (tmp_path / "e.jsonl").exists() and (tmp_path / "taken.parquet").read_text() == "x"


MSE_KINDS = {  # local batch, accumulation steps, options: the static model (8 wide) regressed onto 8-wide vectors
    "gradcache": (6, 1, ["--gradcache.enabled=true", "--gradcache.chunk_sizes=5", "--loss.contrastive_weight=0.5"]),
    "global": (3, 2, ["--loss.negatives=global", "--loss.stream_chunk_size=5", "--loss.distill_weight=3"]),
    "plain-alone": (6, 1, ["--loss.contrastive_weight=0", "--loss.learn_logit_scale=false"]),
}


def _mse_step(tmp: Path, kind: str, suffix: str = ".parquet") -> None:
    """One step of `kind` with loss.distill=mse against cw x InfoNCE over the whole batch + w x the mean squared
    difference of every text's embedding to the file's (normalized) vector, written from the definition."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from tests.dist_utils import write_once
    from tests.test_static import assert_step_is, defined_embeddings, defined_loss, float64_copy

    local, ga, args = MSE_KINDS[kind]
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    file = tmp / f"mse{suffix}"
    write_once(file, lambda: _write(file, _records(ROWS, width=8, seed=3)))
    trainer = static_run(
        tmp, f"--training.local_batch_size={local}", f"--training.global_batch_size={local * ga * world}",
        "--loss.symmetric=false", "--loss.distill=mse", f"--loss.teacher_embeddings={file}", *args,
    )  # fmt: skip
    assert "MSE of the embeddings to the teacher's" in trainer.gradient_step.describe()
    data, n = trainer.train_set, local * ga * world
    steps = [data.__getitems__(list(range(j * local * world, (j + 1) * local * world))) for j in range(ga)]
    mine = [{k: v[rank * local : (rank + 1) * local] for k, v in s.items()} for s in steps]
    every = {k: torch.cat([s[k] for s in steps]) for k in steps[0]}
    model = float64_copy(trainer)
    cfg = trainer.cfg.loss
    want = cfg.contrastive_weight * defined_loss(model, every, False) if cfg.contrastive_weight else 0.0
    table = EmbeddingTable.read(str(file), "loss.teacher_embeddings")
    assert table.vectors.mapped == (suffix == ".arrow")
    x = torch.cat(
        [
            defined_embeddings(model.query_embedding.weight, every["query"]),
            defined_embeddings(model.doc_embedding.weight, every["doc"]),
            defined_embeddings(model.doc_embedding.weight, every["neg"].flatten(0, 1)),
        ]
    )
    texts = [("query", r[0]) for r in ROWS[:n]] + [("document", r[1]) for r in ROWS[:n]]
    texts += [("document", r[2]) for r in ROWS[:n]]
    g = F.normalize(torch.stack([table.vectors[table.row(*key)] for key in texts]).double(), dim=-1)
    want = want + cfg.distill_weight * sum(((xi - gi) ** 2).sum() for xi, gi in zip(x, g)) / (len(texts) * 8)
    assert_step_is(trainer, mine, model, want)


@needs("hf", "data")
@pytest.mark.parametrize("kind", list(MSE_KINDS))
def test_a_static_model_regressed_onto_embeddings_written_ahead_is_as_defined(tmp_path: Path, kind: str) -> None:
    _mse_step(tmp_path, kind)


def _mse_distributed(tmp: str, suffix: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    _mse_step(Path(tmp), "global", suffix)


@needs("hf", "data")
@pytest.mark.slow  # two processes build a trainer each
@pytest.mark.parametrize("suffix", [".parquet", ".arrow"])  # .arrow: both ranks map one file's vectors
def test_mse_under_global_negatives_on_two_ranks(tmp_path: Path, suffix: str) -> None:
    from tests.dist_utils import run_distributed
    from tests.test_static import _rows, static_folder

    static_folder(tmp_path)
    _rows(tmp_path)
    run_distributed(_mse_distributed, 2, str(tmp_path), suffix)


def parallel_rows(tmp: Path) -> list[tuple[str, str]]:
    """(source, translation) rows, each translation of one source (multilingual distillation's data), written to
    tmp/rows.jsonl."""
    rows = [r[:2] for r in ROWS if [x[1] for x in ROWS].count(r[1]) == 1][:8]
    (tmp / "rows.jsonl").write_text("".join(json.dumps({"query": q, "positive": p}) + "\n" for q, p in rows))
    return rows


def assert_mse_alone_is_sentence_transformers(tmp: Path, rows: list[tuple[str, str]], file: Path) -> None:
    """One step of the static model at tmp/static with loss.distill=mse and contrastive_weight=0, on the rows and
    each source's label in `file` (its translation given the same), has the loss and table gradient of
    sentence-transformers' MSELoss on the same StaticEmbedding folder, normalized, with those labels (float64)."""
    import torch.nn.functional as F
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.losses import MSELoss
    from sentence_transformers.sentence_transformer.modules import Normalize

    table = EmbeddingTable.read(str(file), "labels")
    labels = torch.stack([table.vectors[table.row("query", q)] for q, _ in rows])
    assert all(torch.equal(table.vectors[table.row("document", t)], v) for (_, t), v in zip(rows, labels))
    trainer = static_run(
        tmp, "--loss.distill=mse", "--loss.contrastive_weight=0", f"--loss.teacher_embeddings={file}",
        f"--training.local_batch_size={len(rows)}", "--loss.symmetric=false",
    )  # fmt: skip
    out = trainer.train_step([trainer.train_set.__getitems__(list(range(len(rows))))])
    ours = trainer.model.query_embedding.weight.grad
    trainer.metrics.close()

    model = SentenceTransformer(str(tmp / "static"), device="cpu")
    model.append(Normalize())
    model = model.double()
    features = [model.tokenize([r[i] for r in rows]) for i in (0, 1)]
    loss = MSELoss(model)(features, F.normalize(labels.double()))  # the file's float32 values, as read
    loss.backward()
    theirs = model[0].embedding.weight.grad
    assert abs(out["loss"] - loss.item()) <= 1e-10 * loss.item()
    assert (ours - theirs).abs().max() <= 1e-10 * theirs.abs().max()


@needs("hf", "data")
def test_mse_alone_is_sentence_transformers_mse_loss(tmp_path: Path) -> None:
    """Labels written by hand: random unit vectors, each translation its source's."""
    import torch.nn.functional as F

    from tests.test_static import static_folder

    rows = parallel_rows(tmp_path)
    labels = F.normalize(torch.randn(len(rows), 8, generator=torch.Generator().manual_seed(5), dtype=torch.float64))
    records = [{"side": "query", "text": q, "embedding": v} for (q, _), v in zip(rows, labels.tolist())]
    records += [{"side": "document", "text": p, "embedding": v} for (_, p), v in zip(rows, labels.tolist())]
    static_folder(tmp_path)
    assert_mse_alone_is_sentence_transformers(tmp_path, rows, _write(tmp_path / "labels.parquet", records))
