"""A static model taught or guided by a sentence-transformers embedder (`[loss] teacher_model`, `guide_model`): the
frozen all-MiniLM-L6-v2 (perturbed: another vocabulary than the static table's) reads the static ids as text. Each
step kind's loss and the table's and scale's gradients equal the objective written from the definition, with the
teacher's embeddings taken from `SentenceTransformer(folder)` of the rows' texts, in float64 within 1e-10: in-batch
KL toward the teacher's cosines over every column, and the false-negative mask on the guide's cosines; on 1 and 2
gloo processes, chunk sizes that divide nothing. The same with the model's embeddings written ahead by
`python -m titan_contrastive.embed` (`teacher_embeddings`, `guide_embeddings`): no frozen model is built, the
definition reads the file's vectors, and those are sentence-transformers' to float32 rounding; on 1, 2 and 4
processes."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.dist_utils import run_distributed, write_once
from tests.needs import needs
from tests.test_static import (
    ROWS,
    _rows,
    assert_step_is,
    bert_tokenizer,
    defined_embeddings,
    float64_copy,
    static_folder,
    static_run,
)

KINDS = {  # local batch, accumulation steps, options ("<frozen>": the MiniLM folder)
    "gradcache-kl": (
        6,
        1,
        [
            "--gradcache.enabled=true",
            "--gradcache.chunk_sizes=5",
            "--loss.distill=kl",
            "--loss.teacher_model=<frozen>",
            "--loss.distill_temperature=0.05",
            "--loss.contrastive_weight=0.7",
        ],
    ),
    "plain-guide": (6, 1, ["--loss.guide_model=<frozen>", "--loss.mask_margin=-0.2"]),
    "global-guide-kl": (
        3,
        2,
        [
            "--loss.negatives=global",
            "--loss.stream_chunk_size=5",
            "--loss.guide_model=<frozen>",
            "--loss.teacher_model=<frozen>",
            "--loss.mask_margin=-0.2",
            "--loss.distill=kl",
            "--loss.distill_temperature=0.1",
        ],
    ),
}


def teacher_embeddings(folder: Path, texts: list[str]) -> torch.Tensor:
    """The frozen model's unit embeddings of `texts`, by sentence-transformers itself in float64 (a transformers
    folder: its mean pooling, run with the code the folder ships, if any)."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), device="cpu", trust_remote_code=True).double().eval()
    with torch.no_grad():
        return F.normalize(model(model.tokenize(texts))["sentence_embedding"], dim=-1)


def file_embeddings(file: Path) -> Callable[[list[str], str], torch.Tensor]:
    """(texts, side) -> the unit embeddings `file` (written by `titan_contrastive.embed`) holds, in float64."""
    import pyarrow.parquet as pq

    table = pq.read_table(file).to_pylist()
    by_key = {(r["side"], r["text"]): r["embedding"] for r in table}
    return lambda texts, side: F.normalize(torch.tensor([by_key[side, t] for t in texts], dtype=torch.float64), dim=-1)


def embedded(tmp: Path, frozen: Path) -> Path:
    """The frozen model's embeddings of the rows' texts, written once per tmp by the `embed` command."""
    from titan_contrastive.embed import main

    rows = write_once(tmp / "rows.jsonl", lambda: _rows(tmp))
    file = tmp / "frozen.parquet"
    return write_once(file, lambda: file if main([str(rows), "--model", str(frozen), "--out", str(file)]) == 0 else 0)


