"""`python -m titan_contrastive.mine`: hard negatives for a pairs file, mined by a model.

- What it mines is what the definition selects: for every row, the corpus (every positive of the
  file) ranked by the cosine of the model's embeddings, without the query's own positives (all its
  rows), without candidates above (1 - m) x the positive's score, the first `--range-min` skipped,
  the next k taken; a row with fewer candidates left is left out. The reference is written here from
  that definition on embeddings computed apart from the tool: the pretrained MiniLM through
  sentence-transformers' `encode`, and for one of our step folders the run's own `BiEncoder`
  (not the export the tool goes through). Scores, not texts, are compared (a tie may swap two
  texts); rows with a candidate within 1e-5 of the margin are not judged (float rounding decides them).
- What it writes: the input's rows in order with their ids (an id column of any name written as
  `id`), as JSONL, Parquet or CSV, each read back by the pairs loader with k hard negatives per
  row; a BEIR corpus's documents join the candidates (`--corpus`); with `--keep-fewer` a row keeps the 1 to k
  the definition leaves it, as a list a run with data.negatives_per_row reads.
- Bad arguments: one `error:` line naming the flag, exit 2, before the model is loaded (the model
  given does not exist) and nothing written; a mining that keeps no row leaves no file behind.
"""

from __future__ import annotations

import csv
import dataclasses
import gzip
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.needs import needs

pytestmark = needs("hf", "data")

MARGIN_TIE = 1e-5


def mine(capsys: pytest.CaptureFixture, *argv: object) -> tuple[int, list[str]]:
    from titan_contrastive.mine import main

    capsys.readouterr()
    code = main([str(a) for a in argv])
    return code, [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]


def write_csv(path: Path, rows: Sequence[Sequence[str]], ids: Sequence[str]) -> Path:
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["query", "positive", "negative", "id"])
        writer.writerows([*row, i] for row, i in zip(rows, ids))
    return path


def expected(
    rows: Sequence[Sequence[str]],
    embed: Callable[[list[str], str], torch.Tensor],
    k: int,
    skip: int,
    margin: float,
    extra: Sequence[str] = (),
    min_score: float | None = None,
    fewer: bool = False,
) -> list[list[float] | None]:
    """Per row, the scores of the k negatives the definition selects (module doc) from the positives
    and `extra` documents, none below `min_score`; []: fewer than k left (with `fewer`: none); None: a candidate
    within MARGIN_TIE of the margin or of `min_score` (not judged)."""
    corpus = list(dict.fromkeys([*(r[1] for r in rows), *extra]))
    queries = list(dict.fromkeys(r[0] for r in rows))
    q = torch.nn.functional.normalize(embed(queries, "query").double(), dim=-1)
    d = torch.nn.functional.normalize(embed(corpus, "doc").double(), dim=-1)
    scores = q @ d.T
    out: list[list[float] | None] = []
    for query, _positive, *_ in rows:
        qi = queries.index(query)
        own = {corpus.index(r[1]) for r in rows if r[0] == query}
        positive = min(scores[qi, j].item() for j in own)
        threshold = positive - abs(positive) * margin
        candidates = [scores[qi, j].item() for j in range(len(corpus)) if j not in own]
        floor = -2.0 if min_score is None else min_score
        if any(abs(s - threshold) < MARGIN_TIE or abs(s - floor) < MARGIN_TIE for s in candidates):
            out.append(None)
            continue
        kept = sorted((s for s in candidates if floor <= s <= threshold), reverse=True)[skip : skip + k]
        out.append(kept if len(kept) == k or fewer and kept else [])
    return out


def check_mined(
    out: Path,
    rows: Sequence[Sequence[str]],
    ids: Sequence[str],
    want: Sequence[list[float] | None],
    score: Callable[[str, str], float],
    pooled: bool = False,
) -> int:
    """The written rows against the expected scores (`pooled`: rows of any number of negatives); how many rows
    were judged."""
    from titan_contrastive.datasets.pair_rows import read_rows

    got = read_rows(str(out), id_column="id", pooled=pooled)
    written = dict(zip(got.ids, got.texts))
    assert got.ids == [i for i, w in zip(ids, want) if w != [] and (w is not None or i in written)]
    judged = 0
    for row, i, w in zip(rows, ids, want):
        if w is None:
            continue
        judged += 1
        if not w:
            assert i not in written, f"row {i} has fewer than k candidates and must be left out"
            continue
        query, positive, *negatives = written[i]
        assert (query, positive) == (row[0], row[1])
        scores = [score(query, n) for n in negatives]
        assert len(scores) == len(w) and max(abs(a - b) for a, b in zip(scores, w)) <= MARGIN_TIE, (i, scores, w)
    return judged


