"""The hf_clip family against the libraries around it: its batches are what the folder's image processor and
tokenizer give and its embeddings what transformers' `get_*_features` give; `train.main` evaluates and resumes;
`--to hf` loads back in transformers and sentence-transformers; a clip-family export read by hf_clip is the same
model in float64; the sigmoid loss on a CLIP folder and a softmax objective on SigLIP; one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.hf_folders import IMAGE_TEXT, image_text_folder
from tests.marks import slow_ones
from tests.needs import require
from tests.test_hf_clip import DORA, LORA, _step, _tensors, clip_run, pictures
from tests.test_trainer import make_trainer as base_trainer
from titan_contrastive.losses import Sigmoid

require("hf")


def assert_processed(mine: dict, theirs: dict, resampled: bool = False) -> None:
    """Our image inputs are the processor's: the same keys and dtypes, values to 1e-5; `resampled` (pictures
    resized by torch's kernel, not Pillow's): pixels to one level (1/127.5 at std 0.5), under a twentieth of a
    level on average (these noise pictures are the worst case: 2 % of their pixels differ)."""
    assert mine.keys() == theirs.keys()
    for key, value in theirs.items():
        assert mine[key].dtype == value.dtype, key
        if key == "pixel_values" and resampled:
            off = (mine[key] - value).abs()
            assert off.max() <= 1 / 127.5 + 1e-5 and off.mean() <= 1 / 127.5 / 20
        else:
            assert torch.allclose(mine[key], value, atol=1e-5), key


@pytest.mark.parametrize("kind", IMAGE_TEXT)
def test_batches_and_embeddings_are_what_transformers_gives(tmp_path: Path, kind: str) -> None:
    """The eval split's pixels of an image at the model's size equal the folder's image processor's (SigLIP:
    those of pictures of other shapes, squashed, to a level; SigLIP 2: its patches, mask and grid of every
    picture, each at its own aspect ratio), the ids its tokenizer's at
    `padding="max_length"` (SigLIP's and SigLIP 2's lowercased, SigLIP 2's on the left), and the model's
    embeddings transformers' own `get_image_features` / `get_text_features`, normalized."""
    from PIL import Image
    from transformers import AutoImageProcessor, AutoModel, AutoTokenizer

    trainer = clip_run(tmp_path, kind, "--training.local_batch_size=4", "--training.dtype=float32")
    folder = str(tmp_path / f"tiny-{kind}")
    data = trainer.train_set
    data.train = False  # the centre crop: at the model's size, the image itself
    batch = data.__getitems__([0, 1, 3])  # 16 x 16, 20 x 30 and 24 x 24 pictures
    captions = data.captions([0, 1, 3])
    processor = AutoImageProcessor.from_pretrained(folder, backend="pil")
    pictures = [Image.open(tmp_path / "data" / "img" / f"{i}.png").convert("RGB") for i in (0, 1, 3)]
    if kind == "siglip2":  # every picture as it is
        mine, theirs = batch["image"], processor(images=pictures, return_tensors="pt")
        assert theirs["spatial_shapes"].tolist() == [[2, 2], [2, 3], [2, 2]]
    elif kind == "siglip":  # each whole picture squashed to the square, as its processor does
        mine, theirs = {"pixel_values": batch["image"]}, processor(images=pictures, return_tensors="pt")
        assert_processed({"pixel_values": mine["pixel_values"][:1]}, {"pixel_values": theirs["pixel_values"][:1]})
    else:  # the picture at the model's size (CLIP's processor resizes before its centre crop, ours after)
        mine, theirs = {"pixel_values": batch["image"][:1]}, processor(images=pictures[:1], return_tensors="pt")
    assert_processed(mine, theirs, resampled=kind in ("siglip", "siglip2"))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer(captions, padding="max_length", max_length=12, truncation=True, return_tensors="pt")["input_ids"]
    assert torch.equal(batch["text"], ids)
    assert tokenizer.batch_decode(ids, skip_special_tokens=True) == captions
    if kind in ("siglip", "siglip2"):  # transformers' SiglipTokenizer and Siglip2Tokenizer lowercase; so does the run
        shouted = [c.title() for c in captions]
        assert shouted != captions and torch.equal(data.tokenizer.encode(shouted), ids)
    model = AutoModel.from_pretrained(folder).eval()
    trainer.model.eval()
    with torch.no_grad():
        image, text, scale = trainer.model(batch["image"], batch["text"])[:3]
        want_image = model.get_image_features(**trainer.model.image_inputs(batch["image"])).pooler_output
        want_text = model.get_text_features(input_ids=batch["text"]).pooler_output
    assert torch.allclose(image, F.normalize(want_image, dim=-1), atol=1e-6)
    assert torch.allclose(text, F.normalize(want_text, dim=-1), atol=1e-6)
    assert torch.allclose(scale, model.logit_scale.exp())
    assert trainer.model_args.num_params() == sum(p.numel() for p in trainer.model.parameters())
    trainer.metrics.close()


def test_siglip2_reads_the_resolution_the_run_sets(tmp_path: Path) -> None:
    """`data.image_size=24` on SigLIP 2 (8 px patches, a 2 x 2 grid of positions) reads up to 9 patches per
    picture: what its processor makes at `max_num_patches=9`, and the embeddings transformers' (its positions
    resized to each grid); training crops keep their own shapes (grids differ within a batch); a square
    image tensor is cut into the patches of a square picture."""
    from PIL import Image
    from transformers import AutoImageProcessor, AutoModel

    trainer = clip_run(
        tmp_path, "siglip2", "--data.image_size=24", "--training.local_batch_size=4", "--training.dtype=float32"
    )
    args = trainer.model_args
    assert (args.image_size, args.max_num_patches) == (24, 9)
    data = trainer.train_set
    grids = data.__getitems__(list(range(10)))["image"]["spatial_shapes"]
    assert len({tuple(g) for g in grids.tolist()}) > 1
    data.train = False
    batch = data.__getitems__([1, 3])  # 20 x 30 and 24 x 24
    processor = AutoImageProcessor.from_pretrained(str(tmp_path / "tiny-siglip2"), backend="pil")
    pictures = [Image.open(tmp_path / "data" / "img" / f"{i}.png").convert("RGB") for i in (1, 3)]
    theirs = processor(images=pictures, max_num_patches=9, return_tensors="pt")
    assert theirs["spatial_shapes"].tolist() == [[2, 3], [3, 3]]
    assert_processed(batch["image"], theirs, resampled=True)
    square = trainer.model.image_inputs(data.normalize(np.asarray(pictures[1:])))
    assert_processed(square, {k: v[1:] for k, v in theirs.items()})
    model = AutoModel.from_pretrained(str(tmp_path / "tiny-siglip2")).eval()
    with torch.no_grad():
        image = trainer.model.eval()(batch["image"], batch["text"])[0]
        want = F.normalize(model.get_image_features(**batch["image"]).pooler_output, dim=-1)
    assert torch.allclose(image, want, atol=1e-6)
    folder = clip_run(tmp_path / "folder", "siglip2", "--training.local_batch_size=4").model_args
    assert (folder.image_size, folder.max_num_patches) == (16, 6)
    assert args.flops_per_sample() > folder.flops_per_sample()
    trainer.metrics.close()
    # a processor_config.json's image processor is the one transformers reads, before preprocessor_config.json
    tiny = tmp_path / "folder" / "tiny-siglip2"
    settings = json.loads((tiny / "preprocessor_config.json").read_text())
    combined = {"image_processor": {**settings, "max_num_patches": 9}, "processor_class": "Siglip2Processor"}
    (tiny / "processor_config.json").write_text(json.dumps(combined))
    assert AutoImageProcessor.from_pretrained(str(tiny)).max_num_patches == 9
    reread = clip_run(tmp_path / "folder", "siglip2", "--training.local_batch_size=4")
    assert reread.model_args.max_num_patches == 9
    reread.metrics.close()


@pytest.mark.parametrize(
    ("kind", "lora", "size"),
    # the default suite's time: a resize without LoRA, and SigLIP's (SigLIP 2's is default), with the slow marker
    slow_ones(
        [
            ("clip", False, 0),
            ("clip", True, 0),
            ("metaclip_2", True, 0),
            ("clip", "dora", 0),
            ("siglip", False, 0),
            ("siglip2", True, 24),
            ("clip", False, 24),
            ("siglip", True, 24),
        ],
        [("clip", False, 24), ("siglip", True, 24)],
    ),
)
def test_export_loads_back_in_transformers_and_sentence_transformers(
    tmp_path: Path, kind: str, lora: bool | str, size: int
) -> None:
    """A trained step folder exported --to hf (LoRA merged) is the folder's model class, trained, with the
    tokenizer and image processor; the exporter compares the reloaded embeddings (exit 2 if they differ).
    sentence-transformers embeds its pictures and captions as the run does: CLIP's as they are, SigLIP's
    with the processing the export sets (ids padded to the run's length with no mask; SigLIP 2's patch
    budget, here the run's 9 patches of 8 px where transformers' processor defaults to 256 of 16). A CLIP or
    SigLIP run at 24 px (the folder's 16: its position table resized) exports a 24 px model and processor.
    hf_clip trains on the export again, at the run's budget or size, to the same embeddings."""
    from PIL import Image
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel

    from titan_contrastive.export import main as export_main

    run = clip_run(
        tmp_path,
        kind,
        *(DORA if lora == "dora" else LORA if lora else ()),
        *([f"--data.image_size={size}"] if size else []),
        "--training.local_batch_size=5",
        "--training.steps=2",
        "--training.dtype=float32",
        "--checkpoint.enable=true",
        "--lr_scheduler.warmup_steps=0",
        "--optimizer.lr=1e-2",
    )
    run.train()
    run.metrics.close()
    step = tmp_path / f"run-{kind}" / "checkpoint" / "step-2"
    assert export_main([str(step), "--to", "hf", "--out", str(tmp_path / "hf")]) == 0
    vocabulary = "spiece.model" if kind == "siglip" else "tokenizer.json"  # SigLIP's: SentencePiece's model
    assert {"preprocessor_config.json", vocabulary, "config.json"} <= {p.name for p in (tmp_path / "hf").iterdir()}
    exported = dict(AutoModel.from_pretrained(str(tmp_path / "hf")).named_parameters())
    base = dict(AutoModel.from_pretrained(str(tmp_path / f"tiny-{kind}")).named_parameters())
    assert exported.keys() == base.keys()
    changed = [n for n in base if not torch.equal(exported[n], base[n])]
    assert "logit_scale" in changed and any(".q_proj." in n for n in changed)  # it trained (LoRA: merged)
    if kind == "siglip2":  # the run's budget, not the source folder's 6, in both of transformers' files
        written = [
            json.loads((tmp_path / "hf" / f"{n}_config.json").read_text()) for n in ("preprocessor", "processor")
        ]
        assert written[0]["max_num_patches"] == written[1]["image_processor"]["max_num_patches"] == 9
    elif size:  # the run's size in the model's config and in the processor's, not the source folder's 16
        written = json.loads((tmp_path / "hf" / "preprocessor_config.json").read_text())
        assert json.loads((tmp_path / "hf" / "config.json").read_text())["vision_config"]["image_size"] == 24
        assert {v for k in ("size", "crop_size") if k in written for v in written[k].values()} == {24}
    model, data = run.model.eval(), run.train_set
    data.train = False
    index = 3 if size else 0  # the picture served without resampling: 24 x 24 (SigLIP 2: 3 x 3 patches), 16 x 16
    batch = data.__getitems__([index, 1])
    images = batch["image"] if kind == "siglip2" else batch["image"].float()  # SigLIP 2: its dict of patches
    with torch.no_grad():
        image, text = model(images, batch["text"])[:2]
    st = SentenceTransformer(str(tmp_path / "hf"), device="cpu")
    picture = Image.open(tmp_path / "data" / "img" / f"{index}.png").convert("RGB")
    theirs = st.encode([picture], convert_to_tensor=True, normalize_embeddings=True)
    assert torch.allclose(theirs, image[:1], atol=1e-6)
    theirs = st.encode(data.captions([index, 1]), convert_to_tensor=True, normalize_embeddings=True)
    assert torch.allclose(theirs, text, atol=1e-6)
    # the export (sentence-transformers' files and all) is a folder hf_clip trains on, at the run's budget
    again = clip_run(
        tmp_path / "again",
        kind,
        f"--model.path={tmp_path / 'hf'}",
        "--training.dtype=float32",
        "--training.local_batch_size=4",
    )
    assert again.model_args.max_num_patches == (9 if kind == "siglip2" else 0)
    with torch.no_grad():
        reread = again.model.eval()(images, batch["text"])[:2]
    assert torch.allclose(reread[0], image, atol=1e-5) and torch.allclose(reread[1], text, atol=1e-5)
    again.metrics.close()
    if kind == "clip":
        assert export_main([str(step), "--to", "open_clip", "--out", str(tmp_path / "oc")]) == 2


def test_siglip2_train_crops_of_a_large_jpeg_are_decoded_at_reduced_scale(tmp_path: Path) -> None:
    """A 640 x 480 JPEG's train crop (resized to 2 x 3 patches of 8 px) is decoded at reduced scale: the same
    grid, and the patches of the fully decoded picture's same box (scaled back from the reduced one) to half a
    level on average, not the same bytes."""
    import io
    import math

    from PIL import Image

    from titan_contrastive.datasets.image_transforms import (
        CROP_RATIO,
        decode_image,
        random_resized_box,
        reduced_box,
        sample_rng,
    )

    g = np.random.default_rng(0)
    (tmp_path / "big" / "img").mkdir(parents=True)
    for i in range(4):
        noise = Image.fromarray(g.integers(0, 256, (12, 16, 3), dtype=np.uint8))
        noise.resize((640, 480), Image.Resampling.BICUBIC).save(tmp_path / "big" / "img" / f"{i}.jpg", quality=95)
    table = tmp_path / "big" / "train.csv"
    table.write_text("filepath\ttitle\n" + "".join(f"img/{i}.jpg\ta dog\n" for i in range(4)))
    trainer = clip_run(tmp_path, "siglip2", f"--data.path={table}", "--training.local_batch_size=4")
    data = trainer.train_set
    got = data.__getitems__([1])["image"]
    raw = (tmp_path / "big" / "img" / "1.jpg").read_bytes()
    ratio = (640 / 480 * CROP_RATIO[0], 640 / 480 * CROP_RATIO[1])
    box = random_resized_box(640, 480, sample_rng(data.seed, data.epoch, 1), ratio)
    height, width = data._naflex.size_of(box)
    reduced = Image.open(io.BytesIO(raw))  # the reduction the serving asks the decoder for
    reduced.draft("RGB", (math.ceil(640 * width / (box[2] - box[0])), math.ceil(480 * height / (box[3] - box[1]))))
    factor = round(640 / reduced.width)
    assert factor in (2, 4, 8), factor
    same = tuple(a * factor for a in reduced_box(box, factor))
    patches, grid = data._naflex.sample(decode_image(raw), same, data.normalize, (height, width))
    assert got["spatial_shapes"][0].tolist() == list(grid) == [2, 3]
    off = (got["pixel_values"][0, : len(patches)] - patches).abs() * 127.5  # in levels (std 0.5)
    assert 0 < off.mean() < 0.5 and off.max() < 20, (off.mean(), off.max())
    assert torch.equal(got["pixel_attention_mask"][0], torch.ones(6, dtype=torch.int32))
    trainer.metrics.close()


@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_another_image_size_starts_from_the_positions_transformers_interpolates(tmp_path: Path, kind: str) -> None:
    """`data.image_size=24` on a 16 px folder (2 x 2 patches of 8 px, then 3 x 3): before training, the run's
    embeddings of 24 px images equal transformers' `get_image_features(..., interpolate_pos_encoding=True)` on the
    folder's own model (to float32's rounding of the resized table); its parameter count is exact; GradCache
    chunks of 3 over 7 equal the dense objective in float64 at that size."""
    from transformers import AutoModel

    trainer = clip_run(tmp_path, kind, "--data.image_size=24", "--training.local_batch_size=4")
    assert trainer.model_args.image_size == 24
    assert trainer.model_args.num_params() == sum(p.numel() for p in trainer.model.parameters())
    images = torch.randn(3, 3, 24, 24, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    theirs = AutoModel.from_pretrained(str(tmp_path / f"tiny-{kind}"), dtype=torch.float64).eval()
    with torch.no_grad():
        want = theirs.get_image_features(pixel_values=images, interpolate_pos_encoding=True)
        got = trainer.model.eval().visual(pixel_values=images)
    want = F.normalize(getattr(want, "pooler_output", want), dim=-1)
    assert (got - want).abs().max() <= 1e-6  # resized as the folder's float32 table loads, before the float64 cast
    trainer.metrics.close()
    _step(tmp_path / "step", kind, "gradcache", "--data.image_size=24")


def test_bad_input_is_one_line(tmp_path: Path) -> None:
    from titan_contrastive.config import ConfigError
    from titan_contrastive.datasets import DataError

    with pytest.raises(ConfigError, match="model.path is empty: the hf_clip family trains"):
        base_trainer(str(tmp_path / "a"), "--model.name=hf_clip", "--model.flavor=folder", "--data.dataset=synthetic")
    with pytest.raises(ConfigError, match=r"data.image_size=20: .* reads images in 8 px patches; set a multiple of 8"):
        clip_run(tmp_path, "clip", "--data.image_size=20")
    with pytest.raises(ConfigError, match=r"data.context_length=8: .* reads exactly 12 tokens \(SigLIP pools"):
        clip_run(tmp_path, "siglip", "--data.context_length=8")
    with pytest.raises(ConfigError, match=r"data.image_size=20: .* reads images in 8 px patches; set .* \(e.g. 16"):
        clip_run(tmp_path, "siglip2", "--data.image_size=20")
    with pytest.raises(
        ConfigError, match=r"data.context_length=20: .* 12 learnt text positions are too few to stretch"
    ):
        clip_run(tmp_path, "clip", "--data.context_length=20")
    with pytest.raises(DataError, match="data.dataset='emoji': hf_clip reads RGB photos normalized with its folder's"):
        clip_run(tmp_path, "clip", "--data.dataset=emoji", "--data.path=")
    from tests.hf_folders import encoder_folder

    with pytest.raises(ConfigError, match="holds a 'bert' model; hf_clip trains CLIP, MetaCLIP 2, SigLIP and SigLIP 2"):
        clip_run(tmp_path, "clip", f"--model.path={encoder_folder(tmp_path)}")
    (tmp_path / "tiny-clip" / "preprocessor_config.json").unlink()
    with pytest.raises(ConfigError, match="has no preprocessor_config.json"):
        clip_run(tmp_path, "clip")
    config = tmp_path / "tiny-siglip2" / "preprocessor_config.json"
    saved = json.loads(config.read_text())
    for key, value, match in (
        ("resample", 1, r"resample=1; the run resizes images bilinear \(2\) or bicubic \(3\); set one of them"),
        ("max_num_patches", None, r"max_num_patches=None; SigLIP 2's processor sets a positive number"),
    ):
        config.write_text(json.dumps({**saved, key: value}))
        with pytest.raises(ConfigError, match=match):
            clip_run(tmp_path, "siglip2")


@pytest.mark.parametrize("kind", ["siglip", "siglip2"])
def test_the_command_line_trains_evaluates_and_resumes(
    tmp_path: Path, capsys: pytest.CaptureFixture, kind: str
) -> None:
    """`train.main` on a SigLIP or SigLIP 2 folder with its sigmoid loss: retrieval recall on data.val_path
    and zero-shot top-1 on an ImageFolder (both read at the folder's size and statistics; SigLIP 2's patches
    of each whole picture), a checkpoint, and two more steps resumed from it equal to four at once."""
    import json

    from titan_contrastive.train import main

    folder = image_text_folder(tmp_path, kind)
    table = pictures(tmp_path / "data")
    for c, name in enumerate(["cat", "dog"]):
        (tmp_path / "zs" / name).mkdir(parents=True)
        for i in range(3):
            picture = tmp_path / "data" / "img" / f"{c * 3 + i}.png"
            (tmp_path / "zs" / name / f"{i}.png").write_bytes(picture.read_bytes())
    args = [
        "--model.name=hf_clip",
        "--model.flavor=folder",
        f"--model.path={folder}",
        "--loss.name=siglip",
        "--data.dataset=csv",
        f"--data.path={table}",
        f"--data.val_path={table}",
        "--training.local_batch_size=6",
        "--training.dtype=float32",
        "--metrics.log_freq=1",
        "--metrics.enable_tensorboard=false",
        f"--eval.zero_shot_path={tmp_path / 'zs'}",
        "--eval.zero_shot_templates=simple",
        "--checkpoint.enable=true",
        "--checkpoint.interval=2",
        "--lr_scheduler.warmup_steps=0",
        "--lr_scheduler.decay_type=none",  # the same rates whether a run ends at step 2 or 4
    ]

    def run(folder: str, steps: int) -> dict:
        assert main([*args, f"--training.steps={steps}", f"--job.dump_folder={tmp_path / folder}"]) == 0
        lines = (tmp_path / folder / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines]

    whole = run("whole", 4)
    evals = [r for r in whole if r["kind"] == "eval"][-1]
    assert evals["num_samples"] == 30 and evals["zero_shot/num_samples"] == 6
    assert {"image_to_text_r@1", "text_to_image_r@1", "zero_shot/zero_shot_top1"} <= evals.keys()
    run("resumed", 2)
    resumed = run("resumed", 4)
    losses = {r["step"]: r["loss"] for r in whole if r["kind"] == "train"}
    assert [r["loss"] for r in resumed if r["kind"] == "train" and r["step"] > 2] == [losses[3], losses[4]]
    capsys.readouterr()


def test_a_clip_folder_under_the_sigmoid_loss_and_siglip_under_softmax(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A CLIP folder trained with the sigmoid loss learns a bias of its own from the loss's start (-10), exactly,
    and its export to a CLIPModel, which cannot hold it, is refused; a SigLIP folder under a softmax objective
    keeps its bias unused and frozen, with a warning."""
    from titan_contrastive.export import main as export_main

    _step(tmp_path, "clip", "gradcache", "--loss.name=siglip", objective=Sigmoid())
    run = clip_run(tmp_path / "export", "clip", "--loss.name=siglip", "--training.local_batch_size=4")
    assert run.model.logit_bias.item() == -10.0 and run.model.logit_bias.requires_grad
    assert run.model_args.num_params() == sum(p.numel() for p in run.model.parameters())
    run.metrics.close()
    run = clip_run(
        tmp_path / "export",
        "clip",
        "--loss.name=siglip",
        "--training.local_batch_size=4",
        "--training.steps=1",
        "--checkpoint.enable=true",
    )
    run.train()
    run.metrics.close()
    step = tmp_path / "export" / "run-clip" / "checkpoint" / "step-1"
    assert export_main([str(step), "--to", "hf", "--out", str(tmp_path / "hf")]) == 2
    assert not (tmp_path / "hf").exists() or not any((tmp_path / "hf").iterdir())
    caplog.set_level("WARNING", logger="titan_contrastive")
    run = clip_run(tmp_path / "softmax", "siglip", "--training.local_batch_size=4")
    assert "is a SigLIP model and loss.name='clip' a softmax objective" in caplog.text
    assert run.model.logit_bias.item() == -3.0 and not run.model.logit_bias.requires_grad
    batch = run.train_set.__getitems__([0, 1])
    assert len(run.model(batch["image"], batch["text"])) == 3  # no bias for the softmax objective
    run.metrics.close()


def test_a_clip_family_export_fine_tunes_as_the_same_model(tmp_path: Path) -> None:
    """clip/debug trained on the pictures with CLIP's BPE, exported --to hf (model, tokenizer, image processor
    with the run's statistics) and read by hf_clip: two implementations (ours, transformers') of the same
    weights give the same pixels, the same embeddings and the same loss of a step, in float64."""
    from titan_contrastive.export import main as export_main

    table = pictures(tmp_path / "data")
    data = [
        "--data.dataset=csv",
        f"--data.path={table}",
        "--data.context_length=12",
        "--training.local_batch_size=7",
        "--gradcache.enabled=true",
        "--gradcache.chunk_sizes=3",
    ]
    clip = base_trainer(
        str(tmp_path / "clip"),
        "--model.name=clip",
        "--model.flavor=debug",
        "--data.tokenizer=clip_bpe",
        "--data.image_size=16",
        "--training.steps=1",
        "--checkpoint.enable=true",
        *data,
    )
    clip.train()
    clip.metrics.close()
    step = tmp_path / "clip" / "checkpoint" / "step-1"
    assert export_main([str(step), "--to", "hf", "--out", str(tmp_path / "hf")]) == 0
    ours = base_trainer(
        str(tmp_path / "ours"),
        "--model.name=clip",
        f"--model.init_from={step}",
        "--data.tokenizer=clip_bpe",
        "--data.image_size=16",
        *data,
    )
    theirs = base_trainer(
        str(tmp_path / "theirs"),
        "--model.name=hf_clip",
        "--model.flavor=folder",
        f"--model.path={tmp_path / 'hf'}",
        "--data.image_size=0",
        *data,
    )
    for trainer in (ours, theirs):
        trainer.model.eval()
    a, b = (_tensors(t.train_set.__getitems__(list(range(7)))) for t in (ours, theirs))
    assert torch.equal(a["image"], b["image"])
    real = a["text"] != 0  # our BPE pads with 0, CLIP's tokenizer with its EOS
    assert torch.equal(a["text"][real], b["text"][real])
    with torch.no_grad():
        pairs = zip(ours.model(a["image"].double(), a["text"]), theirs.model(b["image"].double(), b["text"]))
        for mine, its in pairs:
            assert torch.allclose(mine, its, rtol=0, atol=1e-10)
    losses = [t.train_step([batch])["loss"] for t, batch in ((ours, a), (theirs, b))]
    assert abs(losses[0] - losses[1]) <= 1e-10 * losses[0]
    for trainer in (ours, theirs):
        trainer.metrics.close()