def defined_objective(model, batch: dict, rows: list[tuple[str, str, str]], frozen: Path, cfg) -> torch.Tensor:
    """One-way InfoNCE over the whole batch (query i against every positive and hard negative), its columns with
    guide cosine above the positive's + margin masked out (`guide_model`), times contrastive_weight, plus
    distill_weight x mean_i KL(softmax(T_i / tau) || softmax(S_i)), T the teacher's cosines, S the logits."""
    q = defined_embeddings(model.query_embedding.weight, batch["query"])
    d = defined_embeddings(model.doc_embedding.weight, torch.cat([batch["doc"], batch["neg"].flatten(0, 1)]))
    logits = model.logit_scale.exp() * q @ d.T
    embed = file_embeddings(frozen) if frozen.suffix else lambda texts, side: teacher_embeddings(frozen, texts)
    gq = embed([r[0] for r in rows], "query")
    g = gq @ embed([r[1] for r in rows] + [r[2] for r in rows], "document").T
    target = torch.arange(len(q))
    loss = cfg.contrastive_weight
    if cfg.guide_model or cfg.guide_embeddings:
        masked = g > g[target, target][:, None] + cfg.mask_margin
        masked[target, target] = False
        assert masked.any() and not masked[:, : len(q)].all()
        loss = loss * F.cross_entropy(logits.masked_fill(masked, float("-inf")), target)
    else:
        loss = loss * F.cross_entropy(logits, target)
    if cfg.distill:
        p = F.softmax(g / cfg.distill_temperature, dim=1)
        loss = loss + cfg.distill_weight * (p * (p.log() - F.log_softmax(logits, dim=1))).sum(1).mean()
    return loss


def _step(tmp: Path, frozen: Path, kind: str, *extra: str, ahead: bool = False) -> None:
    """`ahead`: the frozen model's embeddings written ahead (`embedded`) instead of the model running."""
    local, ga, args = KINDS[kind]
    if ahead:
        frozen = embedded(tmp, frozen)
        args = [a.replace("_model=", "_embeddings=") for a in args]
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    trainer = static_run(
        tmp, f"--training.local_batch_size={local}", f"--training.global_batch_size={local * ga * world}",
        "--loss.symmetric=false", *[a.replace("<frozen>", str(frozen)) for a in args], *extra,
    )  # fmt: skip
    step = trainer.gradient_step.describe()
    assert ("frozen teacher's cosines" in step) == ("teacher_" in str(args))
    assert ("frozen guide's cosines" in step) == ("guide_" in str(args))
    assert ("embedded ahead" in step) == ahead == (trainer.step_context.guide is None)
    data, n = trainer.train_set, local * ga * world
    steps = [data.__getitems__(list(range(j * local * world, (j + 1) * local * world))) for j in range(ga)]
    mine = [{k: v[rank * local : (rank + 1) * local] for k, v in s.items()} for s in steps]
    every = {k: torch.cat([s[k] for s in steps]) for k in steps[0]}
    tokenizer = bert_tokenizer()
    for ids, (query, *_) in zip(every["query"], ROWS[:n]):  # the batch holds these rows, in this order
        assert ids[ids >= 0].tolist() == tokenizer(query, add_special_tokens=False)["input_ids"]
    model = float64_copy(trainer)
    assert_step_is(trainer, mine, model, defined_objective(model, every, ROWS[:n], frozen, trainer.cfg.loss))


@needs("hf")
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_teacher_or_guide_trains_a_static_model_as_defined(tmp_path: Path, guide_dir: Path, kind: str) -> None:
    _step(tmp_path, guide_dir, kind)


@needs("hf", "data")
@pytest.mark.parametrize("kind", list(KINDS))
def test_the_embeddings_written_ahead_teach_or_guide_as_defined(tmp_path: Path, guide_dir: Path, kind: str) -> None:
    _step(tmp_path, guide_dir, kind, ahead=True)
    ahead = file_embeddings(tmp_path / "frozen.parquet")
    for side, texts in (("query", [r[0] for r in ROWS]), ("document", [t for r in ROWS for t in r[1:]])):
        assert torch.allclose(ahead(texts, side), teacher_embeddings(guide_dir, texts), rtol=0, atol=1e-6)


@needs("hf")
def test_a_teacher_whose_folder_ships_its_code_runs_it_when_trusted(tmp_path: Path) -> None:
    """A teacher of a model type transformers does not include (config.json `auto_map`): refused in one line without
    `[model] trust_remote_code`, and with it the step equals the definition under that code's embeddings."""
    from tests.hf_folders import architecture_folder
    from titan_contrastive.config import ConfigError

    teacher = architecture_folder(tmp_path, "own-code", dropout=0.1)
    with pytest.raises(ConfigError, match=r"^loss.teacher_model=.*model.trust_remote_code=true"):
        _step(tmp_path, teacher, "gradcache-kl")
    _step(tmp_path, teacher, "gradcache-kl", "--model.trust_remote_code=true")


