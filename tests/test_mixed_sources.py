"""Several training sources in one run (`datasets/mixing.py`): `::`-joined text-pair files weighted by
`data.upsampling_factors`, and `data.same_source_batches`, every optimizer step's samples from one
source (`loader.BlockedDistributedSampler` with `source_sizes`).

- joined pairs files serve each file's rows at the joined indices, a fractional share in windows that
  move per epoch (every row seen as often over epochs), with the single files' tokens;
- with same-source batches every step (local batch x ranks x accumulation steps) lies in one source,
  each source gives its whole steps once per epoch and leaves out a different remainder each epoch,
  the order is the same for 1 rank x 6 x 2 steps, 2 ranks x 3 x 2 and 4 ranks x 3 (ranks
  concatenated), and a loader restored mid-epoch continues with the batches of the uninterrupted one;
- through the trainer: global negatives with accumulation take each step from one file and train;
- each file's own prompts (`data.query_prompts`, `data.doc_prompts`: a task's instruction) give the
  tokens of the same files with the prompts written into their texts, at every joined index and
  epoch, in the dataset and through the trainer (whose held-out file keeps the model's prompt);
- one-line errors: files that disagree on hard negatives or ids, factors or '::' where one source is
  read, a source smaller than a step, same-source batches over one source, prompts not one per source
  or for data that is not text pairs; a held-out file next to weighted training files is read as it is.
- image-text sources (csv) joined: the fractional share's window moves per epoch, factors weigh the
  training split only, same-source steps on 2 ranks, and a bad sample at the end of a source's range
  is substituted from that source. vl_pairs files: tests/test_qwen_vl_pairs.py.
"""

from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from tests.needs import needs
from tests.test_pairs_data import make_trainer, write_jsonl
from tests.test_user_data import _damaged_csv, _dataset, write_emoji_files
from titan_contrastive.config.data import Data
from titan_contrastive.datasets import DataError
from titan_contrastive.datasets.bad_samples import BAD_SAMPLES
from titan_contrastive.datasets.build import check_joined_sources
from titan_contrastive.datasets.file_sources import open_source
from titan_contrastive.datasets.files import FileImageTextDataset
from titan_contrastive.datasets.loader import BlockedDistributedSampler, build_dataloader
from titan_contrastive.datasets.mixing import SourceMix, joins, split_sources
from titan_contrastive.datasets.pairs import PairsDataset
from titan_contrastive.datasets.tokenizer import ByteTokenizer