def minilm_scorer() -> tuple[Path, Callable[[list[str], str], torch.Tensor], Callable[[str, str], float]]:
    """(the bundled MiniLM folder, its sentence-transformers embedding of texts (either side), the cosine of two
    texts embedded before)."""
    from sentence_transformers import SentenceTransformer

    from titan_contrastive.models.bi_encoder.folder import bundled_minilm

    model = bundled_minilm()
    st = SentenceTransformer(str(model), device="cpu")
    cache: dict[str, torch.Tensor] = {}

    def embed(texts: list[str], side: str) -> torch.Tensor:
        vectors = st.encode(texts, convert_to_tensor=True, batch_size=7, normalize_embeddings=True)
        cache.update(zip(texts, vectors))
        return vectors

    def score(q: str, d: str) -> float:
        return float(cache[q].double() @ cache[d].double())

    return model, embed, score


def wordnet_rows(n: int) -> list[list[str]]:
    path = Path(__file__).resolve().parents[1] / "titan_contrastive/assets/wordnet/pairs_train.tsv.gz"
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [row for _, row in zip(range(n), csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))]


def read_written(out: Path) -> list[list[str]]:
    from titan_contrastive.datasets.pair_rows import read_rows

    return read_rows(str(out), id_column="id").texts


def read_ids(out: Path) -> list[str]:
    from titan_contrastive.datasets.pair_rows import read_rows

    return read_rows(str(out)).ids or []


def tiny_rows(n: int = 40) -> list[list[str]]:
    from tests.hf_folders import WORDS

    rng = random.Random(0)
    positives = rng.sample(WORDS, n)
    return [[" ".join(rng.sample(WORDS, 4)), p, rng.choice(WORDS)] for p in positives]


def bi_encoder_step(
    root: Path, shared: bool, folder: Path | None = None, doc_length: int = 24, **fields: object
) -> Path:
    """step-1 of a run folder of a bi_encoder on `folder` (default: a tiny random BERT; `fields`: BiEncoderArgs'),
    written as training writes it; with two towers the doc tower is moved off the query tower's weights."""
    from tests.hf_folders import encoder_folder
    from titan_contrastive.checkpoint import CheckpointManager, ModelState
    from titan_contrastive.config.job_config import Checkpoint
    from titan_contrastive.models.bi_encoder import BiEncoder, BiEncoderArgs

    torch.manual_seed(0)
    folder = folder or encoder_folder(root, dropout=0.1)
    fields = {"query_length": 24, **fields}
    args = BiEncoderArgs(path=str(folder), shared=shared, **fields).resolve(doc_length=doc_length)
    model = BiEncoder(args)
    with torch.no_grad():  # two towers that embed apart (both start from the one folder)
        for param in [] if shared else model.doc_tower.parameters():
            param.add_(0.05 * torch.randn_like(param))
    CheckpointManager(
        Checkpoint(enable=True, folder="checkpoint", interval=1, keep_latest_k=0),
        dump_folder=str(root / "run"),
        states={"model": ModelState(model)},
        per_rank_states={},
        rank=0,
        dp_rank=0,
        dp_degree=1,
        model_info={"family": "bi_encoder", "args": dataclasses.asdict(args)},
    ).save(1)
    return root / "run" / "checkpoint" / "step-1"


