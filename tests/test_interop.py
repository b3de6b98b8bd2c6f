"""Checkpoints in and out: Hugging Face CLIP folders and our step folders (tiny random models, float32).

- a transformers `CLIPModel` saved with `save_pretrained` loads through `load_clip` and
  `[model] init_from`; our embeddings equal `get_image_features` / `get_text_features` (normalized)
  to <= 1e-5, for a current config (pooling at `eos_token_id`) and a legacy one (at the highest id);
- `--to hf` writes a folder transformers loads and reproduces; ours -> hf -> ours is bit-identical;
- our own checkpoints, FSDP-sharded over 2 processes included, load and export the same way.
"""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.needs import require

require("hf")

import transformers  # noqa: E402

from titan_contrastive.export import main as export_main  # noqa: E402
from titan_contrastive.models.clip.state_dict_adapter import detect_format, load_clip, read_checkpoint  # noqa: E402
from titan_contrastive.models.weights import WeightsError  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def tiny_hf(
    folder: Path, *, eos: int = 49407, vocab: int = 49408, context: int = 77, image: int = 32, act: str = "quick_gelu"
) -> Path:
    torch.manual_seed(0)
    tower = dict(hidden_size=32, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, hidden_act=act)
    config = transformers.CLIPConfig(
        text_config=dict(
            tower,
            vocab_size=vocab,
            max_position_embeddings=context,
            eos_token_id=eos,
            bos_token_id=vocab - 2,
            pad_token_id=1,
        ),
        vision_config=dict(tower, image_size=image, patch_size=8),
        projection_dim=24,
    )
    model = transformers.CLIPModel(config)
    with torch.no_grad():  # non-trivial norms and scale, so a mapping mistake cannot hide behind ones and zeros
        for name, p in model.named_parameters():
            if "norm" in name or name == "logit_scale":
                p.add_(torch.rand_like(p) * 0.5)
    model.save_pretrained(str(folder))
    return folder


def reference(folder: Path, images: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    model = transformers.CLIPModel.from_pretrained(str(folder)).eval()
    with torch.no_grad():
        img, txt = model.get_image_features(pixel_values=images), model.get_text_features(input_ids=ids)
    img, txt = (getattr(x, "pooler_output", x) for x in (img, txt))
    return F.normalize(img, dim=-1), F.normalize(txt, dim=-1)


def inputs(vocab: int = 49408, context: int = 77, eos: int = 49407) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    images = torch.randn(3, 3, 32, 32, generator=g)
    ids = torch.randint(3, vocab - 3, (3, context), generator=g)
    for row, end in enumerate((5, context - 1, 20)):  # EOS then padding, as a tokenizer writes them
        ids[row, end] = eos
        ids[row, end + 1 :] = 0
    return images, ids


@pytest.mark.parametrize("eos", [49407, 2])
def test_load_clip_equals_transformers(tmp_path: Path, eos: int) -> None:
    """eos 49407: HF pools at that id; eos 2 (legacy configs): at the highest id, which EOS is."""
    folder = tiny_hf(tmp_path / "hf", eos=eos)
    assert detect_format(folder) == "hf"
    images, ids = inputs()
    want_img, want_txt = reference(folder, images, ids)
    model = load_clip(folder)
    with torch.no_grad():
        got_img, got_txt = model.encode_image(images), model.encode_text(ids)
    assert (got_img - want_img).abs().max() <= 1e-5 and (got_txt - want_txt).abs().max() <= 1e-5
    assert model.text.eos_id == (49407 if eos == 49407 else -1)


def test_export_to_hf_and_back_is_bit_identical(tmp_path: Path) -> None:
    src = tiny_hf(tmp_path / "hf", act="gelu")
    assert export_main([str(src), "--to", "hf", "--out", str(tmp_path / "out")]) == 0
    images, ids = inputs()
    want = reference(src, images, ids)
    got = reference(tmp_path / "out", images, ids)
    assert all(torch.equal(g, w) for g, w in zip(got, want))  # transformers reproduces them exactly
    a, b = read_checkpoint(src)[1], read_checkpoint(tmp_path / "out")[1]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    tok = transformers.CLIPTokenizerFast.from_pretrained(str(tmp_path / "out"))
    from titan_contrastive.datasets.clip_bpe import ClipBpeTokenizer

    text = ["a photo of a cat", "Two dogs, playing!"]
    ours = ClipBpeTokenizer(77).encode(text)
    theirs = tok(text)["input_ids"]
    assert [row[: len(t)].tolist() for row, t in zip(ours, theirs)] == theirs  # same ids up to the padding


def test_bad_checkpoints_are_one_line_errors(tmp_path: Path) -> None:
    with pytest.raises(WeightsError, match="not a checkpoint this project reads"):
        detect_format(tmp_path)
    folder = tiny_hf(tmp_path / "hf")
    config = json.loads((folder / "config.json").read_text())
    config["vision_config"]["num_hidden_layers"] = 3
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightsError) as err:
        read_checkpoint(folder)
    assert "missing keys ['vision_model.encoder.layers.2" in str(err.value) and len(str(err.value).splitlines()) == 1