@pytest.fixture(scope="module")
def emoji(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    return write_emoji_files(tmp_path_factory.mktemp("emoji"))


@pytest.fixture(scope="module")
def tokenizer():
    from titan_contrastive.models.bi_encoder import BiEncoderArgs, build_tokenizer

    return build_tokenizer(BiEncoderArgs())


def _files(tmp: Path, sizes: tuple[int, ...] = (11, 7, 5), negatives: tuple[int, ...] = (1, 1, 1)) -> list[Path]:
    """One JSONL file per size: rows ("<file> query <i>", "<file> doc <i>", negatives...)."""
    return [
        write_jsonl(
            tmp / f"f{f}.jsonl",
            [[f"f{f} query {i}", f"f{f} doc {i}", *(f"f{f} neg {i} {j}" for j in range(k))] for i in range(n)],
        )
        for f, (n, k) in enumerate(zip(sizes, negatives))
    ]


PROMPTS = {"query_prompts": ["Instruct: find the word, then\nQuery: ", ""], "doc_prompts": ["", "passage: "]}
"""Two files' prompts: an instruction with a comma and a newline, and none, per side."""


def _prefixed(files: list[Path], out: Path, query_prompts: list[str], doc_prompts: list[str]) -> list[Path]:
    """`files` (of `_files`) rewritten under `out` with each file's prompts written into its texts
    (documents' to the positive and every negative), the reference a prompt must reproduce."""
    out.mkdir()
    written = []
    for f, q, d in zip(files, query_prompts or [""] * len(files), doc_prompts or [""] * len(files)):
        rows = [json.loads(line) for line in f.read_text().splitlines()]
        written.append(write_jsonl(out / f.name, [[q + r[0], *(d + t for t in r[1:])] for r in rows]))
    return written


def _joined(files: list[Path]) -> str:
    return "::".join(map(str, files))


def _source_of(sizes: list[int]) -> list[int]:
    """Joined index -> its source."""
    return [s for s, n in enumerate(sizes) for _ in range(n)]


def _one_line(err: pytest.ExceptionInfo, *needles: str) -> None:
    message = str(err.value)
    assert len(message.splitlines()) == 1, message
    for needle in needles:
        assert needle in message, message


@needs("hf")
def test_joined_files_serve_each_files_rows(tmp_path: Path, tokenizer) -> None:
    files = _files(tmp_path)
    common = dict(split="train", tokenizer=tokenizer, query_length=12)
    singles = [PairsDataset(path=str(f), **common) for f in files]
    joined = PairsDataset(path=_joined(files), factors=[2.0, 1.0, 0.6], **common)
    assert joined.source_sizes == [22, 7, 3] and len(joined) == 32
    assert PairsDataset(path=str(files[0]), **common).source_sizes is None
    windows = []
    for epoch in range(5):
        joined.set_epoch(epoch)
        batch = joined.__getitems__(range(32))
        assert batch["index"].tolist() == list(range(32))
        expected = [(0, i % 11) for i in range(22)] + [(1, i) for i in range(7)]
        expected += [(2, (i + 3 * epoch) % 5) for i in range(3)]  # the 0.6 share: windows of 3 moving by 3
        for key in ("query", "doc", "neg"):
            want = torch.stack([singles[s].__getitems__([r])[key][0] for s, r in expected])
            assert torch.equal(batch[key], want), (epoch, key)
        windows.append({r for s, r in expected if s == 2})
    assert [len(w) for w in windows] == [3] * 5 and set().union(*windows) == set(range(5))


@needs("hf")
def test_each_source_gets_its_own_prompts(tmp_path: Path, tokenizer) -> None:
    files = _files(tmp_path, sizes=(11, 7))
    common = dict(split="train", query_length=20, factors=[2.0, 0.6])
    prompted = PairsDataset(path=_joined(files), tokenizer=tokenizer, **common, **PROMPTS)
    written = PairsDataset(
        path=_joined(_prefixed(files, tmp_path / "prefixed", **PROMPTS)), tokenizer=tokenizer, **common
    )
    model_query = dataclasses.replace(tokenizer, query_prompt="query: ")  # a folder's own query prompt
    docs_only = PairsDataset(path=_joined(files), tokenizer=model_query, doc_prompts=PROMPTS["doc_prompts"], **common)
    docs_written = PairsDataset(
        path=_joined(_prefixed(files, tmp_path / "docs", ["query: "] * 2, PROMPTS["doc_prompts"])),
        tokenizer=tokenizer,
        **common,
    )
    plain = PairsDataset(path=_joined(files), tokenizer=tokenizer, **common)
    for epoch in range(3):
        for ds in (prompted, written, docs_only, docs_written, plain):
            ds.set_epoch(epoch)
        got, want = prompted.__getitems__(range(len(prompted))), written.__getitems__(range(len(written)))
        assert got.keys() == want.keys() == {"query", "doc", "neg", "index"}
        for key in got:
            assert torch.equal(got[key], want[key]), (epoch, key)
        got, want = docs_only.__getitems__(range(26)), docs_written.__getitems__(range(26))
        assert all(torch.equal(got[key], want[key]) for key in got), epoch
    rows = plain.__getitems__(range(len(plain)))
    changed = {k: (rows[k] != prompted.__getitems__(range(len(plain)))[k]).flatten(1).any(1) for k in ("query", "doc")}
    source = [0] * 22 + [1] * 4
    assert changed["query"].tolist() == [s == 0 for s in source]  # the first file's queries, the second's docs
    assert changed["doc"].tolist() == [s == 1 for s in source]


def test_source_mix_and_split() -> None:
    mix = SourceMix([10, 4], [1.5, 0.5])
    assert mix.sizes == [15, 2] and mix.starts == [0, 15] and len(mix) == 17
    assert [mix.locate(i, 0) for i in (0, 9, 10, 14, 15, 16)] == [(0, 0), (0, 9), (0, 0), (0, 4), (1, 0), (1, 1)]
    assert [mix.locate(i, 1) for i in (0, 15, 16)] == [(0, 5), (1, 2), (1, 3)]
    assert [mix.record(i, 1) for i in (0, 15, 16)] == [5, 12, 13]  # the second source's records follow the first's 10
    assert not joins([1.0]) and joins([0.5]) and joins([1.0, 1.0])
    assert split_sources("a::b", []) == (["a", "b"], [1.0, 1.0])
    with pytest.raises(DataError) as err:
        split_sources("a::b", [1.0])
    _one_line(err, "data.upsampling_factors=[1.0]", "one factor per")
    with pytest.raises(DataError) as err:
        split_sources("a::::b", [])
    _one_line(err, "data.path='a::::b'", "an empty source")


def _steps(sampler: BlockedDistributedSampler) -> list[list[int]]:
    """The epoch's optimizer steps (runs of step_samples) of the ranks' concatenated order."""
    order = sampler.global_order().tolist()
    return [order[i : i + sampler.step_samples] for i in range(0, len(order), sampler.step_samples)]


def test_same_source_steps_in_the_sampler() -> None:
    sizes = [37, 50, 13]  # steps of 12: 3, 4 and 1 whole steps; remainders 1, 2, 1
    source = _source_of(sizes)
    one = BlockedDistributedSampler(
        100, local_batch_size=6, rank=0, world_size=1, seed=3, source_sizes=sizes, step_samples=12
    )
    assert one.steps_per_epoch == 16 and len(one) == 96
    seen, orders = [], []
    for epoch in range(3):
        one.set_epoch(epoch)
        steps = _steps(one)
        assert len(steps) == 8 and all(len({source[i] for i in step}) == 1 for step in steps)
        orders.append([source[step[0]] for step in steps])
        counts = [sum(source[step[0]] == s for step in steps) for s in range(3)]
        assert counts == [3, 4, 1]
        flat = [i for step in steps for i in step]
        assert len(set(flat)) == len(flat) == 96  # no sample twice in an epoch
        seen.append(set(range(100)) - set(flat))
        # 2 ranks x 3 x 2 accumulation steps, 4 ranks x 3: each loader step is rank 0's 3, rank 1's 3, ...
        for world in (2, 4):
            ranks = []
            for rank in range(world):
                sampler = BlockedDistributedSampler(
                    100, local_batch_size=3, rank=rank, world_size=world, seed=3, source_sizes=sizes, step_samples=12
                )
                sampler.set_epoch(epoch)
                ranks.append(list(sampler))
            merged = [i for j in range(0, 96 // world, 3) for rank in ranks for i in rank[j : j + 3]]
            assert merged == flat, world
        assert list(one) == flat
    assert len({frozenset(s) for s in seen}) == 3  # the remainders differ by epoch
    assert len({tuple(o) for o in orders}) == 3 and any(o != sorted(o) for o in orders)  # sources interleave
    with pytest.raises(ValueError, match="must be a multiple"):
        BlockedDistributedSampler(
            100, local_batch_size=5, rank=0, world_size=1, seed=0, source_sizes=sizes, step_samples=12
        )


@needs("hf")
def test_same_source_loader_resumes_exactly(tmp_path: Path, tokenizer) -> None:
    files = _files(tmp_path, sizes=(13, 9, 6))
    ds = PairsDataset(path=_joined(files), split="train", tokenizer=tokenizer, query_length=12, factors=[1.0, 1.0, 2.0])

    def loader():
        return build_dataloader(
            ds, local_batch_size=2, dp_rank=0, dp_world_size=1, seed=5, step_samples=4, same_source=True
        )

    straight = loader()
    source = _source_of(ds.source_sizes)
    batches = [next(straight) for _ in range(30)]  # 6 + 4 + 6 = 16 loader steps per epoch: into the second
    for j in range(0, 30, 2):
        assert len({source[i] for b in batches[j : j + 2] for i in b["index"].tolist()}) == 1
    resumed = loader()
    for _ in range(11):
        next(resumed)
    state = resumed.state_dict()
    restored = loader()
    restored.load_state_dict(state)
    for want in batches[11:]:
        got = next(restored)
        assert all(torch.equal(got[k], want[k]) for k in want)


@needs("hf")
def test_trainer_takes_each_step_from_one_file(tmp_path: Path) -> None:
    files = _files(tmp_path, sizes=(10, 8))
    trainer = make_trainer(
        tmp_path,
        _joined(files),
        "--training.local_batch_size=3",
        "--training.global_batch_size=6",
        "--training.steps=4",
        "--metrics.log_freq=1",
        "--loss.negatives=global",
        "--loss.mask_duplicates=false",
        "--data.same_source_batches=true",
        "--data.upsampling_factors=1,1.5",
        "--eval.enable=false",
    )
    assert trainer.train_set.source_sizes == [10, 12] and trainer.loader.steps_per_epoch == 6
    source, steps = _source_of([10, 12]), _steps(trainer.loader.sampler)
    assert len(steps) == 3 and all(len({source[i] for i in step}) == 1 for step in steps)
    assert {source[step[0]] for step in steps} == {0, 1}  # both files in an epoch
    trainer.train()
    trainer.metrics.close()
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [row["loss"] for row in logged if row["kind"] == "train"]
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))


@needs("hf")
def test_errors(tmp_path: Path, tokenizer) -> None:
    common = dict(split="train", tokenizer=tokenizer, query_length=12)
    files = _files(tmp_path, sizes=(6, 6), negatives=(1, 2))
    with pytest.raises(DataError) as err:
        PairsDataset(path=_joined(files), **common)
    _one_line(err, "different numbers of hard negatives per row", "f0.jsonl: 1", "f1.jsonl: 2")
    assert len(PairsDataset(path=_joined(files[:1] * 2), **common)) == 12
    queries_only = PairsDataset(path=_joined(files), hard_negatives=False, **common)
    assert len(queries_only) == 12 and set(queries_only.__getitems__(range(12))) == {"query", "doc", "index"}
    with_ids = write_jsonl(tmp_path / "ids.jsonl", [{"id": str(i), "q": f"q {i}", "p": f"p {i}"} for i in range(6)])
    (tmp_path / "plain").mkdir()
    plain = _files(tmp_path / "plain", sizes=(6,), negatives=(0,))
    with pytest.raises(DataError) as err:
        PairsDataset(path=_joined([with_ids, *plain]), **common)
    _one_line(err, "data.pairs_id_column", "ids.jsonl has that column", "set data.pairs_id_column=''")
    for data, needle in (
        (Data(dataset="wordnet", upsampling_factors=[1.0, 2.0]), "data.upsampling_factors=[1.0, 2.0]"),
        (Data(dataset="emoji", path="a::b"), "data.path='a::b'"),
        (Data(dataset="synthetic", upsampling_factors=[2.0]), "data.dataset='synthetic' reads one source"),
    ):
        with pytest.raises(DataError) as err:
            check_joined_sources(data)
        _one_line(err, needle, "csv, webdataset, hf, pairs and vl_pairs")
    for kind in ("pairs", "vl_pairs", "csv", "webdataset", "hf"):
        check_joined_sources(Data(dataset=kind, path="a::b", upsampling_factors=[1.0, 2.0]))
    for key in PROMPTS:
        with pytest.raises(DataError) as err:
            PairsDataset(path=_joined(files), hard_negatives=False, **common, **{key: ["only one"]})
        _one_line(err, f"data.{key}=['only one']: 1 prompt(s) for the 2 source(s)", "one per '::'-joined source")
        with pytest.raises(DataError) as err:
            check_joined_sources(Data(dataset="csv", path="a::b", **{key: ["x", "y"]}))
        _one_line(err, f"data.{key}=['x', 'y']", "not data.dataset='csv'", f"set model.{key[:-1]}")
        check_joined_sources(Data(dataset="vl_pairs", path="a::b", **{key: ["x", "y"]}))  # templates there
    one = PairsDataset(path=str(plain[0]), **common)
    with pytest.raises(DataError) as err:
        build_dataloader(one, local_batch_size=2, dp_rank=0, dp_world_size=1, seed=0, step_samples=2, same_source=True)
    _one_line(err, "data.same_source_batches=true", "is one source", "join several with '::'")
    small = PairsDataset(path=_joined([plain[0], plain[0]]), factors=[1.0, 0.5], **common)
    with pytest.raises(DataError) as err:
        build_dataloader(
            small, local_batch_size=2, dp_rank=0, dp_world_size=2, seed=0, step_samples=4, same_source=True
        )
    _one_line(err, "source 2 of data.path gives 3 samples per epoch, fewer than the 4", "data.upsampling_factors")


@needs("hf")
def test_the_train_log_averages_each_sources_loss(tmp_path: Path) -> None:
    """With one source per step, each log record holds `loss/<file>`: the mean loss of that file's steps
    since the last log line (logged every step: that step's loss, named after the file its samples
    came from; once for 4 steps: the first run's losses averaged by file); without same_source_batches none."""
    files = _files(tmp_path, sizes=(10, 8))
    common = (
        _joined(files),
        "--training.local_batch_size=3",
        "--training.global_batch_size=6",
        "--training.steps=4",
        "--loss.mask_duplicates=false",
        "--data.upsampling_factors=1,1.5",
        "--eval.enable=false",
    )

    def train(folder: str, *extra: str) -> tuple[list[dict], list[int]]:
        trainer = make_trainer(tmp_path / folder, *common, *extra)
        sampler = trainer.loader.sampler  # epoch 0's steps and their sources
        sources = [_source_of([10, 12])[step[0]] for step in _steps(sampler)] if sampler.step_samples else []
        trainer.train()
        trainer.metrics.close()
        logged = [json.loads(line) for line in (tmp_path / folder / "run" / "metrics.jsonl").read_text().splitlines()]
        return [r for r in logged if r["kind"] == "train"], sources

    each, sources = train("each", "--data.same_source_batches=true", "--metrics.log_freq=1")
    names = [[k[len("loss/") :] for k in r if k.startswith("loss/")] for r in each]
    assert all(len(n) == 1 for n in names) and [n[0] for n in names[:3]] == [files[s].name for s in sources]
    assert all(r[f"loss/{n[0]}"] == r["loss"] for r, n in zip(each, names))
    (window,), _ = train("window", "--data.same_source_batches=true", "--metrics.log_freq=4")
    by_file: dict[str, list[float]] = {}  # 4 steps of 2 files: one file has 2 or more in the window
    for r, n in zip(each, names):
        by_file.setdefault(f"loss/{n[0]}", []).append(r["loss"])
    assert max(len(v) for v in by_file.values()) >= 2 and window["step"] == 4
    assert {k: v for k, v in window.items() if k.startswith("loss/")} == {
        k: sum(v) / len(v) for k, v in by_file.items()
    }
    mixed, _ = train("mixed", "--metrics.log_freq=1", "--training.steps=2")
    assert not any(k.startswith("loss/") for r in mixed for k in r)


@needs("hf")
def test_trainer_prompts_each_source_and_not_the_held_out_file(tmp_path: Path) -> None:
    """From the TOML and the command line (one argument per prompt, commas kept): the training files
    through their prompts, the held-out file through the model's (none for the bundled MiniLM)."""
    files = _files(tmp_path, sizes=(8, 6))
    config = tmp_path / "prompts.toml"
    config.write_text(f"[data]\nquery_prompts = {json.dumps(PROMPTS['query_prompts'])}\n")
    trainer = make_trainer(
        tmp_path,
        _joined(files),
        f"--job.config_file={config}",
        "--data.doc_prompts",
        *PROMPTS["doc_prompts"],
        "--training.local_batch_size=7",
        "--training.steps=2",
        "--metrics.log_freq=1",
        f"--data.val_path={files[1]}",
    )
    assert trainer.cfg.data.query_prompts == PROMPTS["query_prompts"]
    assert trainer.cfg.data.doc_prompts == PROMPTS["doc_prompts"]
    common = dict(tokenizer=trainer.train_set.tokenizer, query_length=16)
    written = PairsDataset(split="train", path=_joined(_prefixed(files, tmp_path / "prefixed", **PROMPTS)), **common)
    for key, value in trainer.train_set.__getitems__(range(14)).items():
        assert torch.equal(value, written.__getitems__(range(14))[key]), key
    held_out = PairsDataset(split="test", path=str(files[1]), **common).__getitems__(range(6))
    assert all(torch.equal(v, trainer.eval_set.__getitems__(range(6))[k]) for k, v in held_out.items())
    trainer.train()
    trainer.metrics.close()
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if r["kind"] == "train"] == [1, 2]


