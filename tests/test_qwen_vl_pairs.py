"""The qwen_vl family on `data.dataset = "vl_pairs"` rows (a query image and text, a document image
and text): the retrieval modes whose two sides both need more than a caption, i2i, t2t, m2i and m2t,
each side with its own packed images (none for a text side). GradCache with fixed chunks and token
budgets equals the dense objective over the whole batch in float64; bad rows are substituted and
counted; what a mode cannot read is one line. Helpers shared with tests/test_qwen_vl.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed, write_once
from tests.hf_folders import vl_folder
from tests.needs import require
from tests.test_hard_negatives import assert_grads_close
from tests.test_hf_text import grads
from tests.test_qwen_vl import LORA, REL, _dense, _grid, _pictures_csv, _step, vl_run
from tests.test_trainer import make_trainer as base_trainer
from titan_contrastive.config import ConfigError
from titan_contrastive.datasets.base import DataError

require("hf")


def _vl_pairs(root: Path, bad: bool = False, negatives: str = "", count: int = 9) -> Path:
    """Nine JSONL rows of a query image and text and a document image and text, the images PNGs of
    different sizes; with `bad`, row 2's document image is missing and row 4's query text empty;
    `negatives` "image" or "text": two hard negatives per row in `doc_negatives` (images of sizes
    unlike their row's document), "multi" two `{"image", "text"}` objects; `count` rows (sizes cycled)."""
    import json

    from PIL import Image

    g = np.random.default_rng(1)
    (root / "img").mkdir(parents=True)
    sizes = [(28, 28), (56, 84), (84, 56), (40, 40), (60, 90), (28, 56), (70, 70), (30, 60), (56, 56)]
    rows = []
    for i in range(count):
        h, w = sizes[i % 9]
        Image.fromarray(g.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(root / "img" / f"q{i}.png")
        Image.fromarray(g.integers(0, 256, (w, h, 3), dtype=np.uint8)).save(root / "img" / f"d{i}.png")
        rows.append(
            {
                "query_image": f"img/q{i}.png",
                "query_text": f"a photo of a cat {i}",
                "doc_image": f"img/d{i}.png",
                "doc_text": f"a dog {i} in frozen water",
            }
        )
        if negatives in ("image", "multi"):
            for j, (nh, nw) in enumerate([sizes[(i + 3) % 9], sizes[(i + 5) % 9]]):
                Image.fromarray(g.integers(0, 256, (nh, nw, 3), dtype=np.uint8)).save(root / "img" / f"n{i}{j}.png")
            rows[-1]["doc_negatives"] = [f"img/n{i}0.png", f"img/n{i}1.png"]
            if negatives == "multi":  # an image and a text each, as the documents
                texts = [f"a cat {i} on a warm roof", "frozen water"]
                rows[-1]["doc_negatives"] = [{"image": p, "text": t} for p, t in zip(rows[-1]["doc_negatives"], texts)]
        elif negatives == "text":
            rows[-1]["doc_negatives"] = [f"a cat {i} on a warm roof", f"frozen water {i} without a dog"]
    if bad:
        rows[2]["doc_image"], rows[4]["query_text"] = "img/missing.png", " "
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root / "pairs.jsonl"


def _vl_pairs_run(tmp: Path, mode: str, *extra: str, bad: bool = False, negatives: str = ""):
    table = write_once(tmp / "data" / "pairs.jsonl", lambda: _vl_pairs(tmp / "data", bad, negatives))
    return vl_run(
        tmp,
        "qwen2_vl",
        "--data.dataset=vl_pairs",
        f"--data.path={table}",
        f"--data.retrieval_mode={mode}",
        "--training.local_batch_size=7",
        *extra,
        sizes=(),
    )


@pytest.mark.parametrize("mode", ["i2i", "t2t", "m2i", "m2t", "t2m", "i2m", "m2m"])
@pytest.mark.parametrize("chunks", ["--gradcache.chunk_sizes=4", "--gradcache.chunk_tokens=60"])
def test_vl_pairs_in_every_mode_equal_the_dense_objective(tmp_path: Path, mode: str, chunks: str) -> None:
    """i2i, t2t, m2i, m2t, t2m, i2m and m2m (m: an image and a text) on vl_pairs rows with images of different
    sizes: each side carries its own packed images (none for a text side); GradCache with fixed chunks and with a
    token budget equals the dense objective over the whole batch in float64."""
    trainer = _vl_pairs_run(tmp_path, mode, "--gradcache.enabled=true", chunks)
    trainer.model.eval()
    batch = trainer.train_set.__getitems__(list(range(7)))
    batch = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
    image_token = trainer.model.tower.config.image_token_id
    kinds = {"i2i": "ii", "t2t": "tt", "m2i": "mi", "m2t": "mt", "t2m": "tm", "i2m": "im", "m2m": "mm"}
    for side, kind in zip(("query", "doc"), kinds[mode]):
        grid, ids = batch[f"{side}_image_grid_thw"], batch[side]
        assert len(grid) == (0 if kind == "t" else 7)
        visual = (ids == image_token).sum(1)
        assert visual.tolist() == ((grid.prod(-1) // 4).tolist() if len(grid) else [0] * 7)
        words = (ids != -1).sum(1) - visual - (2 if len(grid) else 0)  # beside the vision start and end tokens
        assert (words > 0).all() if kind in "tm" else (words == 0).all()
    if mode == "t2t":
        assert not any(p.requires_grad for p in trainer.model.tower.visual.parameters())
    else:
        assert len({tuple(g) for g in _grid(batch).tolist()}) >= 3
    trainer.train_step([batch])
    want_loss, want = _dense(trainer, [batch])
    out = trainer.train_step([batch])
    assert_grads_close(grads(trainer.model), want)
    assert abs(out["loss"] - want_loss) <= REL * want_loss
    trainer.metrics.close()


HARD_NEGATIVE_CASES = [
    ("t2i", "--gradcache.chunk_sizes=4"),
    ("t2t", "--gradcache.chunk_tokens=90"),
    ("m2t", "--gradcache.chunk_sizes=3"),
    ("t2m", "--gradcache.chunk_tokens=200"),
    pytest.param("i2i", "--gradcache.chunk_tokens=200", marks=pytest.mark.slow),
    pytest.param("m2i", "--loss.negatives=global", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("mode", "step"), HARD_NEGATIVE_CASES)
def test_vl_pairs_hard_negatives_equal_the_definition(tmp_path: Path, mode: str, step: str) -> None:
    """Two hard negatives per row (`doc_negatives`: images of their own sizes where the documents are
    images, texts where they are texts, both where they are both, t2m): every query against the N (1 + k)
    documents, the documents against the queries; GradCache (fixed chunks, token budgets: a sample's negative
    images move with it) and global negatives equal the definition, with each negative embedded on its own, in
    float64."""
    from titan_contrastive.batching import NEGATIVES

    kind = {"t": "text", "i": "image", "m": "multi"}[mode[-1]]
    gradcache = () if "negatives=global" in step else ("--gradcache.enabled=true",)
    trainer = _vl_pairs_run(tmp_path, mode, *gradcache, step, negatives=kind)
    trainer.model.eval()
    assert trainer.train_set.num_negatives == 2
    batch = trainer.train_set.__getitems__(list(range(7)))
    batch = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
    assert batch[NEGATIVES].shape[:2] == (7, 2)
    assert len(batch["neg_image_grid_thw"]) == (0 if kind == "text" else 14)
    neg, image_token = batch[NEGATIVES], trainer.model.tower.config.image_token_id
    words = (neg != -1).sum(-1) - (neg == image_token).sum(-1) - (2 if kind != "text" else 0)  # beside vision start/end
    assert (words > 0).all() if kind != "image" else (words == 0).all()  # each negative's text where it reads one
    trainer.train_step([batch])
    want_loss, want = _dense(trainer, [batch])  # each negative embedded on its own (tests/test_qwen_vl._embeddings)
    out = trainer.train_step([batch])
    assert_grads_close(grads(trainer.model), want)
    assert abs(out["loss"] - want_loss) <= REL * want_loss
    trainer.metrics.close()


def test_m2t_masks_another_rows_copy_of_the_answer(tmp_path: Path) -> None:
    """m2t on rows whose answers repeat (as a VQA set's "yes" and "no") with `loss.mask_duplicates`: for each query
    the other rows' copies of its answer leave the softmax of both directions; GradCache in chunks of 3 equals that
    definition in float64."""
    import json

    import torch.nn.functional as F

    from tests.test_qwen_vl import _embeddings
    from tests.test_trainer import full

    table = _vl_pairs(tmp_path / "data")
    rows = [json.loads(line) for line in table.read_text().splitlines()]
    answers = [("a dog", "a cat on a warm roof", "frozen water")[i % 3] for i in range(len(rows))]  # in the vocabulary
    table.write_text("".join(json.dumps({**r, "doc_text": a}) + "\n" for r, a in zip(rows, answers)))
    trainer = _vl_pairs_run(
        tmp_path, "m2t", "--gradcache.enabled=true", "--gradcache.chunk_sizes=3", "--loss.mask_duplicates=true"
    )
    trainer.model.eval()
    batch = {k: v for k, v in trainer.train_set.__getitems__(list(range(7))).items() if isinstance(v, torch.Tensor)}
    assert len(set(trainer.step_context.document_ids(batch).tolist())) == 3  # three answers, by their token ids
    trainer.train_step([batch])
    model = trainer.spec.build_model(trainer.model_args).double()
    model.load_state_dict({k: full(v) for k, v in trainer.model.state_dict().items()})
    model.eval()
    q, d = _embeddings(model, batch)
    masked = torch.tensor([[c != i and answers[c] == answers[i] for c in range(7)] for i in range(7)])
    logits = (model.logit_scale.exp() * q @ d.T).masked_fill(masked, float("-inf"))
    labels = torch.arange(7)
    want_loss = 0.5 * (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels))
    want_loss.backward()
    out = trainer.train_step([batch])
    assert masked.sum() == 10 and abs(out["loss"] - want_loss.item()) <= REL * want_loss.item()
    assert_grads_close(grads(trainer.model), grads(model))
    trainer.metrics.close()


def test_documents_of_an_image_and_a_text_refuse_what_they_cannot_read(tmp_path: Path) -> None:
    """t2m: BEIR folders (documents of one kind) are one line; a multi document's hard negative that is not an
    `{"image", "text"}` object (a path alone) is a bad sample."""
    from tests.test_retrieval_metrics import write_beir

    beir = write_beir(tmp_path / "beir")
    with pytest.raises(DataError, match=r"read documents of one kind, texts or pages; data.retrieval_mode=t2m embeds"):
        _vl_pairs_run(tmp_path / "c", "t2m", "--eval.enable=true", f"--eval.beir_path={beir}")
    trainer = _vl_pairs_run(tmp_path / "a", "t2m", negatives="image")
    with pytest.raises(DataError, match=r'bad_negative \(doc_negatives: not an object \{"image": ..., "text": ...\}'):
        trainer.train_set.__getitems__([0])  # every row's negatives are paths alone: no good row to take its slot


def _two_ranks(tmp: str, mode: str, *extra: str) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    table = Path(tmp) / "data" / "pairs.jsonl"
    data = ("--data.dataset=vl_pairs", f"--data.path={table}", f"--data.retrieval_mode={mode}", *extra)
    _step(Path(tmp), "qwen2_vl", "global", *data, sizes=())
    _step(Path(tmp) / "gc", "qwen2_vl", "gradcache-tokens", *data, "--gradcache.chunk_tokens=200", sizes=())


DDP_LORA = ("--parallelism.data_parallel_shard_degree=1", "--parallelism.data_parallel_replicate_degree=2", *LORA)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "negatives", "extra"),
    [("i2i", "", ()), ("t2t", "text", ()), ("m2i", "image", ()), ("i2t", "text", DDP_LORA)],
)
def test_two_ranks(tmp_path: Path, mode: str, negatives: str, extra: tuple[str, ...]) -> None:
    """Two gloo processes, global negatives and GradCache with a token budget, against the dense objective
    over both ranks' rows: FSDP2 for i2i, t2t with negative texts and m2i with negative images; DDP with
    LoRA for i2t with negative texts."""
    _vl_pairs(tmp_path / "data", negatives=negatives, count=12)
    vl_folder(tmp_path, "qwen2_vl")
    vl_folder(tmp_path / "gc", "qwen2_vl")
    run_distributed(_two_ranks, 2, str(tmp_path), mode, *extra)


def test_vl_pairs_bad_rows_are_substituted_and_counted(tmp_path: Path) -> None:
    """m2i: a row whose document image is missing and one whose query text is empty take the next
    row's sample and are counted by reason; the held-out split (data.val_path) evaluates recall."""
    from titan_contrastive.datasets.bad_samples import BAD_SAMPLES, BadSampleLog

    table = _vl_pairs(tmp_path / "data", bad=True)
    trainer = _vl_pairs_run(tmp_path, "m2i", f"--data.val_path={table}", "--eval.enable=true", "--eval.batch_size=4")
    data = trainer.train_set
    batch = data.__getitems__([2, 4, 0])
    assert [(b.reason, b.key) for b in batch[BAD_SAMPLES]] == [("unreadable_file", "2"), ("missing_text", "4")]
    again = data.__getitems__([3, 5, 0])
    for key in ("query", "doc", "query_pixel_values", "doc_pixel_values", "doc_image_grid_thw"):
        assert torch.equal(batch[key], again[key])
    log = BadSampleLog(max_bad_fraction=0.5, epoch_samples=len(data))
    log.update(batch)
    assert log.counts == {"unreadable_file": 1, "missing_text": 1} and BAD_SAMPLES not in batch
    results = trainer.evaluate()
    assert results["num_samples"] == 9 and 0 <= results["query_to_doc_r@1"] <= 1 and "doc_to_query_r@5" in results
    trainer.metrics.close()


def test_vl_pairs_bad_negatives_are_substituted_and_held_out_rows_serve_none(tmp_path: Path) -> None:
    """A row with another number of negatives than the first, or a missing negative image, is a bad
    sample like any other; the held-out split serves no negatives (evaluation ranks positives)."""
    import json

    from titan_contrastive.batching import NEGATIVES
    from titan_contrastive.datasets.bad_samples import BAD_SAMPLES

    table = _vl_pairs(tmp_path / "data", negatives="image")
    rows = [json.loads(line) for line in table.read_text().splitlines()]
    rows[3]["doc_negatives"] = rows[3]["doc_negatives"][:1]
    rows[5]["doc_negatives"][1] = "img/missing.png"
    table.write_text("".join(json.dumps(r) + "\n" for r in rows))
    trainer = _vl_pairs_run(tmp_path, "t2i", f"--data.val_path={table}")
    batch = trainer.train_set.__getitems__([3, 5, 0])
    assert [(b.reason, b.key) for b in batch[BAD_SAMPLES]] == [("ragged_negatives", "3"), ("unreadable_file", "5")]
    assert batch[NEGATIVES].shape[:2] == (3, 2) and len(batch["neg_image_grid_thw"]) == 6
    held_out = trainer.eval_set.__getitems__([0, 1])
    assert trainer.eval_set.num_negatives == 0 and NEGATIVES not in held_out
    assert len(held_out["neg_image_grid_thw"]) == 0
    trainer.metrics.close()


def test_modes_refuse_what_they_cannot_read_in_one_line(tmp_path: Path) -> None:
    """Image-text data in i2i (bundled or files); an image side's template without {image}, a text
    side's with it; vl_pairs with a family without a processor."""
    from titan_contrastive.datasets import DataError

    refusal = "data.retrieval_mode=i2i needs rows with a query and a document: data.dataset='vl_pairs'"
    with pytest.raises(DataError, match=refusal):
        vl_run(tmp_path, "qwen2_vl", "--training.local_batch_size=6", "--data.retrieval_mode=i2i")
    table = _pictures_csv(tmp_path / "csv")
    with pytest.raises(DataError, match=refusal):
        vl_run(
            tmp_path, "qwen2_vl", "--data.dataset=csv", f"--data.path={table}", "--data.retrieval_mode=i2i", sizes=()
        )
    with pytest.raises(
        ConfigError, match=r"model.query_prompt='represent this': the image side's template needs \{image\}"
    ):
        _vl_pairs_run(tmp_path, "i2i", "--model.query_prompt=represent this")
    with pytest.raises(ConfigError, match=r"model.query_prompt='\{text\}': the multi side's template needs \{image\}"):
        _vl_pairs_run(tmp_path, "m2i", "--model.query_prompt={text}")
    with pytest.raises(ConfigError, match=r"the doc side is text in retrieval_mode=t2t; remove \{image\}"):
        _vl_pairs_run(tmp_path, "t2t", "--model.doc_prompt={image} {text}")
    with pytest.raises(
        DataError, match=r"data.dataset='vl_pairs' .*model.name='clip' has none: use model.name='qwen_vl'"
    ):
        base_trainer(
            str(tmp_path / "clip"),
            "--data.dataset=vl_pairs",
            f"--data.path={tmp_path / 'data' / 'pairs.jsonl'}",
            "--eval.enable=false",
        )


def test_joined_vl_pairs_files_with_same_source_batches(tmp_path: Path) -> None:
    """Two files in their own folders (image paths relative to each) joined with `::`, the second at
    half weight: its rows come at the joined indices with its own images, a bad row's substitute is
    its own file's next row, and with data.same_source_batches every step is one file's; a step trains."""
    from titan_contrastive.datasets.bad_samples import BAD_SAMPLES
    from titan_contrastive.datasets.vl_pairs import VLPairsDataset

    first, second = _vl_pairs(tmp_path / "a"), _vl_pairs(tmp_path / "b", bad=True, count=8)
    trainer = vl_run(
        tmp_path,
        "qwen2_vl",
        "--data.dataset=vl_pairs",
        f"--data.path={first}::{second}",
        "--data.upsampling_factors=1,0.5",
        "--data.same_source_batches=true",
        "--data.retrieval_mode=m2i",
        "--training.local_batch_size=4",
        "--training.steps=1",
        sizes=(),
    )
    data = trainer.train_set
    assert data.source_sizes == [9, 4] and len(data) == 13
    alone = VLPairsDataset(split="train", path=str(second), mode="m2i")
    alone.serve_processed(data._process)
    # the second file's window: rows 0-3, then 4-7; row 2's image is missing and row 4's query text empty,
    # so rows 3 and 5 of that file take their places
    for epoch, rows, reason in ((0, [0, 1, 3, 3], "unreadable_file"), (1, [5, 5, 6, 7], "missing_text")):
        data.set_epoch(epoch)
        joined, want = data.__getitems__(range(9, 13)), alone.__getitems__(rows)
        for key in ("query", "doc", "query_pixel_values", "doc_pixel_values", "doc_image_grid_thw"):
            assert torch.equal(joined[key], want[key]), (epoch, key)
        (skipped,) = joined[BAD_SAMPLES]
        assert skipped.reason == reason and skipped.where.startswith(str(second.parent))
    data.set_epoch(0)
    order = trainer.loader.sampler.global_order().tolist()
    assert len(order) == 12 and all(len({i >= 9 for i in order[j : j + 4]}) == 1 for j in range(0, 12, 4))
    trainer.train()
    trainer.metrics.close()


QUERY_TEMPLATE = "{image} Find the picture that answers: {text}"
DOC_TEMPLATE = "{image} Summarize above image in one word:"


def test_each_joined_vl_pairs_file_has_its_own_templates(tmp_path: Path) -> None:
    """data.query_prompts / doc_prompts with vl_pairs (VLM2Vec's instruction per dataset): two joined
    files in one batch, the first with its own query template, the second with its own document
    template (hard negatives included), "" keeping the model's: each row holds exactly the ids and
    images of its file served alone by a processor whose model templates are that file's; only the
    templated sides differ from the model's; a step trains; the one-line errors at start."""
    import dataclasses

    from titan_contrastive.datasets.vl_pairs import VLPairsDataset
    from titan_contrastive.models.qwen_vl.model import SideProcessor

    first = _vl_pairs(tmp_path / "a", negatives="image")
    second = _vl_pairs(tmp_path / "b", negatives="image", count=8)
    common = ("--data.dataset=vl_pairs", "--data.retrieval_mode=m2i", "--training.local_batch_size=4")
    trainer = vl_run(
        tmp_path,
        "qwen2_vl",
        *common,
        f"--data.path={first}::{second}",
        "--data.query_prompts",
        QUERY_TEMPLATE,
        "",
        "--data.doc_prompts",
        "",
        DOC_TEMPLATE,
        "--training.steps=1",
        sizes=(),
    )
    data, args = trainer.train_set, trainer.model_args
    assert data.templates == {"query": [QUERY_TEMPLATE, ""], "doc": ["", DOC_TEMPLATE]}
    own = {"query": args.query_template, "doc": args.doc_template}
    files = {0: (first, {"query_template": QUERY_TEMPLATE}), 1: (second, {"doc_template": DOC_TEMPLATE})}
    alone, plain = {}, {}
    for source, (path, templates) in files.items():
        alone[source] = VLPairsDataset(split="train", path=str(path), mode="m2i")
        alone[source].serve_processed(SideProcessor(dataclasses.replace(args, **templates)))
        plain[source] = VLPairsDataset(split="train", path=str(path), mode="m2i")
        plain[source].serve_processed(data._process)  # the model's templates: the control
    picks = [(0, 0), (1, 9), (0, 5), (1, 12)]  # (file, joined index): both files in one batch
    joined = data.__getitems__([i for _, i in picks])

    def rows(batch: dict, key: str) -> list[list[int]]:
        flat = batch[key].reshape(-1, batch[key].shape[-1])
        return [r[r != -1].tolist() for r in flat]

    for key in ("query", "doc", "neg"):
        got, want, control = rows(joined, key), [], []
        for source, index in picks:
            row = index - (9 if source else 0)
            want += rows(alone[source].__getitems__([row]), key)
            control += rows(plain[source].__getitems__([row]), key)
        assert got == want, key
        side = "query" if key == "query" else "doc"
        templated = [s for s, _ in picks for _ in range(len(got) // len(picks))]
        changed = [g != c for g, c in zip(got, control, strict=True)]
        assert changed == [bool(data.templates[side][s]) for s in templated], (key, own[side])
    for key in ("query_pixel_values", "doc_pixel_values", "neg_pixel_values", "doc_image_grid_thw"):
        want = [alone[s].__getitems__([i - (9 if s else 0)])[key] for s, i in picks]
        assert torch.equal(joined[key], torch.cat(want)), key
    trainer.train()
    trainer.metrics.close()

    def start(*extra: str) -> None:
        vl_run(tmp_path, "qwen2_vl", *common, f"--data.path={first}::{second}", *extra, sizes=())

    with pytest.raises(DataError, match=r"data.query_prompts=\['\{image\} \{text\}'\]: 1 prompt\(s\) for the 2"):
        start("--data.query_prompts", "{image} {text}")
    with pytest.raises(ConfigError, match=r"data.doc_prompts\[1\]='Describe it:': the image side's template needs"):
        start("--data.doc_prompts", "", "Describe it:")


def test_vl_pairs_shards_in_their_own_folders_are_one_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A glob pattern (relative to the working folder) over two files in their own folders (image paths, hard-negative
    images included, relative to each): one source whose rows are the first file's then the second's, each with its
    own images, as the files serve them alone."""
    from titan_contrastive.datasets.vl_pairs import VLPairsDataset

    first, second = _vl_pairs(tmp_path / "a", negatives="image"), _vl_pairs(tmp_path / "b", negatives="image", count=5)
    monkeypatch.chdir(tmp_path)
    trainer = vl_run(
        tmp_path,
        "qwen2_vl",
        "--data.dataset=vl_pairs",
        "--data.path=*/pairs.jsonl",
        "--data.retrieval_mode=t2i",
        "--training.local_batch_size=4",
        "--training.steps=1",
        sizes=(),
    )
    data = trainer.train_set
    assert data.source_sizes is None and len(data) == 14 and data.num_negatives == 2
    for path, rows, at in ((first, [0, 8, 3], [0, 8, 3]), (second, [0, 4, 2], [9, 13, 11])):
        alone = VLPairsDataset(split="train", path=str(path), mode="t2i")
        alone.serve_processed(data._process)
        got, want = data.__getitems__(at), alone.__getitems__(rows)
        for key in ("query", "doc", "doc_pixel_values", "doc_image_grid_thw", "neg_pixel_values"):
            assert torch.equal(got[key], want[key]), (path, key)
    trainer.train()
    trainer.metrics.close()


def test_vl_pairs_negatives_drawn_per_epoch_are_served_as_rows_holding_them(tmp_path: Path) -> None:
    """data.negatives_per_row with vl_pairs rows of 1 to 5 negative images: each epoch serves, for every row, the
    ids and pixels a plain file whose rows hold exactly the drawn negatives serves; over the epochs every negative
    comes; a row without one is a bad sample; a step trains on them."""
    import json

    from titan_contrastive.batching import NEGATIVES
    from titan_contrastive.datasets.bad_samples import BAD_SAMPLES
    from titan_contrastive.datasets.vl_pairs import VLPairsDataset

    table = _vl_pairs(tmp_path / "data", negatives="image")
    rows = [json.loads(line) for line in table.read_text().splitlines()]
    for i, row in enumerate(rows):  # 1 to 5 negatives: the row's own two, then others' documents
        row["doc_negatives"] = (row["doc_negatives"] + [f"img/d{(i + j) % 9}.png" for j in (1, 2, 3)])[: 1 + i % 5]
    rows[7]["doc_negatives"] = []
    table.write_text("".join(json.dumps(r) + "\n" for r in rows))
    trainer = _vl_pairs_run(tmp_path, "t2i", "--data.negatives_per_row=2", "--training.steps=1")
    data = trainer.train_set
    assert data.num_negatives == 2
    seen = {i: set() for i in range(9)}
    for epoch in range(3):
        data.set_epoch(epoch)
        batch = data.__getitems__(list(range(7)))
        held = []
        for i, row in enumerate(rows[:7]):
            places = data.drawn(0, i)[1]
            assert len(places) == 2 and all(0 <= p < len(row["doc_negatives"]) for p in places)
            seen[i].update(places)
            held.append(row | {"doc_negatives": [row["doc_negatives"][p] for p in places]})
        plain_file = tmp_path / "data" / f"drawn{epoch}.jsonl"
        plain_file.write_text("".join(json.dumps(r) + "\n" for r in held))
        plain = VLPairsDataset(split="train", path=str(plain_file), mode="t2i")
        plain.serve_processed(data._process)
        want = plain.__getitems__(list(range(7)))
        assert plain.num_negatives == 2 and torch.equal(batch[NEGATIVES], want[NEGATIVES])
        for key in ("neg_pixel_values", "neg_image_grid_thw", "doc_pixel_values"):
            assert torch.equal(batch[key], want[key]), (epoch, key)
    assert all(seen[i] == set(range(min(2 * 3, 1 + i % 5))) for i in range(7))
    bare = data.__getitems__([7])
    assert [(b.reason, b.key) for b in bare[BAD_SAMPLES]] == [("no_negatives", "7")]
    trainer.train()
    trainer.metrics.close()