def run_embedder(step: Path) -> tuple[Callable[[list[str], str], torch.Tensor], dict[str, dict], Any, Any]:
    """(embed(texts, side) by the run's own BiEncoder, not through the export the tools use; the vectors it gave,
    by side and text; the model; its tokenizer) of the step folder `step`."""
    from titan_contrastive.models.bi_encoder import build_tokenizer
    from titan_contrastive.models.weights import read_ours

    _, args, model = read_ours(step)
    model.eval()
    tokenizer = build_tokenizer(args)
    seen: dict[str, dict] = {"query": {}, "doc": {}}

    def embed(texts: list[str], side: str) -> torch.Tensor:
        with torch.no_grad():
            if side == "query":
                vectors = model._embed(model.query_tower, tokenizer.encode_queries(texts, args.query_length), 0)
            else:
                vectors = model._embed(model.doc_tower, tokenizer.encode_docs(texts), 1)
        seen[side].update(zip(texts, vectors))
        return vectors

    return embed, seen, model, tokenizer


def test_mined_negatives_are_the_definitions_choice_on_minilm(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """160 WordNet pairs, 2 negatives after skipping the best candidate, TopK-PercPos 0.05: every
    judged row's negatives score as the reference selects. One query gets a second positive (never
    its negative), another the lemma it scores lowest as a second one: the margin is the weaker
    positive's, so nothing passes and both its rows are left out."""
    model, embed, score = minilm_scorer()
    rows = wordnet_rows(160)
    embed([r[0] for r in rows] + [r[1] for r in rows], "")
    worst = min((r[1] for r in rows), key=lambda lemma: score(rows[3][0], lemma))
    rows += [[rows[5][0], rows[9][1], rows[9][2]], [rows[3][0], worst, rows[3][2]]]
    ids = [f"s{i}" for i in range(len(rows))]
    src = write_csv(tmp_path / "pairs.csv", rows, ids)
    out = tmp_path / "mined.jsonl"
    args = ("--negatives=2", "--range-min=1", "--range-max=1000", "--relative-margin=0.05")
    assert mine(capsys, src, f"--model={model}", f"--out={out}", *args) == (0, [])
    want = expected(rows, embed, k=2, skip=1, margin=0.05)
    assert check_mined(out, rows, ids, want, score) >= 155
    assert want[3] == want[-1] == []  # left out
    written = {r[0]: r for r in read_written(out)}
    assert rows[9][1] not in written[rows[5][0]][2:]  # a second positive is never its query's negative


def test_keep_fewer_keeps_the_rows_with_some_negatives(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """--keep-fewer, 4 negatives, none below a cosine of 0.25: every judged row holds the reference's 1 to 4, a
    row with none is left out, rows with fewer are there; the file is what a run with data.negatives_per_row reads
    (and a run without it is pointed there); a .csv output is refused before the model loads."""
    from titan_contrastive.datasets.base import DataError
    from titan_contrastive.datasets.pair_rows import read_rows

    model, embed, score = minilm_scorer()
    rows = wordnet_rows(160)
    ids = [f"s{i}" for i in range(len(rows))]
    src = write_csv(tmp_path / "pairs.csv", rows, ids)
    out = tmp_path / "mined.jsonl"
    args = ("--negatives=4", "--range-max=1000", "--relative-margin=0.05", "--min-score=0.25", "--keep-fewer")
    assert mine(capsys, src, f"--model={model}", f"--out={out}", *args) == (0, [])
    want = expected(rows, embed, k=4, skip=0, margin=0.05, min_score=0.25, fewer=True)
    assert check_mined(out, rows, ids, want, score, pooled=True) >= 150
    counts = [len(w) for w in want if w]
    assert min(counts) == 1 and max(counts) == 4 and sum(c < 4 for c in counts) >= 10 and [] in want
    with pytest.raises(DataError, match="data.negatives_per_row = k"):
        read_rows(str(out), id_column="id")
    csv_out = tmp_path / "mined.csv"
    assert mine(capsys, src, "--model=no-such-model", f"--out={csv_out}", *args) == (
        2,
        [f"error: --out={csv_out}: --keep-fewer writes each row's negatives as a list; write .jsonl or .parquet"],
    )
    assert not csv_out.exists()


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet", ".csv"])
def test_a_step_folder_mines_with_the_runs_own_embeddings(
    tmp_path: Path, capsys: pytest.CaptureFixture, suffix: str
) -> None:
    """One of our bi_encoder step folders (tiny random BERT, dropout on in training, off here): the
    negatives score, under the run's own BiEncoder embeddings, as the reference selects; each
    format reads back with one negative per row and the ids."""
    step = bi_encoder_step(tmp_path, shared=True)
    rows = tiny_rows()
    ids = [f"t{i}" for i in range(len(rows))]
    src = write_csv(tmp_path / "pairs.csv", rows, ids)
    out = tmp_path / f"mined{suffix}"
    assert mine(capsys, src, f"--model={step}", f"--out={out}", "--range-max=100", "--relative-margin=0.01") == (0, [])
    embed, seen, _, tokenizer = run_embedder(step)

    def score(q: str, d: str) -> float:
        return float(seen["query"][q].double() @ seen["doc"][d].double())

    want = expected(rows, embed, k=1, skip=0, margin=0.01)
    judged = check_mined(out, rows, ids, want, score)
    assert judged >= 30 and any(want)
    from titan_contrastive.datasets.pairs import PairsDataset

    data = PairsDataset(split="train", path=str(out), tokenizer=tokenizer, query_length=24)
    assert data.num_negatives == 1 and len(data) == len(read_written(out))
    if suffix != ".jsonl":
        return
    # --scores: the same rows, and the model's cosines of each row's documents, read back as teacher scores
    scored = tmp_path / "scored.jsonl"
    flags = ("--range-max=100", "--relative-margin=0.01", "--scores")
    assert mine(capsys, src, f"--model={step}", f"--out={scored}", *flags) == (0, [])
    from titan_contrastive.batching import TEACHER_SCORES
    from titan_contrastive.datasets.pair_rows import read_rows

    back = read_rows(str(scored), teacher="kl")
    assert back.texts == read_written(out)
    for (query, *docs), got in zip(back.texts, back.scores):
        assert got == pytest.approx([score(query, d) for d in docs], abs=1e-5)
    data = PairsDataset(split="train", path=str(scored), tokenizer=tokenizer, query_length=24, teacher="kl")
    assert data.__getitems__([0])[TEACHER_SCORES].tolist() == [pytest.approx(back.scores[0], abs=1e-6)]


def test_a_corpus_adds_candidates(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """--corpus: a BEIR corpus.jsonl's documents (title before text) join the positives as
    candidates; one of them repeats a positive's text and stays that query's positive."""
    import json

    from tests.hf_folders import WORDS

    step = bi_encoder_step(tmp_path, shared=True)
    rows = tiny_rows(20)
    rng = random.Random(1)
    docs = [{"_id": f"d{i}", "title": rng.choice(WORDS), "text": " ".join(rng.sample(WORDS, 2))} for i in range(30)]
    docs.append({"_id": "copy", "text": rows[0][1]})
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in docs))
    ids = [f"t{i}" for i in range(len(rows))]
    src = write_csv(tmp_path / "pairs.csv", rows, ids)
    out = tmp_path / "mined.jsonl"
    flags = ("--negatives=2", "--range-max=100", "--relative-margin=0.01", f"--corpus={corpus}")
    assert mine(capsys, src, f"--model={step}", f"--out={out}", *flags) == (0, [])
    embed, seen, _, _ = run_embedder(step)
    extra = [f"{d.get('title', '')} {d['text']}".strip() for d in docs]
    want = expected(rows, embed, k=2, skip=0, margin=0.01, extra=extra)
    assert check_mined(out, rows, ids, want, lambda q, d: float(seen["query"][q] @ seen["doc"][d])) >= 15
    mined = {n for r in read_written(out) for n in r[2:]}
    assert mined & set(extra[:-1]) and rows[0][1] not in {
        n for r in read_written(out) if r[0] == rows[0][0] for n in r[2:]
    }


def test_a_cross_encoder_chooses_and_scores_the_negatives(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """--cross-encoder with every positive a candidate (--range-max past the corpus) and a filter that
    passes all: each row's negatives are the other positives the cross-encoder scores highest, and
    --scores writes its scores of the positive and each negative (what loss.distill reads)."""
    from sentence_transformers import CrossEncoder

    from tests.hf_folders import cross_encoder_folder
    from titan_contrastive.datasets.pair_rows import read_rows

    step = bi_encoder_step(tmp_path, shared=True)
    ce_path = cross_encoder_folder(tmp_path)
    rows = tiny_rows(20)
    src = write_csv(tmp_path / "pairs.csv", rows, [f"t{i}" for i in range(len(rows))])
    out = tmp_path / "mined.jsonl"
    flags = ("--negatives=2", "--range-max=100", "--relative-margin=none", "--max-score=1e9", "--scores")
    assert mine(capsys, src, f"--model={step}", f"--cross-encoder={ce_path}", f"--out={out}", *flags) == (0, [])
    ce = CrossEncoder(str(ce_path), device="cpu")
    back = read_rows(str(out), teacher="kl")
    assert len(back.texts) == len(rows)
    positives = [r[1] for r in rows]
    for (query, positive, *negatives), scores in zip(back.texts, back.scores):
        assert scores == pytest.approx(ce.predict([(query, d) for d in (positive, *negatives)]).tolist(), abs=1e-5)
        others = sorted({p for p, r in zip(positives, rows) if r[0] != query})
        ranked = sorted(ce.predict([(query, p) for p in others]).tolist(), reverse=True)
        assert scores[1:] == pytest.approx(ranked[:2], abs=1e-5)
    flags = ("--relative-margin=none",)
    assert mine(capsys, src, f"--model={step}", f"--cross-encoder={ce_path}", f"--out={out}x", *flags)[1] == [
        f"error: --cross-encoder={ce_path}: it scores the candidates the filters judge, and no filter is set "
        "(--relative-margin none); set one (e.g. --max-score) or leave out the cross-encoder"
    ]


def test_an_id_column_of_another_name_is_written_as_id(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """--id-column=qid, named columns in another order: the output reads back with the default
    data.pairs_id_column, the same ids and texts in the same order."""
    import json

    from tests.hf_folders import encoder_folder

    torch.manual_seed(0)
    model = encoder_folder(tmp_path)
    rows = tiny_rows()
    src = tmp_path / "pairs.jsonl"
    src.write_text("".join(json.dumps({"qid": f"q{i}", "p": r[1], "q": r[0]}) + "\n" for i, r in enumerate(rows)))
    out = tmp_path / "mined.jsonl"
    flags = ("--columns=q,p", "--id-column=qid", "--relative-margin=none")
    assert mine(capsys, src, f"--model={model}", f"--out={out}", *flags) == (0, [])
    assert read_ids(out) == [f"q{i}" for i in range(len(rows))]
    assert [r[:2] for r in read_written(out)] == [r[:2] for r in rows]


@pytest.mark.slow  # two encoding processes start: ~15 s
def test_several_devices_write_the_same_file(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """--device=cpu,cpu encodes in two processes: the same file as one process."""
    step = bi_encoder_step(tmp_path, shared=True)
    src = write_csv(tmp_path / "pairs.csv", tiny_rows(), [str(i) for i in range(40)])
    flags = ("--negatives=2", "--relative-margin=0.01", "--range-max=60", "--batch-size=8")
    for name, device in (("one", "cpu"), ("two", "cpu,cpu")):
        out = tmp_path / f"{name}.jsonl"
        assert mine(capsys, src, f"--model={step}", f"--out={out}", f"--device={device}", *flags) == (0, [])
    assert (tmp_path / "one.jsonl").read_text() == (tmp_path / "two.jsonl").read_text()


def test_two_towers_embed_each_side_with_its_own(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A run of two towers (the doc tower moved off the query tower's weights): `mine` without `--tower` ranks the
    corpus by the doc tower's embeddings against the query tower's, as the reference from the run's own BiEncoder
    selects; `embed` writes each side by its tower (queries by the query tower, documents by the doc tower);
    `--tower doc` mines with one."""
    import pyarrow.parquet as pq

    from titan_contrastive.embed import main as embed_main

    step = bi_encoder_step(tmp_path, shared=False)
    rows = tiny_rows()
    ids = [f"t{i}" for i in range(len(rows))]
    src = write_csv(tmp_path / "pairs.csv", rows, ids)
    out = tmp_path / "mined.jsonl"
    assert mine(capsys, src, f"--model={step}", f"--out={out}", "--range-max=100", "--relative-margin=0.01") == (0, [])
    embed, seen, model, tokenizer = run_embedder(step)
    queries, docs = seen["query"], seen["doc"]

    want = expected(rows, embed, k=1, skip=0, margin=0.01)
    judged = check_mined(out, rows, ids, want, lambda q, d: float(queries[q].double() @ docs[d].double()))
    assert judged >= 30 and any(want)
    with torch.no_grad():  # the towers embed apart: one tower for both sides would be another ranking
        same = model._embed(model.query_tower, tokenizer.encode_docs(list(docs)), 1)
    assert (same - torch.stack(list(docs.values()))).abs().max() > 1e-2

    written = tmp_path / "embedded.parquet"
    assert embed_main([str(src), "--model", str(step), "--out", str(written)]) == 0
    table = pq.read_table(written).to_pylist()
    for side in ("query", "document"):  # the positives and the negatives as documents
        texts = [row["text"] for row in table if row["side"] == side]
        got = torch.tensor([row["embedding"] for row in table if row["side"] == side])
        assert texts and (got - embed(texts, "query" if side == "query" else "doc")).abs().max() <= 1e-5, side

    assert mine(
        capsys, src, f"--model={step}", f"--out={tmp_path / 'one.jsonl'}", "--tower=doc", "--range-max=60",
        "--relative-margin=0.01",
    ) == (0, [])  # fmt: skip
    assert len(read_written(tmp_path / "one.jsonl")[0]) == 3


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--negatives=0"], "--negatives=0"),
        (["--range-min=-1"], "--range-min=-1"),
        (["--negatives=3", "--range-min=2", "--range-max=4"], "--range-max=4"),
        (["--relative-margin=1.5"], "--relative-margin=1.5"),
        (["--absolute-margin=-0.1"], "--absolute-margin=-0.1"),
        (["--columns=a,b,c"], "--columns=a,b,c"),
        (["PAIRS=missing.csv"], "PAIRS="),
        (["PAIRS=a.csv::b.csv"], "one file at a time"),
        (["--out=mined.txt"], "--out="),
        (["--out=pairs.csv"], "is the input"),
        (["--out=exists.jsonl"], "exists"),
        (["--model=<a folder of nothing>"], "--model="),
        (["--image-root=<a folder of nothing>"], "--image-root: for page rows"),
    ],
)
def test_bad_arguments_are_one_line_before_the_model(
    tmp_path: Path, capsys: pytest.CaptureFixture, flags: list[str], named: str
) -> None:
    src = write_csv(tmp_path / "pairs.csv", tiny_rows(), [str(i) for i in range(40)])
    (tmp_path / "exists.jsonl").write_text("{}\n")
    (tmp_path / "empty").mkdir()
    opts = {"PAIRS": str(src), "--out": str(tmp_path / "mined.jsonl"), "--model": str(tmp_path / "no-such-model")}
    extra = []
    for flag in flags:
        key, _, value = flag.partition("=")
        value = {"<a folder of nothing>": str(tmp_path / "empty")}.get(value, value)
        if key in opts:
            opts[key] = value if key == "--model" or "::" in value else str(tmp_path / value)
        else:
            extra.append(flag)
    before = sorted(p.name for p in tmp_path.iterdir())
    code, err = mine(capsys, opts.pop("PAIRS"), *(f"{k}={v}" for k, v in opts.items()), *extra)
    assert code == 2 and len(err) == 1 and named in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written, no temporary file


def test_a_mining_that_keeps_no_row_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """--max-score=-1 filters every candidate (cosines of a random model are above -1): exit 2, no file."""
    from tests.hf_folders import encoder_folder

    model = encoder_folder(tmp_path)
    src = write_csv(tmp_path / "pairs.csv", tiny_rows(), [str(i) for i in range(40)])
    code, err = mine(capsys, src, f"--model={model}", f"--out={tmp_path / 'mined.jsonl'}", "--max-score=-1")
    assert code == 2 and len(err) == 1 and "no row" in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pairs.csv", "tiny-bert"]