@needs("hf")
def test_held_out_file_beside_weighted_training_files(tmp_path: Path) -> None:
    """data.upsampling_factors weigh the training sources only: one held-out file is read as it is."""
    files = _files(tmp_path, sizes=(8, 8))
    trainer = make_trainer(
        tmp_path,
        _joined(files),
        "--training.local_batch_size=4",
        "--data.upsampling_factors=1,0.5",
        f"--data.val_path={files[0]}",
    )
    assert len(trainer.train_set) == 12 and len(trainer.eval_set) == 8
    trainer.metrics.close()


def test_weighted_sources(emoji: dict) -> None:
    """`a::b` with factors 1 and 0.5: 200 + 100 samples per epoch; the half window moves per epoch."""
    paths = emoji["paths"]
    source = open_source("csv", f"{paths['csv']}::{paths['csv']}", Data(upsampling_factors=[1.0, 0.5]))
    assert len(source) == 300
    windows = []
    for epoch in range(6):
        source.set_epoch(epoch)
        windows.append({source.mix.locate(i, epoch)[1] for i in range(200, 300)})
    assert all(len(w) == 100 for w in windows) and len(set().union(*windows)) == 200
    with pytest.raises(DataError, match="one factor per"):
        open_source("csv", paths["csv"], Data(upsampling_factors=[1.0, 2.0]))
    assert len(open_source("csv", paths["csv"], Data(upsampling_factors=[1.0, 2.0]), split="test")) == 200
    # data.same_source_batches: each step of 2 ranks x 10 from one source
    assert _dataset(emoji, "csv", augment=False).source_sizes is None
    ds = FileImageTextDataset(
        name="csv", split="train", source=source, tokenizer=ByteTokenizer(32), image_size=32, seed=3, augment=False
    )
    assert ds.source_sizes == [200, 100]
    ranks = [
        build_dataloader(ds, local_batch_size=10, dp_rank=r, dp_world_size=2, seed=0, step_samples=20, same_source=True)
        for r in range(2)
    ]
    assert ranks[0].steps_per_epoch == 15
    for _ in range(15):
        both = [i for loader in ranks for i in next(loader)["index"].tolist()]
        assert len({i >= 200 for i in both}) == 1