SHORT_RUN = ("--training.local_batch_size=8", "--eval.enable=false", "--metrics.enable_tensorboard=false")


def _run(dump: Path, nproc: int, *args: str) -> str:
    env = {**os.environ, "NGPU": str(nproc), "PYTHON": sys.executable, "LOG_RANK": "0", "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run(
        ["./run_train.sh", f"--job.dump_folder={dump}", *SHORT_RUN, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout + out.stderr


def test_init_from_hf_then_our_fsdp_checkpoint_loads_and_exports(tmp_path: Path) -> None:
    """A 2-process FSDP2 run starts from a Hugging Face folder (emoji at 32 px, CLIP BPE captions),
    trains 2 steps and saves; its sharded step folder loads through load_clip and exports to hf."""
    from titan_contrastive.config import parse_args
    from titan_contrastive.train import Trainer

    src = tiny_hf(tmp_path / "hf")
    with pytest.raises(WeightsError, match="mis-shaped.*token_embedding.*set data.image_size, data.context_length"):
        Trainer(
            parse_args(
                [
                    f"--model.init_from={src}",
                    "--data.dataset=emoji",
                    "--data.image_size=32",  # byte tokens: vocab 259
                    f"--job.dump_folder={tmp_path / 'x'}",
                    "--metrics.enable_tensorboard=false",
                ]
            )
        )
    csv_dir = tmp_path / "csv"
    export = runpy.run_path(str(REPO / "scripts" / "export_emoji_files.py"), run_name="export_emoji_files")
    assert export["main"](["--out", str(csv_dir)]) == 0
    data = [
        "--data.dataset=csv",
        f"--data.path={csv_dir / 'train.csv'}",
        "--data.image_size=32",
        "--data.context_length=77",
    ]
    trainer = Trainer(
        parse_args(
            [
                f"--model.init_from={src}",
                *data,
                f"--job.dump_folder={tmp_path / 'y'}",
                "--metrics.enable_tensorboard=false",
            ]
        )
    )
    start = read_checkpoint(src)[1]
    assert all(torch.equal(trainer.model.state_dict()[k], v) for k, v in start.items())
    trainer.metrics.close()
    del trainer
    log = _run(
        tmp_path / "run",
        2,
        f"--model.init_from={src}",
        *data,
        "--training.steps=2",
        "--checkpoint.enable=true",
        "--parallelism.data_parallel_replicate_degree=1",
        "--parallelism.data_parallel_shard_degree=2",
        "--model.freeze=image",
    )
    assert "locked towers (run without a graph): image" in log
    step = tmp_path / "run" / "checkpoint" / "step-2"
    assert detect_format(step) == "ours"
    model = load_clip(step)
    trained = read_checkpoint(step)[1]
    for name, tensor in trained.items():  # LiT under FSDP2: the locked image tower is bit-identical, the rest trained
        assert torch.equal(tensor, start[name]) == name.startswith("visual."), name
    assert export_main([str(step), "--to", "hf", "--out", str(tmp_path / "exported")]) == 0
    images, ids = inputs()
    want_img, want_txt = reference(tmp_path / "exported", images, ids)
    with torch.no_grad():
        assert (model.encode_image(images) - want_img).abs().max() <= 1e-5
        assert (model.encode_text(ids) - want_txt).abs().max() <= 1e-5


def test_bi_encoder_exports_to_sentence_transformers(tmp_path: Path) -> None:
    """A bi_encoder (MiniLM) trained one step on a pairs file -> a SentenceTransformer folder whose
    embeddings equal ours (query tower, normalized mean pooling) to <= 1e-6."""
    import sentence_transformers as st

    from titan_contrastive.models import get_model_spec
    from titan_contrastive.models.bi_encoder.model import build_tokenizer
    from titan_contrastive.models.weights import read_ours
    from titan_contrastive.train import main as train_main

    pairs = tmp_path / "pairs.jsonl"
    words = ["ice", "fire", "river", "stone", "cloud", "bread", "glass", "storm", "sand", "wool"]
    pairs.write_text(
        "".join(json.dumps({"query": w, "positive": f"the {w} of the {u}"}) + "\n" for w, u in zip(words, words[::-1]))
    )
    run = [  # in this process: the export is under test here (test_run_train.py tests the launches)
        f"--job.dump_folder={tmp_path / 'run'}",
        *SHORT_RUN,
        "--model.name=bi_encoder",
        "--model.flavor=shared",
        "--data.dataset=pairs",
        f"--data.path={pairs}",
        "--data.context_length=24",
        "--training.steps=1",
        "--checkpoint.enable=true",
        "--optimizer.lr=1e-3",
    ]
    assert train_main(run) == 0
    step = tmp_path / "run" / "checkpoint" / "step-1"
    assert export_main([str(step), "--to", "sentence-transformers", "--out", str(tmp_path / "st")]) == 0
    family, args, ours = read_ours(step)
    ours.eval()
    state = ours.state_dict()
    texts = [
        "a masterly or brilliant feat",
        "frozen water",
        "the fifth letter of the Greek alphabet, said quickly twice",
    ]
    ids = build_tokenizer(args).encode(texts, args.query_length)
    with torch.no_grad():
        want = ours._embed(ours.query_tower, ids)
    got = st.SentenceTransformer(str(tmp_path / "st"), device="cpu").encode(texts, convert_to_tensor=True)
    assert (got - want).abs().max() <= 1e-6
    pristine = get_model_spec(family).build_model(args)
    assert not torch.equal(
        pristine.query_tower.embeddings.word_embeddings.weight, state["query_tower.embeddings.word_embeddings.weight"]
    )
    # a transformers folder of the tower: AutoModel + its tokenizer, mean-pooled as the run does
    assert export_main([str(step), "--to", "hf", "--out", str(tmp_path / "hf")]) == 0
    from transformers import AutoModel, AutoTokenizer

    tower = AutoModel.from_pretrained(str(tmp_path / "hf")).eval()
    batch = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = tower(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    pooled = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)
    assert (pooled - want).abs().max() <= 1e-5
    assert export_main([str(step), "--to", "peft", "--out", str(tmp_path / "x")]) == 2  # no LoRA in this run


def test_open_clip_format_round_trip(tmp_path: Path) -> None:
    """ours -> open_clip layout (config + safetensors) -> ours is bit-identical, pooling at the same
    EOS id (`text_cfg` pool_type "eos"); without the config the architecture is read from the tensors'
    shapes (heads = width / 64, quick GELU, as open_clip's build_model_from_openai_state_dict); a
    state-dict file with open_clip's training wrapper loads too."""
    from safetensors.torch import load_file

    from titan_contrastive.models.clip.openclip import args_from_open_clip

    src = tiny_hf(tmp_path / "hf")
    assert export_main([str(src), "--to", "open_clip", "--out", str(tmp_path / "oc")]) == 0
    assert detect_format(tmp_path / "oc") == "open_clip"
    (_, a), (args_b, b) = read_checkpoint(src), read_checkpoint(tmp_path / "oc")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # text_cfg: pool_type eos, eos_id
    assert (args_b.vision_heads, args_b.act, args_b.eos_id) == (4, "quick_gelu", 49407)
    config = json.loads((tmp_path / "oc" / "open_clip_config.json").read_text())
    assert config["model_cfg"]["vision_cfg"] == {
        "image_size": 32,
        "layers": 2,
        "width": 32,
        "patch_size": 8,
        "head_width": 8,
        "mlp_ratio": 4.0,
    }
    weights = load_file(str(tmp_path / "oc" / "open_clip_model.safetensors"))
    assert "transformer.resblocks.1.attn.in_proj_weight" in weights and weights["logit_scale"].shape == ()
    inferred = args_from_open_clip(None, weights)
    assert (
        inferred.embed_dim,
        inferred.image_size,
        inferred.patch_size,
        inferred.vision_layers,
        inferred.text_layers,
        inferred.context_length,
        inferred.vocab_size,
    ) == (24, 32, 8, 2, 2, 77, 49408)
    torch.save({"epoch": 3, "state_dict": {f"module.{k}": v for k, v in weights.items()}}, tmp_path / "epoch_3.pt")
    (tmp_path / "open_clip_config.json").write_text(json.dumps(config))
    c = read_checkpoint(tmp_path / "epoch_3.pt")[1]
    assert all(torch.equal(a[k], c[k]) for k in a)


def test_open_clip_loads_our_export(tmp_path: Path) -> None:
    """Where open_clip imports (it needs torchvision, which does not import beside torch 2.13 on
    CPU here: benchmarks/interop_openclip.py runs this in its own venv), its model built from our
    export gives our embeddings."""
    open_clip = pytest.importorskip(
        "open_clip", reason="open_clip needs torchvision; see benchmarks/interop_openclip.py"
    )
    src = tiny_hf(tmp_path / "hf", act="gelu")
    assert export_main([str(src), "--to", "open_clip", "--out", str(tmp_path / "oc")]) == 0
    theirs, _, _ = open_clip.create_model_and_transforms(f"local-dir:{tmp_path / 'oc'}")
    images, ids = inputs()
    ours = load_clip(src)
    with torch.no_grad():
        assert (theirs.eval().encode_image(images, normalize=True) - ours.encode_image(images)).abs().max() <= 1e-5
        assert (theirs.encode_text(ids, normalize=True) - ours.encode_text(ids)).abs().max() <= 1e-5


def test_init_from_at_another_image_size_resizes_the_position_table(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A 32 px checkpoint (4 x 4 patches) starts runs at 48 and 24 px. Grown, the first embeddings equal
    transformers' `interpolate_pos_encoding=True`; shrunk, the grid equals Pillow's antialiased bicubic resize
    of each channel; the class row and every other weight are the checkpoint's. Through the trainer too."""
    import logging

    import numpy as np
    from PIL import Image

    from titan_contrastive.config import parse_args
    from titan_contrastive.models.clip import CLIP
    from titan_contrastive.models.positions import KEY, fit_positions, resize_positions
    from titan_contrastive.models.weights import load_state
    from titan_contrastive.train import Trainer

    src = tiny_hf(tmp_path / "hf")
    args, state = read_checkpoint(src)
    sized = args.update_from_data(image_shape=(3, 48, 48), vocab_size=49408, context_length=77, eos_id=49407)
    model = CLIP(sized)
    load_state(model, fit_positions(state, sized), "test")
    images = torch.randn(3, 3, 48, 48, generator=torch.Generator().manual_seed(2))
    theirs = transformers.CLIPModel.from_pretrained(str(src)).eval()
    with torch.no_grad():
        want = theirs.get_image_features(pixel_values=images, interpolate_pos_encoding=True)
        got = model.eval().encode_image(images)
    assert (got - F.normalize(getattr(want, "pooler_output", want), dim=-1)).abs().max() <= 1e-5

    table = state[KEY]
    small = resize_positions(table, 3)
    assert small.shape == (10, 32) and torch.equal(small[0], table[0])
    grids = table[1:].T.reshape(32, 4, 4).numpy()
    pil = [np.asarray(Image.fromarray(g, mode="F").resize((3, 3), Image.Resampling.BICUBIC)) for g in grids]
    assert np.abs(small[1:].T.reshape(32, 3, 3).numpy() - np.stack(pil)).max() <= 1e-5
    assert resize_positions(table, 4) is table
    with pytest.raises(WeightsError, match=r"a position table of 6 rows is not 1 class row\(s\) and a square grid"):
        resize_positions(table[:6], 3)

    csv_dir = tmp_path / "csv"
    runpy.run_path(str(REPO / "scripts" / "export_emoji_files.py"), run_name="x")["main"](["--out", str(csv_dir)])
    with caplog.at_level(logging.INFO, logger="titan_contrastive"):
        trainer = Trainer(
            parse_args(
                [
                    f"--model.init_from={src}",
                    "--data.dataset=csv",
                    f"--data.path={csv_dir / 'train.csv'}",
                    "--data.image_size=24",
                    "--data.context_length=77",
                    f"--job.dump_folder={tmp_path / 'run'}",
                    "--metrics.enable_tensorboard=false",
                ]
            )
        )
    assert f"{KEY} resized from 4x4 to 3x3 patches for 24 px images" in caplog.text
    loaded = trainer.model.state_dict()
    assert torch.equal(loaded[KEY], small) and all(torch.equal(loaded[k], v) for k, v in state.items() if k != KEY)
    trainer.metrics.close()


def test_init_from_with_a_shorter_context_cuts_the_text_positions(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """A 77-position checkpoint at data.context_length=24: captions of at most 24 tokens (EOS at 5, 23, 20) embed
    as transformers embeds them padded to 77 (the causal tower never reads past the EOS); a longer context than
    a checkpoint of too few positions to stretch (21) is refused in one line."""
    import logging

    from titan_contrastive.models.clip import CLIP
    from titan_contrastive.models.positions import fit_positions
    from titan_contrastive.models.weights import load_state

    src = tiny_hf(tmp_path / "hf")
    args, state = read_checkpoint(src)
    sized = args.update_from_data(image_shape=(3, 32, 32), vocab_size=49408, context_length=24, eos_id=49407)
    model = CLIP(sized)
    with caplog.at_level(logging.INFO, logger="titan_contrastive"):
        load_state(model, fit_positions(state, sized), "test")
    assert "text.positional_embedding cut from 77 to 24 positions" in caplog.text
    ids = torch.randint(3, 49405, (3, 77), generator=torch.Generator().manual_seed(3))
    for row, end in enumerate((5, 23, 20)):
        ids[row, end], ids[row, end + 1 :] = 49407, 0
    images, _ = inputs()
    want_img, want_txt = reference(src, images, ids)
    with torch.no_grad():
        assert (model.eval().encode_text(ids[:, :24]) - want_txt).abs().max() <= 1e-5
        assert (model.encode_image(images) - want_img).abs().max() <= 1e-5
    short = {**state, "text.positional_embedding": state["text.positional_embedding"][:21]}
    longer = args.update_from_data(image_shape=(3, 32, 32), vocab_size=49408, context_length=100, eos_id=49407)
    with pytest.raises(
        WeightsError, match=r"context_length=100: the checkpoint's 21 learnt text positions are too few"
    ):
        fit_positions(short, longer)
