"""The qwen_vl family on tiny random Qwen2-VL and Qwen3-VL folders built at test time
(tests/hf_folders.py: 2 vision blocks, 2 decoder layers, a word-level tokenizer with Qwen's vision
tokens, the PIL image processor). The processor's batches are what the model's own image processor
and tokenizer give; every step kind (GradCache with fixed chunks and with a token budget counting
visual and text tokens, accumulation, global negatives) equals the dense objective over the whole
batch in float64 with images of different sizes in one batch, on 1 and 2 gloo processes (FSDP2 and
DDP), LoRA on and off; dropout is replayed; a chunk never splits an image; bad input is one line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed, write_once
from tests.hf_folders import vl_folder
from tests.needs import require
from tests.test_hard_negatives import assert_grads_close, assert_step_equals_its_forwards
from tests.test_hf_text import grads
from tests.test_late_interaction import reference as late_reference
from tests.test_trainer import full
from tests.test_trainer import make_trainer as base_trainer
from titan_contrastive.batching import OWN_GROUP
from titan_contrastive.losses import FalseNegatives, Hardness, InfoNCE
from titan_contrastive.losses.base import own_documents_only

require("hf")

REL = 1e-10
ARCHS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
# (local batch, accumulation steps, options); images at 28, 56 and 84 px: 2x2 to 6x6 patch grids
KINDS = {
    "gradcache": (6, 1, ["--gradcache.enabled=true", "--gradcache.chunk_sizes=4"]),
    "gradcache-tokens": (6, 1, ["--gradcache.enabled=true", "--gradcache.chunk_tokens=40"]),
    "accumulate": (3, 2, []),
    "global": (3, 2, ["--loss.negatives=global", "--loss.stream_chunk_size=5"]),
}
LORA = ("--lora.enable=true", "--lora.rank=4", "--lora.alpha=8")
DORA = (*LORA, "--lora.use_dora=true", "--lora.use_rslora=true")


def vl_run(tmp: Path, arch: str, *extra: str, dropout: float = 0.1, sizes: tuple[str, ...] = ("28", "56", "84")):
    """A trainer of the qwen_vl family on `arch`'s tiny folder and the bundled emoji at mixed `sizes`
    (another dataset in `extra`: `sizes=()`)."""
    write_once(tmp / f"tiny-{arch}", lambda: vl_folder(tmp, arch, dropout))
    return base_trainer(
        str(tmp / f"run-{arch}"),
        "--model.name=qwen_vl",
        "--model.flavor=default",
        f"--model.path={tmp / f'tiny-{arch}'}",
        "--data.dataset=emoji",
        *(("--data.image_sizes", *sizes) if sizes else ()),
        "--data.context_length=8",
        "--eval.enable=false",
        *extra,
    )


def _inputs(batch: dict, docs: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The model's inputs of a batch (query, doc, each side's images), floating ones in float64."""
    keys = ("query", "doc", "query_pixel_values", "query_image_grid_thw", "doc_pixel_values", "doc_image_grid_thw")
    out = [batch[k].double() if batch[k].is_floating_point() else batch[k] for k in keys]
    return out if docs is None else [out[0], docs, *out[2:]]


def _grid(batch: dict) -> torch.Tensor:
    """The image grids of a batch's image side(s)."""
    return torch.cat([batch["query_image_grid_thw"], batch["doc_image_grid_thw"]])


