"""The qwen_vl family's templates and chat templates, both ways.

- `chat_template`: the run's query and document templates as a Jinja chat template, for the sentence-transformers
  folder a run exports (`st_folder.py`): a message's image and text written into the task's template (without a
  task, the template that reads the message's kinds).
- `folder_templates`: a sentence-transformers folder given as `[model] path` read the other way: its chat template,
  with its prompts as system messages, rendered for each side as sentence-transformers renders that side's inputs,
  becomes the side's template (`[model] query_prompt` / `doc_prompt` = "auto"), so training reads the inputs as
  the folder's model was trained to (Qwen3-VL-Embedding's or GME's chat format, or a folder written here).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from titan_contrastive.config import ConfigError
from titan_contrastive.models.bi_encoder.folder import TextFolder, folder_json, load_config, load_tokenizer
from titan_contrastive.models.qwen_vl.processor import IMAGE, VISION

__all__ = ["chat_template", "folder_templates", "processor_template"]

_SLOT = "TITANTEXTSLOT"
"""The text of a side's sample while a folder's chat template renders it (`folder_templates`), then `{text}`."""

_TEMPLATE = """\
{%- set ns = namespace(text="", images=0) -%}
{%- for message in messages -%}
{%- if message.role != "user" -%}
{{- raise_exception("the query and document templates are its prompts; give no " + message.role + " message") -}}
{%- elif message.content is string -%}
{%- set ns.text = ns.text + message.content -%}
{%- else -%}
{%- for item in message.content -%}
{%- if item.type == "image" -%}
{%- set ns.images = ns.images + 1 -%}
{%- elif item.type == "text" -%}
{%- set ns.text = ns.text + item.text -%}
{%- else -%}
{{- raise_exception("this model reads a text, an image or both, not " + item.type) -}}
{%- endif -%}
{%- endfor -%}
{%- endif -%}
{%- endfor -%}
{%- set want = [ns.images > 0, ns.text != ""] -%}
{%- if task is defined and task == "query" -%}
{%- set sides = [QUERY] -%}
{%- elif task is defined and task == "document" -%}
{%- set sides = [DOCUMENT] -%}
{%- else -%}
{%- set sides = [DOCUMENT, QUERY] -%}
{%- endif -%}
{%- set found = namespace(template=none) -%}
{%- for exact in [true, false] -%}
{%- for side in sides -%}
{%- for each in side -%}
{%- if found.template is none and each[1] == want[0] and (not exact or each[2] == want[1]) -%}
{%- set found.template = each[0] -%}
{%- endif -%}
{%- endfor -%}
{%- endfor -%}
{%- endfor -%}
{%- if ns.images > 1 -%}
{{- raise_exception("one image per input, as in training") -}}
{%- elif found.template is none -%}
{%- set named = sides[-1] | map(attribute=0) | join(" or ") -%}
{{- raise_exception("the template " + named + " takes " + ("an image" if ns.images == 0 else "no image")) -}}
{%- endif -%}
{%- set template = found.template -%}
{{- template.replace("{image}", VISION).replace("{text}", ns.text) -}}
"""


def chat_template(query: str | Sequence[str], document: str | Sequence[str]) -> str:
    """The Jinja chat template rendering a message as the run's `query` or `document` template (one per kind of
    side the run trained: several with `[data] retrieval_modes`): its image as
    `<|vision_start|><|image_pad|><|vision_end|>` (the processor repeats the pad per visual token), its text in
    place of `{text}`. A side's template is the one that reads the message's kinds (an image, a text), else the one
    that reads an image where the message has one; without a task the document's first, then the query's."""

    def kinds(templates: str | Sequence[str]) -> list[tuple[str, bool, bool]]:
        return [(t, IMAGE in t, "{text}" in t) for t in ([templates] if isinstance(templates, str) else templates)]

    literal = {"QUERY": kinds(query), "DOCUMENT": kinds(document), "VISION": VISION}
    out = _TEMPLATE
    for name, value in literal.items():  # a JSON string is a Jinja string literal (non-ASCII kept as it is)
        out = out.replace(name, json.dumps(value, ensure_ascii=False))
    return out


def processor_template(folder: Path) -> str:
    """The chat template the folder's processor renders with (sentence-transformers' for a Qwen-VL model):
    chat_template.jinja, else chat_template.json's (which the tokenizer alone does not read); "" for neither."""
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    if (folder / "chat_template.json").is_file():
        return str(folder_json(folder / "chat_template.json").get("chat_template") or "")
    return ""


def folder_templates(folder: TextFolder, kinds: tuple[str, str]) -> dict[str, str]:
    """The query's and the document's template (`kinds`: each side's text, image or multi) as sentence-transformers
    renders the sentence-transformers `folder`'s inputs: its chat template over the message of a sample (the image
    first), its `query` / `document` prompt a system message before it, the task and the folder's chat-template
    options passed; the image's `<|vision_start|><|image_pad|><|vision_end|>` becomes `{image}`, the text `{text}`.
    {} for a folder that is not a sentence-transformers one or has no chat template (the family's defaults)."""
    if not folder.sentence_transformers:
        return {}
    tokenizer = load_tokenizer(folder.model_dir)
    tokenizer.chat_template = processor_template(Path(folder.model_dir)) or tokenizer.chat_template
    if not tokenizer.chat_template:
        return {}
    from sentence_transformers.base.modality import InputFormatter

    bert = Path(folder.model_dir) / "sentence_bert_config.json"
    settings = folder_json(bert) if bert.is_file() else {}
    message = (settings.get("modality_config") or {}).get("message") or {}
    formatter = InputFormatter(load_config(folder.model_dir).model_type, message.get("format", "auto"), tokenizer)
    options = (settings.get("processing_kwargs") or {}).get("chat_template") or {}
    templates = {}
    for side, kind, prompt, task in zip(
        ("query", "doc"), kinds, (folder.query_prompt, folder.doc_prompt), ("query", "document"), strict=True
    ):
        typed = {**({"image": None} if kind != "text" else {}), **({"text": _SLOT} if kind != "image" else {})}
        messages = formatter.to_message(typed)
        if prompt:
            (messages,) = formatter.prepend_prompt_to_messages([messages], prompt)
        try:
            rendered = tokenizer.apply_chat_template(messages, tokenize=False, **{"task": task, **options})
        except Exception as e:  # noqa: BLE001 - jinja2's TemplateError, or what the folder's template raises
            raise ConfigError(
                f"{folder.model_dir}: its chat template refuses a {side} sample ({kind}) of "
                f"data.retrieval_mode: {' '.join(str(e).split())[:160]}; set model.{side}_prompt to the template"
            ) from None
        want = {VISION: int(kind != "text"), _SLOT: int(kind != "image")}
        if any(rendered.count(part) != count for part, count in want.items()) or IMAGE in rendered:
            raise ConfigError(
                f"{folder.model_dir}: its chat template renders a {side} sample ({kind}) as {rendered[:160]!r}, "
                f"without {VISION!r} for the image and the text once each; set model.{side}_prompt to the template"
            )
        templates[side] = rendered.replace(VISION, IMAGE).replace(_SLOT, "{text}")
    return templates