def test_a_joined_sources_bad_sample_is_substituted_from_its_own_source(emoji: dict, tmp_path: Path) -> None:
    """damaged.csv at 11/40 (rows 0-10 in epoch 0) joined with another CSV (other emoji): index 10
    (missing.png), the last of its source's range, takes index 0's record, not the next source's first
    (index 11)."""
    other = tmp_path / "other.csv"
    with open(other, "w", newline="") as f:
        writer = csv.writer(f, delimiter="\t")
        writer.writerows([("filepath", "title"), *((str(emoji["root"] / p), c) for p, c in emoji["rows"][100:140])])
    source = open_source("csv", f"{_damaged_csv(emoji, tmp_path)}::{other}", Data(upsampling_factors=[11 / 40, 1.0]))
    assert source.sizes == [11, 40] and [source.mix.following(i) for i in (9, 10, 11, 50)] == [10, 0, 12, 11]
    ds = FileImageTextDataset(
        name="csv", split="train", source=source, tokenizer=ByteTokenizer(32), image_size=32, seed=3, augment=False
    )
    batch = ds.__getitems__([10, 0, 11])
    assert [s.reason for s in batch[BAD_SAMPLES]] == ["unreadable_file"]
    assert torch.equal(batch["text"][0], batch["text"][1]) and not torch.equal(batch["text"][0], batch["text"][2])
