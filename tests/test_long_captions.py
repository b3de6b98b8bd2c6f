"""Captions longer than a CLIP checkpoint's positions, by Long-CLIP's knowledge-preserved stretching
(`models/positions.py`: `stretch_positions`): the table against Long-CLIP's construction written out; the
clip family from a transformers CLIP folder (`init_from`) and hf_clip's CLIP folders, where captions of at most 20
tokens keep the checkpoint's embeddings, and a step of such a run exports with the new length."""

from __future__ import annotations

import runpy
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.needs import require

require("hf")

import transformers  # noqa: E402

from tests.hf_folders import image_text_folder  # noqa: E402
from tests.test_hf_clip import clip_run  # noqa: E402
from tests.test_interop import REPO, inputs, read_checkpoint, reference, tiny_hf  # noqa: E402
from titan_contrastive.export import main as export_main  # noqa: E402


def long_clip_table(old: torch.Tensor) -> torch.Tensor:
    """Long-CLIP's stretching of a CLIP text position table, written out as its paper's release does it: the first
    20 rows kept, each later row followed by three interpolated at 1/4, 2/4 and 3/4 of the way to the next, and
    past the last row its difference to the one before continued: n rows -> 4n - 60."""
    n, keep = old.shape[0], 20
    new = torch.zeros(4 * n - 3 * keep, old.shape[1], dtype=old.dtype)
    new[:keep] = old[:keep]
    for i in range(n - 1 - keep):
        for m in range(4):
            new[keep + 4 * i + m] = (4 - m) * old[keep + i] / 4 + m * old[keep + i + 1] / 4
    for m in range(4):
        new[4 * n - 3 * keep - 4 + m] = old[n - 1] + m * (old[n - 1] - old[n - 2]) / 4
    return new


