"""The ranks of a run sharing a token table's tokenization (`datasets/token_table.py`, `group`): on 2 and 4 gloo
processes each rank tokenizes only the chunks it owns (every `world`-th), and every rank's table is the tokenizer's
own padded call on every text, as a table built alone is; with fewer chunks than ranks, with no text at all, and in
text pairs and a WordNet folder built as the trainer builds them (`build_data` with the ranks' `host_group`). A rank
that read other texts ends every rank with a DataError."""

from __future__ import annotations

import dataclasses
import gzip
import json
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from tests.needs import needs
from tests.test_hf_text import PAIRS
from tests.test_token_table import _own_call
from titan_contrastive.datasets.base import DataError


def _texts(distinct: int) -> list[str]:
    """`distinct` texts (the longer ones cut at the lengths used), each 1 to 3 times, in a shuffled order."""
    pool = [f"{q} {d}" for q, d in PAIRS] + [q for q, _ in PAIRS] + ["Café naïve 雪 🙂 dog"]
    texts = [t for n, t in enumerate(pool[:distinct]) for _ in range(1 + n % 3)]
    random.Random(0).shuffle(texts)
    return texts


@contextmanager
def _counted() -> Iterator[list[int]]:
    """How many texts each call of `PairTokenizer.token_rows` tokenizes in this process while in the block."""
    from titan_contrastive.datasets.tokenizer import PairTokenizer

    own, calls = PairTokenizer.token_rows, []

    def counted(self: PairTokenizer, texts: list[str], length: int) -> list[list[int]]:
        calls.append(len(texts))
        return own(self, texts, length)

    PairTokenizer.token_rows = counted
    try:
        yield calls
    finally:
        PairTokenizer.token_rows = own