@needs("hf", "data")
def test_the_embed_command_labels_parallel_sentences_with_their_sources(
    tmp_path: Path, guide_dir: Path, capsys: pytest.CaptureFixture
) -> None:
    """`--parallel`: each source embedded by the teacher (sentence-transformers' own embeddings to float32 rounding)
    and each translation given its source's; a 384-wide static student trained on them alone is sentence-transformers'
    MSELoss with those labels. A row with a hard negative, or a translation of two sources, is one line, nothing
    written."""
    from tests.test_frozen_embeddings import assert_mse_alone_is_sentence_transformers, parallel_rows
    from titan_contrastive.embed import main

    rows, file = parallel_rows(tmp_path), tmp_path / "labels.parquet"
    assert main([str(tmp_path / "rows.jsonl"), "--model", str(guide_dir), "--out", str(file), "--parallel"]) == 0
    sources = [q for q, _ in rows]
    want = teacher_embeddings(guide_dir, sources)
    assert torch.allclose(file_embeddings(file)(sources, "query"), want, rtol=0, atol=1e-6)
    static_folder(tmp_path, dim=want.shape[1])
    assert_mse_alone_is_sentence_transformers(tmp_path, rows, file)

    twice = tmp_path / "twice.jsonl"
    twice.write_text((tmp_path / "rows.jsonl").read_text() + json.dumps({"query": "a cat", "positive": rows[0][1]}))
    capsys.readouterr()
    for given, message in [(_rows(tmp_path), "has 1 hard negative"), (twice, "translates both")]:
        assert main([str(given), "--model", str(guide_dir), "--out", str(tmp_path / "no.parquet"), "--parallel"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: --parallel: ") and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "no.parquet").exists()


@needs("hf", "data")
@pytest.mark.parametrize("parallel", [False, True])
def test_the_embed_command_spools_its_vectors_in_pieces(
    tmp_path: Path, guide_dir: Path, monkeypatch: pytest.MonkeyPatch, parallel: bool
) -> None:
    """`ENCODE_ROWS` texts at a time (3: dividing nothing), each piece to the spool's file as it is encoded: the rows of
    one piece, in its order, and nothing but its index left beside the file; with `--parallel` each translation holds
    its source's row."""
    from tests.test_embed_on_ranks import assert_same_rows
    from tests.test_frozen_embeddings import parallel_rows
    from titan_contrastive import embed

    pairs = parallel_rows(tmp_path) if parallel else []
    src = tmp_path / "rows.jsonl" if parallel else _rows(tmp_path)
    whole, pieces = tmp_path / "whole" / "e.parquet", tmp_path / "pieces" / "e.parquet"
    flags = ["--parallel"] if parallel else []
    assert embed.main([str(src), "--model", str(guide_dir), "--out", str(whole), *flags]) == 0
    monkeypatch.setattr(embed, "ENCODE_ROWS", 3)
    assert embed.main([str(src), "--model", str(guide_dir), "--out", str(pieces), *flags]) == 0
    assert_same_rows(pieces, whole)
    assert sorted(p.name for p in pieces.parent.iterdir()) == ["e.parquet", "e.parquet.index"]  # and its index
    vectors = file_embeddings(pieces)
    for source, translation in pairs:
        assert torch.equal(vectors([translation], "document"), vectors([source], "query"))


def _distributed(tmp: str, frozen: str, ahead: bool = False) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    _step(Path(tmp), Path(frozen), "global-guide-kl", ahead=ahead)


@needs("hf")
@pytest.mark.slow  # ~20 s: two processes each load the teacher
def test_a_teacher_and_guide_under_global_negatives_on_two_ranks(tmp_path: Path, guide_dir: Path) -> None:
    static_folder(tmp_path)
    _rows(tmp_path)
    run_distributed(_distributed, 2, str(tmp_path), str(guide_dir))


@needs("hf", "data")
@pytest.mark.slow  # ~15 s: the file is written once, no process loads a model
@pytest.mark.parametrize("world", [2, 4])
def test_embeddings_written_ahead_under_global_negatives_across_ranks(
    tmp_path: Path, guide_dir: Path, world: int
) -> None:
    static_folder(tmp_path)
    embedded(tmp_path, guide_dir)
    run_distributed(_distributed, world, str(tmp_path), str(guide_dir), True)