def test_init_from_with_a_longer_context_stretches_the_text_positions(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """A 77-position checkpoint at data.context_length=248: the table is Long-CLIP's (to float rounding; float64),
    other lengths stretch the same way, and captions of at most 20 tokens (EOS at 5 and 19) embed as transformers
    embeds them at 77; the longer captions, up to 248 tokens, run through the stretched table. A step of such a run
    exports to transformers (248 positions) and open_clip."""
    import logging

    from titan_contrastive.models.clip import CLIP
    from titan_contrastive.models.positions import TEXT_KEY, fit_positions, stretch_positions
    from titan_contrastive.models.weights import load_state

    src = tiny_hf(tmp_path / "hf")
    args, state = read_checkpoint(src)
    table = state[TEXT_KEY].double()
    assert (stretch_positions(table, 248) - long_clip_table(table)).abs().max() <= 1e-12
    grown = stretch_positions(table, 100)
    assert grown.shape == (100, 32) and torch.equal(grown[:20], table[:20]) and torch.equal(grown[20], table[20])
    at = 20 + 79 * 57 / 80  # the last row reads the old table at this place
    expected = table[75] + (at - 75) * (table[76] - table[75])
    assert (grown[99] - expected).abs().max() <= 1e-12
    sized = args.update_from_data(image_shape=(3, 32, 32), vocab_size=49408, context_length=248, eos_id=49407)
    model = CLIP(sized)
    with caplog.at_level(logging.INFO, logger="titan_contrastive"):
        load_state(model, fit_positions(state, sized), "test")
    assert "text.positional_embedding stretched from 77 to 248 positions" in caplog.text
    ids = torch.randint(3, 49405, (2, 77), generator=torch.Generator().manual_seed(3))
    for row, end in enumerate((5, 19)):
        ids[row, end], ids[row, end + 1 :] = 49407, 0
    _, want = reference(src, inputs()[0], ids)
    long_ids = torch.cat([ids, torch.zeros(2, 248 - 77, dtype=ids.dtype)], 1)
    with torch.no_grad():
        assert (model.eval().encode_text(long_ids) - want).abs().max() <= 1e-5
        long_caption = torch.randint(3, 49405, (1, 248), generator=torch.Generator().manual_seed(4))
        long_caption[0, 200] = 49407
        assert torch.isfinite(model.encode_text(long_caption)).all()

    from titan_contrastive.config import parse_args
    from titan_contrastive.export import main as export_main
    from titan_contrastive.train import Trainer

    csv_dir = tmp_path / "csv"  # a step at 248 tokens, exported: each export is checked against the run's embeddings
    runpy.run_path(str(REPO / "scripts" / "export_emoji_files.py"), run_name="x")["main"](["--out", str(csv_dir)])
    flags = [f"--model.init_from={src}", "--data.dataset=csv", f"--data.path={csv_dir / 'train.csv'}"]
    flags += ["--data.image_size=32", "--data.context_length=248", f"--job.dump_folder={tmp_path / 'run'}"]
    flags += ["--training.steps=1", "--lr_scheduler.warmup_steps=0", "--checkpoint.enable=true", "--eval.enable=false"]
    trainer = Trainer(parse_args([*flags, "--metrics.enable_tensorboard=false"]))
    trainer.train()
    trainer.metrics.close()
    step = str(tmp_path / "run" / "checkpoint" / "step-1")
    assert export_main([step, "--to", "hf", "--out", str(tmp_path / "out")]) == 0
    assert (
        transformers.CLIPModel.from_pretrained(str(tmp_path / "out")).config.text_config.max_position_embeddings == 248
    )
    assert export_main([step, "--to", "open_clip", "--out", str(tmp_path / "oc")]) == 0


def _folder_of_24_positions(tmp: Path, kind: str) -> Path:
    """The tiny hf_clip CLIP or MetaCLIP 2 folder (12 text positions) given a random table of 24, saved beside it."""
    src = image_text_folder(tmp, kind)
    model = transformers.AutoModel.from_pretrained(str(src))
    embeddings = model.text_model.embeddings
    table = torch.randn(24, 16, generator=torch.Generator().manual_seed(5)) * 0.1
    embeddings.position_embedding = torch.nn.Embedding.from_pretrained(table, freeze=False)
    embeddings.register_buffer("position_ids", torch.arange(24).expand((1, -1)), persistent=False)
    model.config.text_config.max_position_embeddings = 24
    folder = tmp / f"{kind}-24"
    model.save_pretrained(str(folder))
    for file in src.iterdir():
        if file.name not in ("config.json", "model.safetensors"):
            shutil.copy(file, folder / file.name)
    return folder


@pytest.mark.parametrize("kind", ["clip", "metaclip_2"])
def test_an_hf_clip_folder_reads_longer_captions(tmp_path: Path, kind: str) -> None:
    """A CLIP (MetaCLIP 2) folder of 24 positions at data.context_length=40: its table stretched, the parameter
    count exact, captions of at most 20 tokens embed as transformers embeds them at 24; a step exports as a model
    of 40 positions (the exporter checks it against the run); a folder of fewer positions than 22 is refused."""
    from titan_contrastive.config import ConfigError
    from titan_contrastive.models.positions import stretch_positions

    folder = _folder_of_24_positions(tmp_path, kind)
    flags = ("--data.context_length=40", "--training.local_batch_size=4", "--training.global_batch_size=4")
    flags += ("--training.steps=1", "--checkpoint.enable=true")
    trainer = clip_run(tmp_path, kind, f"--model.path={folder}", *flags)
    assert trainer.model_args.context_length == 40
    assert trainer.model_args.num_params() == sum(p.numel() for p in trainer.model.parameters())
    theirs = transformers.AutoModel.from_pretrained(str(folder), dtype=torch.float64).eval()
    table = trainer.model.text.transformer.embeddings.position_embedding.weight
    want_table = stretch_positions(theirs.text_model.embeddings.position_embedding.weight.detach(), 40)
    assert table.shape == (40, 16) and (table - want_table).abs().max() <= 1e-6
    eos = theirs.config.text_config.eos_token_id
    vocab = theirs.config.text_config.vocab_size
    ids = torch.randint(4, vocab, (2, 40), generator=torch.Generator().manual_seed(6))
    for row, end in enumerate((3, 19)):
        ids[row, end], ids[row, end + 1 :] = eos, eos
    with torch.no_grad():
        want = F.normalize(
            getattr(out := theirs.get_text_features(input_ids=ids[:, :24]), "pooler_output", out), dim=-1
        )
        got = trainer.model.eval().text(input_ids=ids)
    assert (got - want).abs().max() <= 1e-6
    trainer.train()
    trainer.metrics.close()
    steps = sorted((tmp_path / f"run-{kind}" / "checkpoint").glob("step-*"))
    assert export_main([str(steps[-1]), "--to", "hf", "--out", str(tmp_path / "out")]) == 0
    exported = transformers.AutoModel.from_pretrained(str(tmp_path / "out"))
    assert exported.config.text_config.max_position_embeddings == 40
    assert transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out")).model_max_length == 40
    with pytest.raises(
        ConfigError, match=r"data.context_length=20: .* 12 learnt text positions are too few to stretch"
    ):
        clip_run(tmp_path / "small", kind, "--data.context_length=20")
