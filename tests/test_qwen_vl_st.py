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
from PIL import Image

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
    from titan_contrastive.models.qwen_vl.chat_template import chat_template
    from titan_contrastive.models.qwen_vl.processor import VLProcessor

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


def test_a_chat_template_of_several_kinds_per_side_gives_the_run_ids(tmp_path: Path) -> None:
    """A run of several modes (`data.retrieval_modes` m2t and t2i, the model's t2i): each side's templates are the
    run's own for its kind and the defaults for the others (`side_template`, as training filled them); each kind of
    message, with its task and without one, renders to the ids `VLProcessor.encode` gives it with that template."""
    from tests.hf_folders import vl_folder
    from titan_contrastive.models.qwen_vl.chat_template import chat_template
    from titan_contrastive.models.qwen_vl.model import QwenVLArgs
    from titan_contrastive.models.qwen_vl.processor import VLProcessor
    from titan_contrastive.models.qwen_vl.templates import side_template

    args = QwenVLArgs(mode="t2i", modes=("m2t", "t2i"), query_template="Find: {text}", doc_template="{image} Look")
    query, doc = ([side_template(args, side, m) for m in args.modes] for side in ("query", "doc"))
    assert query == ["{image} {text}", "Find: {text}"] and doc == ["{text}", "{image} Look"]
    processor = VLProcessor(str(vl_folder(tmp_path)), 0, 0, 6)
    tokenizer = processor.tokenizer
    tokenizer.chat_template = chat_template(query, doc)
    g = np.random.default_rng(1)
    images = [g.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in ((28, 56), (56, 28))]
    texts = ["a small cat", "frozen water"]
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    cases = [(t, "query", "query") for t in query] + [(t, "document", told) for t in doc for told in ("document", None)]
    cases.append(("{image} {text}", "query", None))  # without a task: the document's where it reads the kinds
    for template, task, told in cases:
        kind = _kind(template)
        want = processor.encode(template, texts, images if kind != "text" else None)
        counts = processor.visual_tokens(want["image_grid_thw"]) if kind != "text" else [0, 0]
        for row, text, count in zip(want["ids"], texts, counts, strict=True):
            extra = {"task": told} if told else {}
            rendered = tokenizer.apply_chat_template(_message(kind, processor.cut(text)), tokenize=False, **extra)
            ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
            expanded = [t for i in ids for t in ([pad] * count if i == pad else [i])]
            assert expanded == row[row != -1].tolist(), (template, task, told)


def test_the_chat_template_refuses_what_training_never_saw(tmp_path: Path) -> None:
    """Two images in one input, an image where the side's template has none (and none where it has one), and a
    system prompt: each a one-line error from the template, naming what to give."""
    from jinja2.exceptions import TemplateError

    from tests.hf_folders import vl_folder
    from titan_contrastive.models.bi_encoder.folder import load_tokenizer
    from titan_contrastive.models.qwen_vl.chat_template import chat_template

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


QWEN_CHAT = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n{% else %}"
    "{% for content in message['content'] %}{% if content['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""Qwen2-VL-Instruct's chat template (without its video and vision-id branches)."""


def vl_st_folder(root: Path, prompts: dict[str, str], pooling: str = "mean", chat: str = QWEN_CHAT) -> Path:
    """The tiny Qwen2-VL folder as a sentence-transformers folder, as sentence-transformers writes one (read back by
    it below, where torchvision imports): the model at the root with `chat` as its chat template and the generation
    prompt asked for, `pooling`, Normalize and `prompts` (Qwen3-VL-Embedding's and GME's shape)."""
    import shutil

    from tests.hf_folders import vl_folder

    out = root / f"st-{pooling}"
    shutil.copytree(vl_folder(root), out)
    (out / "chat_template.jinja").write_text(chat)
    modules = [("Transformer", "", "sentence_transformers.base.modules.transformer.Transformer")]
    modules += [("Pooling", "1_Pooling", "sentence_transformers.sentence_transformer.modules.pooling.Pooling")]
    modules += [("Normalize", "2_Normalize", "sentence_transformers.base.modules.normalize.Normalize")]
    entries = [{"idx": i, "name": str(i), "path": path, "type": kind} for i, (_, path, kind) in enumerate(modules)]
    (out / "modules.json").write_text(json.dumps(entries))
    (out / "config_sentence_transformers.json").write_text(json.dumps({"prompts": prompts}))
    hidden = {"method": "forward", "method_output_name": "last_hidden_state"}
    bert = {
        "transformer_task": "feature-extraction",
        "modality_config": {"text": hidden, "image": hidden, "message": {**hidden, "format": "structured"}},
        "module_output_name": "token_embeddings",
        "processing_kwargs": {"chat_template": {"add_generation_prompt": True}},
        "processor_kwargs": {"use_fast": False},
    }
    (out / "sentence_bert_config.json").write_text(json.dumps(bert))
    for _, path, _ in modules[1:]:
        (out / path).mkdir()
    (out / "1_Pooling" / "config.json").write_text(json.dumps({"embedding_dimension": 32, "pooling_mode": pooling}))
    return out


