"""A qwen_vl run as a sentence-transformers folder (`--to sentence-transformers`, `models.qwen_vl.st_folder`).

The chat template is held to the run's own processor here: rendered by the tokenizer's `apply_chat_template` as
sentence-transformers renders a message, its pads repeated per visual token, it gives the run's ids, in every
kind of side. The folder itself loads only where torchvision imports (transformers' Qwen-VL processor needs it:
the peers venv of benchmarks/peers_venv.sh): there the exporter's own check (sentence-transformers'
`encode_query` / `encode_document` against the run's embeddings) runs for a trained run, LoRA or not; here the
export is refused in one line.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.needs import require
from tests.test_qwen_vl import LORA, vl_run
from tests.test_qwen_vl_pairs import _vl_pairs_run

require("hf")

TEMPLATES = [
    ("{text}", "{image}"),
    ("Find an image that matches: {text}", "{image} Summarize above image in one word:"),
    ('{image} "Represent" the image, given {text}\n', "{image}"),
    ("{text} · query", "{text} — passage"),
]


def _kind(template: str) -> str:
    return "multi" if "{image}" in template and "{text}" in template else "image" if "{image}" in template else "text"


def _message(kind: str, text: str) -> list[dict]:
    """A sample as sentence-transformers makes it a message: structured content, the image first."""
    content = [{"type": "image", "image": None}] if kind != "text" else []
    content += [{"type": "text", "text": text}] if kind != "image" else []
    return [{"role": "user", "content": content}]


@pytest.mark.parametrize("query, doc", TEMPLATES)
def test_the_chat_template_gives_the_run_ids(tmp_path: Path, query: str, doc: str) -> None:
    """Each side's message rendered with task "query" / "document" (and without a task, where the kinds tell the
    sides apart), its `<|image_pad|>` repeated per visual token: the ids `VLProcessor.encode` gives the sample."""
    from tests.hf_folders import vl_folder
    from titan_contrastive.models.qwen_vl.processor import VLProcessor
    from titan_contrastive.models.qwen_vl.st_folder import chat_template

    processor = VLProcessor(str(vl_folder(tmp_path)), 0, 0, 6)
    tokenizer = processor.tokenizer
    tokenizer.chat_template = chat_template(query, doc)
    g = np.random.default_rng(0)
    images = [g.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in ((28, 56), (84, 84))]
    texts = ["a small cat", "frozen water in winter over the quiet lake at night"]  # the second is cut to 6 tokens
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for template, task in ((query, "query"), (doc, "document")):
        kind = _kind(template)
        given = images if kind != "text" else None
        want = processor.encode(template, texts, given)
        counts = processor.visual_tokens(want["image_grid_thw"]) if given else [0, 0]
        distinct = _kind(query) != _kind(doc)
        for row, text, count in zip(want["ids"], texts, counts, strict=True):
            for told in ({"task": task}, {}) if distinct else ({"task": task},):
                rendered = tokenizer.apply_chat_template(
                    _message(kind, processor.cut(text)), tokenize=False, add_generation_prompt=True, **told
                )
                ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
                expanded = [t for i in ids for t in ([pad] * count if i == pad else [i])]
                assert expanded == row[row != -1].tolist(), (template, told)


def test_the_chat_template_refuses_what_training_never_saw(tmp_path: Path) -> None:
    """Two images in one input, an image where the side's template has none (and none where it has one), and a
    system prompt: each a one-line error from the template, naming what to give."""
    from jinja2.exceptions import TemplateError

    from tests.hf_folders import vl_folder
    from titan_contrastive.models.bi_encoder.folder import load_tokenizer
    from titan_contrastive.models.qwen_vl.st_folder import chat_template

    tokenizer = load_tokenizer(str(vl_folder(tmp_path)))
    tokenizer.chat_template = chat_template("{text}", "{image} represent this")

    def render(messages: list[dict], **kwargs) -> str:
        return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)

    two = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}]}]
    with pytest.raises(TemplateError, match="^one image per input, as in training$"):
        render(two, task="document")
    with pytest.raises(TemplateError, match=r"^the template \{text\} takes no image$"):
        render(_message("image", ""), task="query")
    with pytest.raises(TemplateError, match=r"^the template \{image\} represent this takes an image$"):
        render(_message("text", "a cat"), task="document")
    system = [{"role": "system", "content": "Represent this"}, *_message("text", "a cat")]
    with pytest.raises(TemplateError, match="^the query and document templates are its prompts; give no system"):
        render(system, task="query")
    assert render(_message("image", "")) == "<|vision_start|><|image_pad|><|vision_end|> represent this"


def _trained(tmp: Path, mode: str, *extra: str) -> Path:
    """A step folder after two steps of a qwen_vl run in `mode` (t2i on the emoji, m2i on vl_pairs rows)."""
    common = ("--training.steps=2", "--training.dtype=float32", "--checkpoint.enable=true", "--optimizer.lr=1e-2")
    if mode == "t2i":
        run = vl_run(tmp, "qwen2_vl", "--training.local_batch_size=6", *common, *extra)
    else:
        run = _vl_pairs_run(tmp, mode, *common, *extra)
    run.train()
    run.metrics.close()
    return tmp / "run-qwen2_vl" / "checkpoint" / "step-2"


def test_without_torchvision_the_export_is_refused_in_one_line(tmp_path: Path, capsys) -> None:
    from titan_contrastive.export import main as export_main

    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 - not installed, or not importable beside this torch
        pass
    else:
        pytest.skip("torchvision imports here: the export is written and checked (the tests below)")
    step = _trained(tmp_path, "t2i")
    capsys.readouterr()
    assert export_main([str(step), "--to", "sentence-transformers", "--out", str(tmp_path / "st")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "video processor needs torchvision" in err and "--to hf" in err
    assert not (tmp_path / "st").exists()


@pytest.mark.parametrize(
    "mode, lora, pooling",
    [("t2i", False, "last_token"), ("t2i", True, "last_token"), ("m2i", False, "mean"), ("t2i", True, "colbert")],
)
def test_the_folder_loads_in_sentence_transformers_and_embeds_as_the_run(
    tmp_path: Path, mode: str, lora: bool, pooling: str
) -> None:
    """Where torchvision imports: the export passes its own check (sentence-transformers' query and document
    embeddings of images of three sizes and three texts, one cut, equal the run's; a ColQwen run's tokens, as a
    MultiVectorEncoder), and the folder holds the run's pooling or projection; `encode` without a task takes the side
    whose template reads the sample's kinds (t2i: an image is a document; m2i: an image with a text is a query)."""
    pytest.importorskip("torchvision", reason="transformers' Qwen-VL processor needs torchvision to load")
    from PIL import Image
    from sentence_transformers import MultiVectorEncoder, SentenceTransformer

    from titan_contrastive.export import main as export_main

    step = _trained(tmp_path, mode, f"--model.pooling={pooling}", *(LORA if lora else ()))
    out = tmp_path / "st"
    assert export_main([str(step), "--to", "sentence-transformers", "--out", str(out)]) == 0
    modules = [m["type"].rsplit(".", 1)[-1] for m in json.loads((out / "modules.json").read_text())]
    if pooling == "colbert":
        assert modules == ["Transformer", "Dense", "MultiVectorMask", "Normalize"]
        model = MultiVectorEncoder(str(out), device="cpu")
    else:
        assert modules == ["Transformer", "Pooling", "Normalize"]
        saved = json.loads((out / "1_Pooling" / "config.json").read_text())["pooling_mode"]
        assert saved == {"last_token": "lasttoken"}.get(pooling, pooling)
        model = SentenceTransformer(str(out), device="cpu")
    image = Image.fromarray(np.random.default_rng(1).integers(0, 256, (56, 84, 3), dtype=np.uint8))
    sample = image if mode == "t2i" else {"image": image, "text": "a cat"}
    side = model.encode_document if mode == "t2i" else model.encode_query
    assert torch.allclose(torch.as_tensor(model.encode([sample])[0]), torch.as_tensor(side([sample])[0]))