def _shared_table(distinct: int, chunk: int, left: bool) -> None:
    from titan_contrastive.datasets import token_table
    from titan_contrastive.models.bi_encoder import BiEncoderArgs, build_tokenizer
    from titan_contrastive.parallelisms import host_group

    dist.init_process_group("gloo")
    group, world, rank = host_group(), dist.get_world_size(), dist.get_rank()
    token_table.CHUNK = chunk
    tokenizer = dataclasses.replace(build_tokenizer(BiEncoderArgs()), pad_left=left)
    texts = _texts(distinct)
    with _counted() as tokenized:
        table = token_table.TokenTable(tokenizer, iter(texts), 24, group)
    step = max(1, chunk // world)  # a shared table's chunks: CHUNK / world texts
    sizes = [min(step, distinct - c) for c in range(0, distinct, step)]
    assert tokenized == sizes[rank::world], (rank, tokenized, sizes)  # the chunks it owns, nothing else
    assert len(table) == len(texts) and table.distinct == distinct
    if texts:
        want = _own_call(tokenizer, texts, 24, left)
        assert torch.equal(table[torch.arange(len(texts))], want)
        places = torch.randint(0, len(texts), (5, 3), generator=torch.Generator().manual_seed(rank))
        assert torch.equal(table[places], want[places])
    assert table.nbytes == token_table.TokenTable(tokenizer, iter(texts), 24).nbytes


@needs("hf")
@pytest.mark.parametrize(
    "world,distinct,chunk,left",
    [(2, 13, 6, False), (4, 13, 12, True), (4, 5, 12, False), (2, 0, 6, False)],
    ids=["2-ranks-5-chunks", "4-ranks-left-padded", "4-ranks-2-chunks", "2-ranks-no-text"],
)
def test_each_rank_tokenizes_its_chunks_and_holds_the_whole_table(
    world: int, distinct: int, chunk: int, left: bool
) -> None:
    run_distributed(_shared_table, world, distinct, chunk, left)


def _other_texts(change: str) -> None:
    from titan_contrastive.datasets.token_table import TokenTable
    from titan_contrastive.models.bi_encoder import BiEncoderArgs, build_tokenizer
    from titan_contrastive.parallelisms import host_group

    dist.init_process_group("gloo")
    texts = _texts(9)
    first, second = texts[0], next(t for t in texts if t != texts[0])
    if dist.get_rank() == 1 and change == "a repeated text":
        texts[next(i for i, t in enumerate(texts) if texts.count(t) > 1)] += " changed"  # one more distinct text
    elif dist.get_rank() == 1 and change == "a text":
        texts[next(i for i, t in enumerate(texts) if texts.count(t) == 1)] += " changed"  # as many of each
    elif change == "two places":  # two repeats at the end, swapped on rank 1: the same distinct texts in one order
        texts += [second, first] if dist.get_rank() == 1 else [first, second]
    count, distinct = (20, 9) if change == "two places" else (18, 10 if change == "a repeated text" else 9)
    with pytest.raises(
        DataError,
        match=rf"ranks 0 and 1 .* different texts .* \({count} texts, 9 distinct, against {count} and {distinct}\)",
    ):
        TokenTable(build_tokenizer(BiEncoderArgs()), texts, 24, host_group())


@needs("hf")
@pytest.mark.parametrize("change", ["a repeated text", "a text", "two places"])
def test_a_rank_that_read_other_texts_ends_every_rank(change: str) -> None:
    run_distributed(_other_texts, 2, change)


def _pairs_as_trained(path: str, dataset: str) -> None:
    from titan_contrastive import models
    from titan_contrastive.config.manager import parse_args
    from titan_contrastive.datasets import build_dataset, token_table
    from titan_contrastive.datasets.build import build_data
    from titan_contrastive.parallelisms import host_group

    dist.init_process_group("gloo")
    token_table.CHUNK = 4
    given = ["--model.name=bi_encoder", "--model.flavor=shared", f"--data.dataset={dataset}", f"--data.path={path}"]
    if dataset == "pairs":  # held out: the same rows
        given += [f"--data.val_path={path}", "--data.negatives_per_row=2"]
    cfg = parse_args([*given, "--training.local_batch_size=4"])
    spec = models.get_model_spec("bi_encoder")
    args = models.configured(models.resolve_model_args("bi_encoder", "shared", "")[0], cfg, spec)

    def built(group: Callable[[], dist.ProcessGroup | None] | None) -> tuple:
        data = build_data(
            cfg,
            family_tokenizer=lambda: spec.build_tokenizer(args),
            prepare=lambda ds: spec.layout.prepare(ds, args, cfg.data.image_sizes, cfg.model.name),
            build_bundled=build_dataset,
            dp_rank=dist.get_rank(),
            dp_degree=dist.get_world_size(),
            pin_memory=False,
            host_group=group,
        )
        return data.train_set, data.eval_set

    with _counted() as tokenized:
        shared = built(host_group)
    with _counted() as alone_tokenized:
        alone = built(None)
    count = torch.tensor(sum(tokenized))
    dist.all_reduce(count)
    assert count == sum(alone_tokenized)  # between them, the ranks tokenized each text once (both splits' tables)
    for a, b in zip(shared, alone):
        for epoch in (0, 1):
            a.set_epoch(epoch), b.set_epoch(epoch)
            every = list(range(len(a)))
            want, got = b.__getitems__(every), a.__getitems__(every)
            assert want.keys() == got.keys() and all(torch.equal(got[k], want[k]) for k in want), epoch


@needs("hf")
@pytest.mark.parametrize("dataset", ["pairs", "wordnet"])
def test_a_pairs_set_built_on_two_ranks_serves_what_one_builds_alone(tmp_path: Path, dataset: str) -> None:
    """FlagEmbedding rows whose passages repeat across rows, trained and held out, and a WordNet folder (definition,
    lemma, negative lemma): every batch of two epochs (the drawn negatives move) the same from the shared tables as
    from tables each rank builds alone."""
    draw = random.Random(2)
    if dataset == "pairs":
        corpus = [f"{d} ({n})" for n, (_, d) in enumerate(PAIRS)]
        rows = [{"query": q, "pos": [draw.choice(corpus)], "neg": draw.sample(corpus, 3)} for q, _ in PAIRS]
        path = tmp_path / "rows.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        path = tmp_path
        for split, part in (("train", PAIRS[:-4]), ("test", PAIRS[-4:])):
            lines = "".join(f"{q}\t{d}\t{draw.choice(PAIRS)[1]}\n" for q, d in part)
            (tmp_path / f"pairs_{split}.tsv.gz").write_bytes(gzip.compress(lines.encode()))
    run_distributed(_pairs_as_trained, 2, str(path), dataset)
