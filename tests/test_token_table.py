"""A text-pairs set's texts tokenized once each and kept unpadded (`datasets/token_table.py`): a table's rows are the
tokenizer's own padded, truncated ids of each text (right and left padding, a decoder's -1 padding, chunks that
divide nothing, repeated texts, an index of any shape), and a `PairsDataset` of FlagEmbedding rows over two sources
with prompts serves exactly the dense tokenization of its queries and drawn documents."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import torch

from tests.hf_folders import decoder_folder, encoder_folder
from tests.needs import needs
from tests.test_hf_text import PAIRS
from tests.test_negative_pools import write_jsonl
from titan_contrastive.batching import NEGATIVES
from titan_contrastive.datasets import token_table
from titan_contrastive.datasets.pairs import PairsDataset
from titan_contrastive.datasets.token_table import TokenTable

FOLDERS = {"encoder": encoder_folder, "decoder": decoder_folder}


def _own_call(tokenizer, texts: list[str], length: int, left: bool) -> torch.Tensor:
    """The definition: the Hugging Face tokenizer's own call padded to `length` and truncated, the real tokens moved
    to the right end of each row when `left`, else to the left, and padding written as the tokenizer's pad value."""
    out = tokenizer.hf(texts, padding="max_length", truncation=True, max_length=length)
    ids, real = torch.tensor(out["input_ids"]), torch.tensor(out["attention_mask"]).bool()
    order = torch.argsort(real.int() if left else (~real).int(), dim=1, stable=True)
    ids, real = ids.gather(1, order), real.gather(1, order)
    return ids.masked_fill(~real, tokenizer.hf.pad_token_id if tokenizer.pad_id is None else tokenizer.pad_id)


@needs("hf")
@pytest.mark.parametrize("left", [False, True], ids=["right", "left"])
@pytest.mark.parametrize("kind", ["minilm", "encoder", "decoder"])
def test_a_table_is_each_text_tokenized_and_padded(
    tmp_path: Path, kind: str, left: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from titan_contrastive.models.bi_encoder import BiEncoderArgs, build_tokenizer

    monkeypatch.setattr(token_table, "CHUNK", 3)  # 8 distinct texts: chunks of 3, 3 and 2
    args = BiEncoderArgs() if kind == "minilm" else BiEncoderArgs(path=str(FOLDERS[kind](tmp_path)))
    tokenizer = dataclasses.replace(build_tokenizer(args), pad_left=left)
    long = " ".join(w for q, d in PAIRS for w in (q + " " + d).split())
    distinct = [q for q, _ in PAIRS[:5]] + [long, "Café naïve 雪 🙂 dog", "frozen [SEP] water <|endoftext|> ice"]
    texts = distinct * 5
    random.Random(0).shuffle(texts)
    places = torch.randint(0, len(texts), (7, 3), generator=torch.Generator().manual_seed(0))
    for length in (6, 24, 64):
        table = TokenTable(tokenizer, iter(texts), length)
        want = _own_call(tokenizer, texts, length, left)
        assert len(table) == len(texts) and table.distinct == len(distinct)
        assert table[torch.arange(len(texts))].dtype == torch.int64
        assert torch.equal(table[torch.arange(len(texts))], want), length
        assert torch.equal(table[places], want[places]), length
        assert torch.equal(tokenizer.encode(texts, length), want), length  # the one padding, through encode too
    assert table.nbytes < want.nbytes


@needs("hf")
def test_a_pairs_set_serves_each_text_as_it_was_tokenized(tmp_path: Path) -> None:
    """FlagEmbedding rows in two files that share passages, each file with its prompts and some rows with their own
    instruction: every batch's queries and drawn documents equal the tokenizer's call on each text, prompt first;
    each distinct (prompt, text) is tokenized once."""
    from titan_contrastive.models.bi_encoder import BiEncoderArgs, build_tokenizer

    tokenizer = build_tokenizer(BiEncoderArgs())
    draw = random.Random(1)
    corpus = [f"{d} and {q}" for q, d in PAIRS]
    files, want_queries, want_docs = [], [], []
    for source, (query_prompt, doc_prompt) in enumerate((("qa: ", "da: "), ("qb: ", "db: "))):
        rows = [
            {"query": q, "pos": draw.sample(corpus, 2), "neg": draw.sample(corpus, 4)}
            | ({"prompt": "own instruction: "} if n % 3 == 0 else {})
            for n, (q, _) in enumerate(PAIRS[source * 6 : source * 6 + 6])
        ]
        files.append(str(write_jsonl(tmp_path / f"{source}.jsonl", rows)))
        want_queries += [r.get("prompt", query_prompt) + r["query"] for r in rows]
        want_docs += [doc_prompt + t for r in rows for t in r["pos"] + r["neg"]]
    ds = PairsDataset(
        split="train",
        path="::".join(files),
        tokenizer=tokenizer,
        query_length=16,
        negatives_per_row=3,
        seed=2,
        query_prompts=["qa: ", "qb: "],
        doc_prompts=["da: ", "db: "],
    )
    queries, docs = tokenizer.encode(want_queries, 16), tokenizer.encode(want_docs, tokenizer.doc_length)
    for epoch in range(3):
        ds.set_epoch(epoch)
        indices = list(range(len(ds)))[::-1]
        batch, at, rows = ds.__getitems__(indices), ds.documents(indices), ds.rows(indices)
        assert torch.equal(batch["query"], queries[rows])
        assert torch.equal(batch["doc"], docs[at[:, 0]]) and torch.equal(batch[NEGATIVES], docs[at[:, 1:]])
    assert ds._documents.distinct == len(set(want_docs)) < len(want_docs)