def test_a_sentence_transformers_folder_gives_its_templates_and_pooling(tmp_path: Path) -> None:
    """`[model] path` a sentence-transformers folder of a Qwen-VL embedder: each side's template is its chat template
    rendered as sentence-transformers renders that side (the prompt a system message, the generation prompt), the
    pooling its Pooling's; a side's own `[model]` prompt and pooling still win; a chat template that drops the
    image, and Dense modules after the pooling, are one-line errors."""
    from safetensors.torch import save_file

    from titan_contrastive.config import ConfigError

    prompts = {"query": "Find the picture of this.", "document": "Represent the picture."}
    folder = vl_st_folder(tmp_path, prompts)

    def args(*extra: str, path: Path = folder):
        return vl_run(tmp_path, "qwen2_vl", f"--model.path={path}", "--training.local_batch_size=6", *extra).model_args

    turn = "<|im_start|>system\n{}<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
    got = args()
    assert (got.query_template, got.doc_template, got.pooling) == (
        turn.format(prompts["query"], "{text}"), turn.format(prompts["document"], "{image}"), "mean"
    )  # fmt: skip
    mine = args("--model.doc_prompt={image} a photo", "--model.pooling=last_token")
    assert (mine.query_template, mine.doc_template, mine.pooling) == (
        got.query_template,
        "{image} a photo",
        "last_token",
    )
    bare = vl_st_folder(tmp_path / "bare", {}, "lasttoken")
    assert args(path=bare).doc_template == turn.format("You are a helpful assistant.", "{image}")
    (bare / "chat_template.jinja").rename(bare / "unread.jinja")  # a processor's template as older folders save it
    (bare / "chat_template.json").write_text(json.dumps({"chat_template": QWEN_CHAT.replace("helpful", "kind")}))
    assert args(path=bare).doc_template == turn.format("You are a kind assistant.", "{image}")
    blind = vl_st_folder(tmp_path / "blind", prompts, chat=QWEN_CHAT.replace("<|vision_start|><|image_pad|>", ""))
    with pytest.raises(
        ConfigError, match=r"its chat template renders a doc sample \(image\) as .*; set model.doc_prompt to"
    ):
        args(path=blind)
    modules = json.loads((folder / "modules.json").read_text())
    dense = {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.base.modules.dense.Dense"}
    (folder / "3_Dense").mkdir()
    (folder / "3_Dense" / "config.json").write_text(json.dumps({"in_features": 32, "out_features": 8}))
    save_file({"linear.weight": torch.zeros(8, 32)}, str(folder / "3_Dense" / "model.safetensors"))
    (folder / "modules.json").write_text(json.dumps([*modules[:2], dense, modules[2]]))
    with pytest.raises(ConfigError, match="with Dense modules after its pooling, which the qwen_vl family does not"):
        args()


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
    [
        ("t2i", False, "last_token"),
        ("t2i", True, "last_token"),
        ("m2i", False, "mean"),
        ("m2t", False, "last_token"),
        ("t2i", True, "colbert"),
    ],
)
def test_the_folder_loads_in_sentence_transformers_and_embeds_as_the_run(
    tmp_path: Path, mode: str, lora: bool, pooling: str
) -> None:
    """Where torchvision imports: the export passes its own check (sentence-transformers' query and document
    embeddings of images of three sizes and three texts, one cut, equal the run's; a ColQwen run's tokens, as a
    MultiVectorEncoder), and the folder holds the run's pooling or projection; `encode` without a task takes the side
    whose template reads the sample's kinds (t2i: an image is a document; m2i, m2t: an image with a text is a
    query)."""
    pytest.importorskip("torchvision", reason="transformers' Qwen-VL processor needs torchvision to load")
    from sentence_transformers import MultiVectorEncoder, SentenceTransformer

    from titan_contrastive.config import ConfigError
    from titan_contrastive.export import main as export_main
    from titan_contrastive.models.weights import read_ours

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
    # a run on the folder reads the run's templates, pooling and projection back
    _, run, trained = read_ours(step)
    if mode == "t2i":
        again = vl_run(tmp_path / "again", "qwen2_vl", f"--model.path={out}", "--training.local_batch_size=6")
    else:
        again = _vl_pairs_run(tmp_path / "again", mode, f"--model.path={out}")
        with pytest.raises(ConfigError, match=r"its chat template refuses a query sample \(text\) of data.retrieval"):
            vl_run(tmp_path / "again", "qwen2_vl", f"--model.path={out}", "--training.local_batch_size=6")
    got = again.model_args
    assert (got.query_template, got.doc_template, got.pooling) == (run.query_template, run.doc_template, pooling)
    if pooling == "colbert":
        assert torch.equal(again.model.head.weight.float(), trained.head.weight.float())


