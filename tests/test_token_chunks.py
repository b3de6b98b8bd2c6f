"""Token-aware GradCache chunks (`batching/tokens.py`): each chunk cut to its longest sequence,
`chunk_tokens` packing length-sorted samples, against a plain dense full-batch backward.

The text tower is a tiny random BertModel (2 layers, hidden 32, no download) that really reads
the attention mask, mean-pooled; float64, dropout off (chunks of other sizes than the dense
reference's would draw other masks), rel. err <= 1e-10 on the loss and every parameter gradient.
The dense reference runs the whole, untrimmed batch at once.
"""

from __future__ import annotations

import copy
import datetime
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.dist_utils import run_distributed
from tests.needs import require
from titan_contrastive.batching import BatchError, split_inputs
from titan_contrastive.batching import tokens as tokens_module
from titan_contrastive.batching.tokens import padded_fields, right_trimmed, token_chunks, trim_padding
from titan_contrastive.grad_cache import GradCache, GradCacheError

require("hf")

import transformers  # noqa: E402

REL = 1e-10
B, L, VOCAB = 13, 24, 60  # chunk sizes below do not divide B


class TextTower(nn.Module):
    """Mean-pooled tiny BERT over a Hugging Face-style dict; records the [rows, columns] of every call."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        config = transformers.BertConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=L,
            type_vocab_size=2,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        torch.manual_seed(seed)
        self.bert = transformers.BertModel(config, add_pooling_layer=False).double()
        self.calls: list[tuple[int, int]] = []

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        self.calls.append(tuple(input_ids.shape))
        hidden = self.bert(
            input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
        ).last_hidden_state
        weights = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * weights).sum(1) / weights.sum(1)


def texts(n: int = B, seed: int = 1, short: bool = False, types: bool = True) -> dict[str, torch.Tensor]:
    """Right-padded random texts of varied lengths (one at the full width unless `short`)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, L // 2 if short else L, (n,), generator=g)
    if not short:
        lengths[n // 2] = L
    real = torch.arange(L) < lengths[:, None]
    batch = {"input_ids": torch.randint(1, VOCAB, (n, L), generator=g) * real, "attention_mask": real.long()}
    if types:
        batch["token_type_ids"] = torch.randint(0, 2, (n, L), generator=g) * real
    return batch


def symmetric_infonce(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    logits = F.normalize(q, dim=-1) @ F.normalize(d, dim=-1).T * 20.0
    labels = torch.arange(len(q))
    return 0.5 * (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels))


def dense(models: list[nn.Module], inputs: list[dict[str, torch.Tensor]]) -> tuple[float, list[torch.Tensor]]:
    """The plain full-batch backward: every model on its whole, untrimmed input."""
    copies: dict[int, nn.Module] = {}
    models = [copies.setdefault(id(m), copy.deepcopy(m)) for m in models]
    loss = symmetric_infonce(*(m(**x) for m, x in zip(models, inputs)))
    loss.backward()
    return loss.item(), grads(models)


def grads(models: list[nn.Module]) -> list[torch.Tensor]:
    unique = list({id(m): m for m in models}.values())
    out = []
    for m in unique:
        for p in m.parameters():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            out.append(g.full_tensor() if hasattr(g, "full_tensor") else g)
    return out


def assert_close(loss: float, got: list[torch.Tensor], want_loss: float, want: list[torch.Tensor]) -> None:
    """Loss and each parameter's gradient within REL of the reference's. The attention key biases'
    gradient is zero in exact arithmetic (a shift shared by all keys leaves the softmax as it is), so
    what both runs hold there is float residue (~1e-20): a gradient that small is held to REL of the
    whole gradient's norm instead of its own."""
    assert abs(loss - want_loss) <= REL * abs(want_loss), (loss, want_loss)
    assert len(got) == len(want)
    total = torch.sqrt(sum(w.norm() ** 2 for w in want))
    for i, (g, w) in enumerate(zip(got, want)):
        err = ((g - w).norm() / (w.norm() if w.norm() > 1e-12 * total else total)).item()
        assert err <= REL, f"parameter {i}: relative error {err:.2e}"


def run_cache(
    models: list[nn.Module], inputs: list[dict[str, torch.Tensor]], **kwargs: Any
) -> tuple[float, list[torch.Tensor]]:
    for m in models:
        m.zero_grad(set_to_none=True)
        m.calls.clear()
    loss = GradCache(models, kwargs.pop("chunk_sizes", 4), symmetric_infonce, **kwargs).cache_step(*inputs)
    return loss.item(), grads(models)


# ------------------------------------------------------------------ the pieces


def test_trim_padding_cuts_only_the_padded_columns() -> None:
    batch = texts(6, short=True)
    batch |= {"index": torch.arange(6), "image": torch.randn(6, 3, L), "flag": "kept"}
    longest = int(batch["attention_mask"].sum(1).max())
    out = trim_padding(batch)
    assert all(out[k].shape == (6, longest) for k in ("input_ids", "attention_mask", "token_type_ids"))
    assert torch.equal(out["input_ids"], batch["input_ids"][:, :longest]) and out["image"] is batch["image"]
    assert out["index"] is batch["index"] and out["flag"] == "kept"
    full = texts(6)  # one row at the full width: nothing to cut
    assert trim_padding(full) is full
    images = {"image": torch.randn(6, 3, 8, 8), "text": torch.randint(0, 5, (6, 8))}  # no mask, no pad ids: untouched
    assert trim_padding(images) is images and trim_padding(images["text"]) is images["text"]
    # pad ids name right-padded ids without a mask (the bi_encoder's query/doc), each field on its own
    ids = {"query": torch.tensor([[5, 6, 0, 0, 0], [7, 0, 0, 0, 0]]), "doc": torch.tensor([[3, 0, 0], [3, 4, 0]])}
    cut = trim_padding(ids, {"query": 0, "doc": 0})
    assert cut["query"].tolist() == [[5, 6], [7, 0]] and cut["doc"].tolist() == [[3, 0], [3, 4]]
    # interior padding stays, left padding is never cut, an all-padding chunk keeps one column
    assert right_trimmed(torch.tensor([[4, 0, 4, 0]]), 0).tolist() == [[4, 0, 4]]
    assert right_trimmed(torch.tensor([[0, 0, 4], [0, 4, 4]]), 0).shape == (2, 3)
    assert right_trimmed(torch.zeros(2, 5, dtype=torch.long), 0).shape == (2, 1)
    assert [f.keys for f in padded_fields(batch)] == [("input_ids", "attention_mask", "token_type_ids")]


def test_token_chunks_sort_and_pack_to_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    q = torch.tensor([3, 9, 2, 9, 5, 4, 2, 7, 6, 3])  # query lengths
    d = torch.tensor([2, 1, 3, 2, 1, 2, 1, 1, 2, 2])  # doc lengths
    batch = {"query": (torch.arange(12) < q[:, None]).long() * 7, "doc": (torch.arange(4) < d[:, None]).long() * 7}
    order, sizes = token_chunks(batch, 30, {"query": 0, "doc": 0})
    total = (q + d)[order]
    assert sorted(order.tolist()) == list(range(10)) and total.tolist() == sorted(total.tolist(), reverse=True)
    assert order[:2].tolist() == [3, 1]  # ties in batch order (9+2 before 9+1)
    start = 0
    for n in sizes:
        rows = order[start : start + n]
        cost = n * int(q[rows].max() + d[rows].max())
        assert cost <= 30 or n == 1
        if start + n < 10:  # greedy: one more sample would not have fit
            more = order[start : start + n + 1]
            assert (n + 1) * int(q[more].max() + d[more].max()) > 30
        start += n
    assert sizes == [2, 3, 4, 1]
    assert token_chunks(batch, 1, {"query": 0, "doc": 0})[1] == [1] * 10  # a sample over budget is a chunk alone
    # another rank runs 6 chunks: this one splits its largest chunks in two until it has as many
    monkeypatch.setattr(tokens_module, "max_over_ranks", lambda value, group: 6)
    assert token_chunks(batch, 30, {"query": 0, "doc": 0})[1] == [2, 2, 1, 2, 2, 1]
    with pytest.raises(BatchError, match="has no padded token field"):
        token_chunks({"image": torch.randn(4, 3)}, 30)
    with pytest.raises(BatchError, match="chunk_tokens=0 for input: must be an integer >= 1"):
        token_chunks(batch, 0, {"query": 0})
    with pytest.raises(GradCacheError, match="does not combine with split_input_fn"):
        GradCache([TextTower()], 4, symmetric_infonce, split_input_fn=split_inputs, chunk_tokens=30)


# ------------------------------------------------------------------ GradCache against the dense backward


@pytest.mark.parametrize("chunk_sizes", [[4, 5], [3, 3]])
def test_trimmed_chunks_match_dense(chunk_sizes: list[int]) -> None:
    """Two towers; every chunk forwards at its longest sequence, both passes; equals dense untrimmed."""
    q, d = TextTower(0), TextTower(1)
    inputs = [texts(seed=1), texts(seed=2, types=False)]
    want = dense([q, d], inputs)
    loss, got = run_cache([q, d], inputs, chunk_sizes=chunk_sizes)
    assert_close(loss, got, *want)
    for tower, x, size in ((q, inputs[0], chunk_sizes[0]), (d, inputs[1], chunk_sizes[1])):
        widths = [int(c["attention_mask"].sum(1).max()) for c in split_inputs(x, size)]
        assert [w for _, w in tower.calls] == widths * 2  # the no-graph pass and the re-forward, each chunk trimmed
        assert min(widths) < L
    assert_close(*run_cache([q, d], inputs, chunk_sizes=chunk_sizes, trim_padding=False), *want)
    assert {w for _, w in q.calls} == {L}  # trim_padding=False: every chunk at the full width


@pytest.mark.parametrize("budget", [45, 100])
def test_chunk_tokens_match_dense_and_ignore_the_sample_order(budget: int) -> None:
    """One tower for both sides (tied, like the bi_encoder's shared MiniLM); uneven token chunks;
    a permuted batch gives the same loss and gradients; both equal the dense full-batch backward."""
    m = TextTower(0)
    x, y = texts(seed=3), texts(seed=4)
    want = dense([m, m], [x, y])
    loss, got = run_cache([m, m], [x, y], chunk_tokens=budget)
    assert_close(loss, got, *want)
    rows = [r for r, _ in m.calls[: len(m.calls) // 2]]
    assert sum(rows) == 2 * B and len(set(rows)) > 1  # uneven chunks over both inputs
    assert all(r * w <= budget or r == 1 for r, w in m.calls)
    perm = torch.randperm(B, generator=torch.Generator().manual_seed(9))
    px, py = ({k: v[perm] for k, v in t.items()} for t in (x, y))
    assert_close(*run_cache([m, m], [px, py], chunk_tokens=budget), loss, got)
    assert_close(*dense([m, m], [px, py]), *want)


def test_no_padding_information_changes_nothing() -> None:
    """Images / plain tensors (the clip family): the chunks are split_inputs' as they were."""
    images = {"image": torch.randn(B, 3, 4, 4), "text": torch.randint(0, 9, (B, 8))}
    gc = GradCache([nn.Identity()], 4, symmetric_infonce)
    for got, want in zip(gc.split(images, 4), split_inputs(images, 4), strict=True):
        assert all(got[k] is not None and torch.equal(got[k], want[k]) and got[k].shape == want[k].shape for k in want)
    with pytest.raises(GradCacheError, match="input 0 has no padded token field"):
        GradCache([nn.Identity(), nn.Identity()], 4, symmetric_infonce, chunk_tokens=64).cache_step(images, images)


def test_bi_encoder_tower_call_trims_exactly() -> None:
    """The bi_encoder's embed cuts its ids to the longest row: embeddings equal the untrimmed ones."""
    from titan_contrastive.models.bi_encoder.embedding import embed

    tower = TextTower(0).bert
    batch = texts(6, short=True, types=False)
    ids = batch["input_ids"]
    seen: list[int] = []
    hook = tower.register_forward_hook(
        lambda mod, args, kwargs, out: seen.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    got = embed(tower, ids, 0, "mean", 0)
    hook.remove()
    hidden = tower(input_ids=ids, attention_mask=batch["attention_mask"]).last_hidden_state
    w = batch["attention_mask"].unsqueeze(-1).double()
    want = F.normalize((hidden * w).sum(1) / w.sum(1), dim=-1)
    assert seen == [int(batch["attention_mask"].sum(1).max())] and seen[0] < L
    assert ((got - want).norm() / want.norm()).item() <= REL


# ------------------------------------------------------------------ the trainer: bi_encoder / MiniLM


def test_trainer_chunk_tokens_on_minilm(tmp_path: Path) -> None:
    """[gradcache] chunk_tokens in the trainer (bi_encoder, float64, dropout off): the step's loss
    and gradients equal a dense full-batch backward, for the batch and a permutation of it."""
    from tests.test_wordnet_bi_encoder import bundle_subset
    from titan_contrastive.config import ConfigError, parse_args
    from titan_contrastive.losses import InfoNCE
    from titan_contrastive.train import Trainer

    common = [
        "--data.dataset=wordnet",
        "--training.dtype=float64",
        "--training.local_batch_size=7",
        "--data.context_length=24",
        "--metrics.enable_tensorboard=false",
        "--eval.enable=false",
        "--gradcache.enabled=true",
        "--data.hard_negatives=false",  # WordNet's mined negatives are tested in test_wordnet_bi_encoder.py
    ]
    trainer = Trainer(
        parse_args(
            [
                "--model.name=bi_encoder",
                "--model.flavor=shared",
                *common,
                f"--data.path={bundle_subset(tmp_path / 'wordnet')}",
                "--gradcache.chunk_tokens=60",
                f"--job.dump_folder={tmp_path / 'a'}",
            ]
        )
    )
    assert "chunks of <= 60 tokens" in trainer.gradient_step.describe()
    model = trainer.model.eval()  # no dropout: chunks of other shapes than the dense batch's draw other masks
    batch = trainer.train_set.__getitems__(list(range(100, 107)))
    calls: list[tuple[int, int]] = []
    model.query_tower.register_forward_hook(
        lambda mod, args, kwargs, out: calls.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )

    def step(b: dict[str, torch.Tensor]) -> tuple[float, list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        calls.clear()
        loss = trainer.gradient_step([b])
        return loss, [p.grad.clone() for p in model.parameters()]

    got = step(batch)
    shapes = list(calls)
    model.zero_grad(set_to_none=True)
    q, d, scale = model(batch["query"], batch["doc"])
    want_loss = InfoNCE().dense(q, d, scale)
    want_loss.backward()
    want = (want_loss.item(), [p.grad.clone() for p in model.parameters()])
    assert_close(*got, *want)
    assert len({rows for rows, _ in shapes}) > 1 and all(w < 24 for _, w in shapes)  # uneven, trimmed chunks
    perm = torch.tensor([3, 6, 0, 5, 1, 4, 2])
    assert_close(*step({k: v[perm] for k, v in batch.items()}), *want)
    trainer.metrics.close()
    with pytest.raises(
        ConfigError, match="gradcache.chunk_tokens=60: the clip family's inputs are not padded token ids"
    ):
        Trainer(parse_args([*common[1:], "--gradcache.chunk_tokens=60", f"--job.dump_folder={tmp_path / 'b'}"]))


@pytest.mark.parametrize(
    "flags, fix",
    [
        (
            ["--gradcache.enabled=false"],
            "gradcache.enabled=false: set gradcache.enabled=true or gradcache.chunk_tokens=0",
        ),
        (
            ["--gradcache.enabled=true", "--loss.negatives=global"],
            "loss.negatives='global' .*: set loss.negatives=microbatch or gradcache.chunk_tokens=0",
        ),
        (
            ["--model.name=vae", "--model.flavor=debug", "--data.dataset=fashion_mnist"],
            "the vae family has its own step: set gradcache.chunk_tokens=0",
        ),
    ],
)
def test_chunk_tokens_where_no_gradcache_step_runs_is_an_error(tmp_path: Path, flags: list[str], fix: str) -> None:
    """A token budget that no step would use is a one-line error naming why and the fix, not ignored."""
    from titan_contrastive.config import ConfigError, parse_args
    from titan_contrastive.train import Trainer

    with pytest.raises(ConfigError, match=f"gradcache.chunk_tokens=64 packs GradCache chunks, .* but {fix}"):
        Trainer(
            parse_args(
                [
                    "--metrics.enable_tensorboard=false",
                    "--eval.enable=false",
                    "--gradcache.chunk_tokens=64",
                    *flags,
                    f"--job.dump_folder={tmp_path}",
                ]
            )
        )
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


# ------------------------------------------------------------------ data parallel: DDP and FSDP2 on 2 gloo processes


def _dp_token_chunks(wrapper: str) -> None:
    """Rank 0 has long texts, rank 1 short ones: alone they would run different numbers of chunks,
    but every forward holds a collective (DDP broadcasts BERT's buffers, FSDP2 gathers parameters),
    so both run as many as rank 0. The gradient is the mean of each rank's dense backward."""
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    budget = 60
    local = [texts(seed=10 + rank, short=rank == 1), texts(seed=20 + rank, short=rank == 1)]
    alone = len(token_chunks(local[0], budget)[1])  # before the process group: this rank's own plan
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))  # a mismatch fails instead of hanging
    world = dist.get_world_size()
    q, d = TextTower(0), TextTower(1)
    refs = []
    for r in range(world):
        inputs = [texts(seed=10 + r, short=r == 1), texts(seed=20 + r, short=r == 1)]
        refs.append(dense([q, d], inputs))
    want = [sum(ref[1][i] for ref in refs) / world for i in range(len(refs[0][1]))]
    if wrapper == "ddp":
        models = [nn.parallel.DistributedDataParallel(q), nn.parallel.DistributedDataParallel(d)]
    else:
        from torch.distributed.fsdp import fully_shard

        models = [fully_shard(q), fully_shard(d)]
    q.calls.clear()
    loss = GradCache(models, 4, symmetric_infonce, chunk_tokens=budget).cache_step(*local, no_sync_except_last=True)
    assert_close(loss.item(), grads([q, d]), refs[rank][0], want)
    counts = [None] * world
    dist.all_gather_object(counts, (alone, len(q.calls) // 2))
    assert len({ran for _, ran in counts}) == 1 and counts[0][0] > counts[1][0]  # equalized: rank 1 alone ran fewer
    assert counts[rank][1] == max(a for a, _ in counts)


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp"])
def test_two_processes_token_chunks_match_dense(wrapper: str) -> None:
    run_distributed(_dp_token_chunks, 2, wrapper)