def _embeddings(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(queries, documents) of a batch, each side embedded with its own images; a batch's hard negatives
    (`neg`, and `neg_*` images) each embedded on its own, as columns after the positives."""
    from titan_contrastive.batching import NEGATIVES
    from titan_contrastive.losses.base import columns

    def embed(side: str, ids: torch.Tensor) -> torch.Tensor:
        grid = batch[f"{side}_image_grid_thw"]
        images = (batch[f"{side}_pixel_values"].double(), grid) if len(grid) else (None, None)
        return model.embed(ids, *images, "query" if side == "query" else "doc")

    docs = embed("doc", batch["doc"])
    if NEGATIVES in batch:
        docs = columns(docs, embed(NEGATIVES, batch[NEGATIVES].flatten(0, 1)))  # sample after sample
    return embed("query", batch["query"]), docs


def _late_loss(terms, q, d, scale, m: int, bias=None):
    """InfoNCE over MaxSim of tokens m wide, written one pair at a time; for `loss.name = "pairwise"`
    colpali-engine's ColbertPairwiseCELoss written as it writes it; for `siglip` the sigmoid loss over MaxSim."""
    if terms.name == "siglip":
        from tests.test_late_sigmoid import reference as sigmoid_reference

        rule = FalseNegatives(relative=terms.mask_relative)
        return sigmoid_reference(q, d, None, scale, bias, torch.arange(len(d)), rule, terms.maxsim_normalize, dim=m)
    if terms.name == "pairwise":
        from tests.test_pairwise import colpali_pairwise

        return colpali_pairwise(q, d, None, scale, terms.pairwise_in_batch_weight, m, terms.maxsim_normalize)
    if terms.mask_relative is not None or terms.hardness_strength:  # the masks and weights by MaxSim
        from tests.test_late_masks import reference as masked_reference

        rules = FalseNegatives(relative=terms.mask_relative), Hardness(terms.hardness_mode, terms.hardness_strength)
        ids = torch.arange(len(d))
        return masked_reference(q, d, None, scale, ids, terms.symmetric, *rules, terms.maxsim_normalize, dim=m)
    return late_reference(q, d, None, scale, terms.symmetric, m, terms.maxsim_normalize)


def _dense(trainer, batches: list[dict]) -> tuple[float, dict[str, torch.Tensor]]:
    """The objective from its definition on a float64 copy: the mean over `batches` (each one contrastive problem)
    of InfoNCE over the whole batch's embeddings (symmetric; `OWN_GROUP`'s queries against their own documents), or
    over their MaxSim one pair at a time for a ColBERT model (`loss.symmetric`, `loss.maxsim_normalize`, each token's
    `loss.matryoshka_dims` prefixes; `loss.name = "pairwise"`: colpali-engine's pairwise loss instead)."""
    model = trainer.spec.build_model(trainer.model_args).double()
    model.load_state_dict({k: full(v) for k, v in trainer.model.state_dict().items()})
    model.eval()
    losses = []
    for batch in batches:
        q, d = _embeddings(model, batch)
        if model.token_dim:
            from tests.test_late_matryoshka import cut

            terms = trainer.cfg.loss
            scale, dim, bias = model.logit_scale.exp(), model.token_dim, model.logit_bias
            weights = terms.matryoshka_weights or [1.0] * len(terms.matryoshka_dims)
            prefixes = list(zip(terms.matryoshka_dims, weights)) or [(dim, 1.0)]
            late = [w * _late_loss(terms, cut(q, m, dim), cut(d, m, dim), scale, m, bias) for m, w in prefixes]
            losses.append(sum(late))
        else:
            losses.append(own_documents_only(InfoNCE(), batch.get(OWN_GROUP)).dense(q, d, model.logit_scale.exp()))
    loss = torch.stack(losses).mean()
    loss.backward()
    return loss.item(), grads(model)


def _step(tmp: Path, arch: str, kind: str, *extra: str, sizes: tuple[str, ...] = ("28", "56", "84"), rel: float = REL):
    """One step of `kind` (dropout off) against the dense objective over the whole global batch, within `rel`; one
    warm-up step first so that LoRA's B (zero at the start) gives A a gradient. `sizes`: vl_run's. The trainer."""
    local, ga, args = KINDS[kind]
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    trainer = vl_run(
        tmp,
        arch,
        f"--training.local_batch_size={local}",
        f"--training.global_batch_size={local * ga * world}",
        *args,
        *extra,
        sizes=sizes,
    )
    trainer.model.eval()
    data = trainer.train_set
    pieces = [
        [list(range(j * local * world + rank * local, j * local * world + (rank + 1) * local))] for j in range(ga)
    ]

    def get(indices: list[int]) -> dict:  # the tensors (what the loader passes on; it counts the bad samples)
        return {k: v for k, v in data.__getitems__(indices).items() if isinstance(v, torch.Tensor)}

    mine = [get(p[0]) for p in pieces]
    every = get(list(range(local * ga * world)))
    grids = _grid(every)
    assert not len(grids) or len({tuple(g) for g in grids.tolist()}) >= 2  # images of different sizes
    # accumulation: each microbatch (all ranks' part of it) is a contrastive problem of its own
    problems = (
        [get(list(range(j * local * world, (j + 1) * local * world))) for j in range(ga)]
        if kind == "accumulate"
        else [every]
    )
    trainer.train_step(mine)
    want_loss, want = _dense(trainer, problems)
    out = trainer.train_step(mine)
    assert_grads_close(grads(trainer.model), want, rel)
    assert abs(out["loss"] - want_loss) <= rel * want_loss
    trainer.metrics.close()
    return trainer


# Qwen3-VL's accumulation and global negatives (20 s) and Qwen2.5-VL's all but its token budget run with the
# slow marker; Qwen2-VL's all by default.
SLOW_KINDS = {("qwen3_vl", "accumulate"), ("qwen3_vl", "global")} | {
    ("qwen2_5_vl", k) for k in ("gradcache", "accumulate", "global")
}


@pytest.mark.parametrize(
    "arch,kind",
    [pytest.param(a, k, marks=[pytest.mark.slow] if (a, k) in SLOW_KINDS else []) for a in ARCHS for k in KINDS],
)
def test_every_step_kind_equals_the_dense_objective(tmp_path: Path, arch: str, kind: str) -> None:
    _step(tmp_path, arch, kind)


@pytest.mark.parametrize(
    "kind, adapters",
    [("gradcache", LORA), ("global", DORA), pytest.param("gradcache-tokens", LORA, marks=pytest.mark.slow)],
)
def test_with_lora_and_the_images_as_queries(tmp_path: Path, kind: str, adapters: tuple[str, ...]) -> None:
    _step(tmp_path, "qwen2_vl", kind, *adapters, "--data.retrieval_mode=i2t")


@pytest.mark.parametrize("arch", ARCHS)
def test_activation_checkpointing_of_vision_blocks_and_decoder_layers(tmp_path: Path, arch: str) -> None:
    _step(tmp_path, arch, "gradcache-tokens", "--activation_checkpoint.mode=full")


def _two_ranks(tmp: str, arch: str, ddp: bool, *extra: str) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    layout = ["--parallelism.data_parallel_shard_degree=1", "--parallelism.data_parallel_replicate_degree=2"]
    _step(Path(tmp), arch, "global", *(layout if ddp else []), *extra)
    _step(Path(tmp) / "gc", arch, "gradcache-tokens", *(layout if ddp else []), *extra)


@pytest.mark.slow
@pytest.mark.parametrize("parallel,lora", [("fsdp2", False), ("ddp", True)])
def test_two_ranks(tmp_path: Path, parallel: str, lora: bool) -> None:
    vl_folder(tmp_path, "qwen2_vl")
    vl_folder(tmp_path / "gc", "qwen2_vl")
    run_distributed(_two_ranks, 2, str(tmp_path), "qwen2_vl", parallel == "ddp", *(LORA if lora else ()))


def test_gradcache_replays_the_dropout_of_both_towers(tmp_path: Path) -> None:
    trainer = vl_run(
        tmp_path, "qwen2_vl", "--training.local_batch_size=6", "--gradcache.enabled=true", "--gradcache.chunk_sizes=4"
    )
    batch = trainer.train_set.__getitems__(list(range(6)))
    assert_step_equals_its_forwards(trainer, [batch], trainer.step_context.split(batch, 4), seed=3)
    trainer.metrics.close()


@pytest.mark.parametrize("arch", ARCHS)
def test_batches_are_what_the_image_processor_and_tokenizer_give(tmp_path: Path, arch: str) -> None:
    """pixel_values and image_grid_thw are the image processor's own output for the same images; each
    document's ids are <|vision_start|>, prod(grid) / merge² <|image_pad|>, <|vision_end|>, then the
    template's text; each query's ids are the tokenizer's ids of its caption, cut to context_length."""
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    folder = vl_folder(tmp_path, arch)
    trainer = vl_run(tmp_path, arch, "--training.local_batch_size=6", "--model.doc_prompt={image} represent this")
    data = trainer.train_set
    batch = data.__getitems__([0, 1, 2])
    processor, tokenizer = Qwen2VLImageProcessorPil.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    sizes = [data.image_sizes[k] for k in data._image_size_ids(np.arange(3))]
    images = [
        torch.nn.functional.interpolate(
            data._images[i : i + 1].float(), size=(s, s), mode="bilinear", align_corners=False, antialias=s < 32
        )
        for i, s in enumerate(sizes)
    ]
    arrays = [x[0].round().clamp(0, 255).byte().permute(1, 2, 0).numpy() for x in images]
    want = processor(images=arrays, return_tensors="pt")
    assert torch.equal(batch["doc_image_grid_thw"], want["image_grid_thw"])
    assert torch.equal(batch["doc_pixel_values"], want["pixel_values"].float())
    assert batch["query_pixel_values"].shape[0] == 0 and batch["query_image_grid_thw"].shape == (0, 3)
    start, pad, end = (
        tokenizer.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")
    )
    tail = tokenizer("represent this", add_special_tokens=False)["input_ids"]
    for row, grid in zip(batch["doc"].tolist(), batch["doc_image_grid_thw"]):
        count = int(grid.prod()) // 4
        assert row[: count + 2 + len(tail)] == [start, *[pad] * count, end, *tail]
        assert all(x == -1 for x in row[count + 2 + len(tail) :])
    templates = data._template_ids(np.arange(3))
    captions = [data.templates[t].format(data.subjects[s]) for t, s in zip(templates, data._text_ids[:3].tolist())]
    for row, caption in zip(batch["query"].tolist(), captions):
        words = tokenizer(caption, add_special_tokens=False)["input_ids"][:8]
        assert [x for x in row if x != -1] == words
    trainer.metrics.close()


def test_token_chunks_keep_every_image_whole() -> None:
    from titan_contrastive.batching import BatchError, take_vlm_chunks

    grid = torch.tensor([[1, 2, 2], [1, 4, 6], [1, 2, 4], [1, 6, 6]])
    pixels = torch.cat([torch.full((int(g.prod()), 3), float(i)) for i, g in enumerate(grid)])
    batch = {"query": torch.arange(4).view(4, 1), "pixel_values": pixels, "image_grid_thw": grid}
    chunks = take_vlm_chunks(batch, torch.tensor([3, 1, 0, 2]), [1, 3])
    assert [c["query"].flatten().tolist() for c in chunks] == [[3], [1, 0, 2]]
    for chunk in chunks:
        owners = [i for i in chunk["query"].flatten().tolist() for _ in range(int(grid[i].prod()))]
        assert chunk["pixel_values"][:, 0].tolist() == owners  # each image's rows, whole, in chunk order
        assert torch.equal(chunk["image_grid_thw"], grid[chunk["query"].flatten()])
    # per side: the query's images and the document's, or a side without any (0 rows in every chunk)
    sides = {
        "query": torch.arange(4).view(4, 1),
        "query_pixel_values": pixels,
        "query_image_grid_thw": grid,
        "doc_pixel_values": pixels[:0],
        "doc_image_grid_thw": grid[:0],
    }
    for chunk in take_vlm_chunks(sides, torch.tensor([2, 0, 3, 1]), [2, 2]):
        owners = [i for i in chunk["query"].flatten().tolist() for _ in range(int(grid[i].prod()))]
        assert chunk["query_pixel_values"][:, 0].tolist() == owners
        assert chunk["doc_pixel_values"].shape == (0, 3) and chunk["doc_image_grid_thw"].shape == (0, 3)
    with pytest.raises(BatchError, match=r"3 images in doc_image_grid_thw for 4 samples; the same number each"):
        take_vlm_chunks(
            {**sides, "doc_pixel_values": pixels[:36], "doc_image_grid_thw": grid[:3]}, torch.arange(4), [4]
        )


def test_bad_input_is_one_line(tmp_path: Path) -> None:
    from titan_contrastive.config import ConfigError
    from titan_contrastive.models.qwen_vl.processor import VLProcessor

    with pytest.raises(
        ConfigError, match=r"model.doc_prompt='represent this': the image side's template needs \{image\}"
    ):
        vl_run(tmp_path, "qwen2_vl", "--training.local_batch_size=6", "--model.doc_prompt=represent this")
    with pytest.raises(ConfigError, match=r"^loss.mask_duplicates=true with retrieval_mode=t2i: duplicates are found"):
        vl_run(tmp_path, "qwen2_vl", "--training.local_batch_size=6", "--loss.mask_duplicates=true")
    processor = VLProcessor(str(tmp_path / "tiny-qwen2_vl"), 0, 0, 8)
    side = processor.encode("{image}", ["", ""], [np.zeros((28, 28, 3), np.uint8), np.zeros((56, 56, 3), np.uint8)])
    with pytest.raises(ConfigError, match=r"asks for \[1, 4\] visual tokens per image, the ids hold \[4, 1\]"):
        processor.check(side["ids"].flip(0), side["image_grid_thw"])
    with pytest.raises(
        ConfigError,
        match=r"an image of shape \[\(28, 6000, 3\)\]: absolute aspect ratio must be smaller than 200, .*; crop it",
    ):
        processor.encode("{image}", [""], [np.zeros((28, 6000, 3), np.uint8)])


@pytest.mark.parametrize("lora", [False, True, "dora"])
def test_exports_reload_and_embed_as_the_run(tmp_path: Path, lora: bool | str) -> None:
    """A trained step folder: --to hf (merged with LoRA) and --to peft load back in transformers / peft
    and give the run's query and document embeddings (the exporter compares them and exits 2 if not);
    the transformers folder carries the tokenizer and the image processor."""
    from transformers import AutoModel

    from titan_contrastive.export import main as export_main

    run = vl_run(
        tmp_path,
        "qwen2_vl",
        *(DORA if lora == "dora" else LORA if lora else ()),
        "--training.local_batch_size=6",
        "--training.steps=2",
        "--training.dtype=float32",
        "--checkpoint.enable=true",
        "--lr_scheduler.warmup_steps=0",
        "--optimizer.lr=1e-2",
    )
    run.train()
    run.metrics.close()
    step = tmp_path / "run-qwen2_vl" / "checkpoint" / "step-2"
    assert export_main([str(step), "--to", "hf", "--out", str(tmp_path / "hf")]) == 0
    assert {"preprocessor_config.json", "tokenizer.json", "config.json"} <= {
        p.name for p in (tmp_path / "hf").iterdir()
    }
    merged = dict(AutoModel.from_pretrained(str(tmp_path / "hf")).named_parameters())
    base = dict(AutoModel.from_pretrained(str(tmp_path / "tiny-qwen2_vl")).named_parameters())
    assert any(not torch.equal(merged[n], base[n]) for n in base)  # it trained
    assert export_main([str(step), "--to", "peft", "--out", str(tmp_path / "peft")]) == (0 if lora else 2)


def test_resume_with_lora_is_bit_identical(tmp_path: Path) -> None:
    """Four steps at once against two, a checkpoint, and two more from it (LoRA: adapters only)."""
    import json
    import shutil

    def run():
        return vl_run(
            tmp_path,
            "qwen2_vl",
            *LORA,
            "--training.local_batch_size=4",
            "--training.steps=4",
            "--training.dtype=float32",
            "--checkpoint.enable=true",
            "--checkpoint.interval=2",
            "--metrics.log_freq=1",
        )

    whole = run()
    whole.train()
    whole.metrics.close()
    want = {n: p.detach().clone() for n, p in whole.model.named_parameters()}
    folder = tmp_path / "run-qwen2_vl"
    losses = [json.loads(x)["loss"] for x in (folder / "metrics.jsonl").read_text().splitlines() if '"train"' in x]
    shutil.rmtree(folder / "checkpoint" / "step-4")
    (folder / "metrics.jsonl").unlink()
    resumed = run()
    assert resumed.step == 2
    resumed.train()
    resumed.metrics.close()
    got = dict(resumed.model.named_parameters())
    assert all(torch.equal(got[n], p) for n, p in want.items())
    again = [json.loads(x)["loss"] for x in (folder / "metrics.jsonl").read_text().splitlines() if '"train"' in x]
    assert len(losses) == 4 and again == losses[2:]


def test_batches_equal_the_full_transformers_processor(tmp_path: Path) -> None:
    """Where torchvision imports (the peers venv of benchmarks/peers_venv.sh), transformers' own
    Qwen2VLProcessor on the same images and filled templates: its input_ids where its attention mask
    is 1 are our ids where they are not -1, its mm_token_type_ids are 1 exactly at our image tokens,
    and the patches and grids are the same."""
    pytest.importorskip("torchvision", reason="the full processor needs torchvision (benchmarks/peers_venv.sh has it)")
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil, Qwen2VLProcessor, Qwen2VLVideoProcessor

    from titan_contrastive.models.qwen_vl.model import QwenVLArgs

    folder = vl_folder(tmp_path, "qwen2_vl")
    args = QwenVLArgs(path=str(folder), doc_template="{image} represent this", text_length=16)
    g = np.random.default_rng(0)
    images = [g.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in ((28, 56), (84, 84), (60, 100))]
    texts = ["a small cat", "the dog with wheels", "frozen water in winter"]
    ours = args.processor()(images, texts)
    full = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessorPil.from_pretrained(folder),
        tokenizer=AutoTokenizer.from_pretrained(folder),
        video_processor=Qwen2VLVideoProcessor(),
    )
    theirs = full(
        text=["<|vision_start|><|image_pad|><|vision_end|> represent this"] * 3,
        images=images,
        return_tensors="pt",
        padding=True,
    )
    assert torch.equal(ours["doc_pixel_values"], theirs["pixel_values"].float())
    assert torch.equal(ours["doc_image_grid_thw"], theirs["image_grid_thw"])
    for mine, ids, mask, types in zip(
        ours["doc"], theirs["input_ids"], theirs["attention_mask"], theirs["mm_token_type_ids"]
    ):
        assert mine[mine != -1].tolist() == ids[mask.bool()].tolist()
        image_token = full.image_token_id
        assert (types[mask.bool()] == 1).tolist() == (mine[mine != -1] == image_token).tolist()
    words = full(text=texts, return_tensors="pt", padding=True)
    for mine, ids, mask in zip(ours["query"], words["input_ids"], words["attention_mask"]):
        assert mine[mine != -1].tolist() == ids[mask.bool()].tolist()