@pytest.mark.parametrize("saved", ["jinja", "json"])
def test_sentence_transformers_embeds_a_folder_as_a_run_on_it(tmp_path: Path, saved: str) -> None:
    """Where torchvision imports: sentence-transformers loads `vl_st_folder` (so it is the folder it writes; its chat
    template in chat_template.jinja or in the processor's chat_template.json), and its
    `encode_query` / `encode_document` of captions and images of two sizes equal what a run on the folder computes
    from the templates it read, before any step."""
    pytest.importorskip("torchvision", reason="transformers' Qwen-VL processor needs torchvision to load")
    from sentence_transformers import SentenceTransformer

    from titan_contrastive.models.qwen_vl.model import vl_embed

    folder = vl_st_folder(tmp_path, {"query": "Find the picture of this.", "document": "Represent the picture."})
    if saved == "json":  # the processor's chat_template.json, as older Qwen-VL folders hold it
        (folder / "chat_template.jinja").unlink()
        (folder / "chat_template.json").write_text(json.dumps({"chat_template": QWEN_CHAT}))
    run = vl_run(tmp_path, "qwen2_vl", f"--model.path={folder}", "--training.local_batch_size=6")
    model, args = run.model.eval(), run.model_args
    g = np.random.default_rng(0)
    images = [g.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in ((28, 56), (84, 84))]
    texts = ["a small cat", "frozen water in winter"]
    batch = args.processor()(images, texts)
    with torch.no_grad():
        tower = model.tower.float()
        query = vl_embed(tower, batch["query"], args.pooling)
        doc = vl_embed(tower, batch["doc"], args.pooling, batch["doc_pixel_values"], batch["doc_image_grid_thw"])
    theirs = SentenceTransformer(str(folder), device="cpu")
    pictures = [Image.fromarray(x) for x in images]
    assert torch.allclose(query, theirs.encode_query(texts, convert_to_tensor=True), atol=1e-5)
    assert torch.allclose(doc, theirs.encode_document(pictures, convert_to_tensor=True), atol=1e-5)


def test_a_run_of_two_modes_exports_a_template_for_each_kind(tmp_path: Path) -> None:
    """Where torchvision imports: a run of m2t and t2i sources (the model's mode t2i) exports a folder whose
    `encode_query` embeds an image with its question, and `encode_document` a text answer, as the run embedded the m2t
    rows (the export's own check covers the model's t2i sides)."""
    pytest.importorskip("torchvision", reason="transformers' Qwen-VL processor needs torchvision to load")
    from sentence_transformers import SentenceTransformer

    from tests.test_vl_modes import _mixed
    from titan_contrastive.export import main as export_main

    common = ("--training.steps=2", "--training.dtype=float32", "--checkpoint.enable=true", "--optimizer.lr=1e-2")
    run, first, _ = _mixed(tmp_path, *common)
    run.train()
    run.metrics.close()
    out = tmp_path / "st"
    assert export_main([str(tmp_path / "run-qwen2_vl" / "checkpoint" / "step-2"), "--to", "sentence-transformers",
                        "--out", str(out)]) == 0  # fmt: skip
    batch = run.train_set.__getitems__([0, 1])  # the m2t file's rows
    run.model.eval()
    with torch.no_grad():
        queries = run.model.embed(batch["query"], batch["query_pixel_values"], batch["query_image_grid_thw"], "query")
        documents = run.model.embed(batch["doc"], side="doc")
    rows = [json.loads(line) for line in first.read_text().splitlines()[:2]]
    model = SentenceTransformer(str(out), device="cpu")
    samples = [
        {"image": Image.open(first.parent / r["query_image"]).convert("RGB"), "text": r["query_text"]} for r in rows
    ]
    got_queries = torch.as_tensor(model.encode_query(samples, batch_size=2))
    got_documents = torch.as_tensor(model.encode_document([r["doc_text"] for r in rows], batch_size=2))
    torch.testing.assert_close(got_queries, queries.float(), atol=1e-4, rtol=0)
    torch.testing.assert_close(got_documents, documents.float(), atol=1e-4, rtol=0)