def _pictures_csv(root: Path) -> Path:
    """Nine RGB PNGs of different sizes, each with a caption and two negative captions (a TSV)."""
    import csv

    from PIL import Image

    g = np.random.default_rng(0)
    (root / "img").mkdir(parents=True)
    rows = []
    for i, (h, w) in enumerate(
        [(28, 28), (56, 84), (84, 56), (40, 40), (60, 90), (28, 56), (70, 70), (30, 60), (56, 56)]
    ):
        Image.fromarray(g.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(root / "img" / f"{i}.png")
        rows.append([f"img/{i}.png", f"a photo of a cat {i}", f"a dog {i}", f"frozen water {i}"])
    with open(root / "train.csv", "w", newline="") as f:
        writer = csv.writer(f, delimiter="\t")
        writer.writerow(["filepath", "title", "neg_a", "neg_b"])
        writer.writerows(rows)
    return root / "train.csv"


@pytest.mark.parametrize("chunks", ["--gradcache.chunk_sizes=4", "--gradcache.chunk_tokens=60"])
def test_negative_captions_at_native_resolution_equal_the_definition(tmp_path: Path, chunks: str) -> None:
    """i2t on image files at their own sizes, two negative captions per image: every query (image)
    against the N (1 + k) captions, the captions against the images; GradCache equals the dense
    objective in float64. t2i with negative captions is refused in one line (they would be images)."""
    from titan_contrastive.batching import NEGATIVES, with_negatives
    from titan_contrastive.datasets import DataError
    from titan_contrastive.losses import split_documents
    from titan_contrastive.losses.base import columns

    table = _pictures_csv(tmp_path / "data")
    data = ["--data.dataset=csv", f"--data.path={table}", "--data.csv_negative_keys=neg_a,neg_b"]
    trainer = vl_run(
        tmp_path,
        "qwen2_vl",
        *data,
        "--training.local_batch_size=7",
        "--gradcache.enabled=true",
        chunks,
        "--data.retrieval_mode=i2t",
        sizes=(),
    )
    trainer.model.eval()
    batch = trainer.train_set.__getitems__(list(range(7)))
    batch = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
    assert batch[NEGATIVES].shape[:2] == (7, 2) and len(set(map(tuple, _grid(batch).tolist()))) >= 3
    trainer.train_step([batch])
    model = trainer.spec.build_model(trainer.model_args).double()
    model.load_state_dict(trainer.model.state_dict())
    model.eval()
    docs = with_negatives(batch["doc"], batch[NEGATIVES], -1)
    q, d, scale = model(*_inputs(batch, docs))
    loss = InfoNCE().dense(q, columns(*split_documents(d.reshape(7, 3, -1))), scale)
    loss.backward()
    out = trainer.train_step([batch])
    assert_grads_close(grads(trainer.model), grads(model))
    assert abs(out["loss"] - loss.item()) <= REL * loss.item()
    trainer.metrics.close()
    with pytest.raises(
        DataError,
        match="negative captions, hard negatives of text documents: with this family they need data.retrieval_mode=i2t",
    ):
        vl_run(tmp_path / "t2i", "qwen2_vl", *data, "--training.local_batch_size=7", sizes=())
