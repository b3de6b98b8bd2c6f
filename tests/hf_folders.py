"""Tiny random Hugging Face text models saved to folders at test time (nothing downloaded).

`encoder_folder`: a BERT-like encoder ([CLS] text [SEP], [PAD]); `cross_encoder_folder` the same
with a one-logit head over a pair. `decoder_folder`: a Qwen3-like
decoder whose tokenizer appends <|endoftext|> and pads with that same token on the left, as
Qwen3-Embedding's does. `st_folder`: either wrapped as a sentence-transformers folder with its
pooling and prompts. `ARCHITECTURES`: more of what embedders are built on (XLM-R, MPNet, DistilBERT,
DeBERTa-v2, ModernBERT, T5, Llama, Mistral, Qwen2, Gemma 3; the BERT-like model with Dense modules
after its pooling), 2 layers each. One word-level vocabulary, built from the words the tests use (the
decoders of ARCHITECTURES: byte-level BPE learnt from them).
"""

from __future__ import annotations

import random
import re
from pathlib import Path

WORDS = (
    "a an the of to with for and in on who that is by from what query passage represent this find "
    "small animal kept as pet feline domestic cat dog wolf tiger vehicle wheels car bus bicycle frozen "
    "water ice steam snow season after summer autumn winter spring person flies aircraft pilot sailor "
    "driver musical instrument black white keys piano guitar violin instruct retrieve relevant"
).split()


def _tokenizer(
    specials: list[str],
    template: str,
    pad: str,
    eos: str | None,
    side: str,
    pair: str | None = None,
    cls: str = "[CLS]",
    sep: str = "[SEP]",
):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate([*specials, *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace()])
    used = sorted(set(re.findall(r"\[\w+\]|<\|\w+\|>|</?\w+>", template)))
    tok.post_processor = processors.TemplateProcessing(
        single=template, pair=pair, special_tokens=[(t, vocab[t]) for t in used]
    )
    extra = {"eos_token": eos} if eos else {"cls_token": cls, "sep_token": sep}
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token=pad, padding_side=side, model_max_length=64, **extra
    )


def _saved(folder: Path, model, tokenizer) -> Path:
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _bert_tokenizer(pair: str | None = None):
    """[CLS] text [SEP], [PAD] on the right; `pair`: the template of two texts."""
    return _tokenizer(["[PAD]", "[UNK]", "[CLS]", "[SEP]"], "[CLS] $A [SEP]", "[PAD]", None, "right", pair)


def _bert(folder: Path, model_class: str, pair: str | None = None, **config) -> Path:
    """A 2-layer, 16-wide BERT of `model_class` ([CLS] text [SEP]; `pair`: the template of two texts)."""
    import transformers

    tokenizer = _bert_tokenizer(pair)
    shape = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32)
    config = transformers.BertConfig(vocab_size=len(tokenizer), max_position_embeddings=64, **shape, **config)
    return _saved(folder, getattr(transformers, model_class)(config), tokenizer)


def encoder_folder(root: Path, dropout: float = 0.1) -> Path:
    drop = dict(hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    return _bert(root / "tiny-bert", "BertModel", **drop)


def _masked_lm(folder: Path, dropout: float) -> Path:
    """The BERT-like model with its masked-LM head (what SPLADE reads; the tokenizer's vocabulary is its width)."""
    return _bert(folder, "BertForMaskedLM", hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)


def _own_code(folder: Path, dropout: float, decoder: bool = False) -> Path:
    """A model type transformers does not include: its config and model code (tests/fixtures/own_code) ship in
    the folder, named by config.json's `auto_map` as save_pretrained writes it for a registered class; the
    BERT-like tokenizer. `decoder`: a causal one under the `qwen2` model type, whose code ignores `is_causal`."""
    import shutil

    import torch
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    folder.mkdir(parents=True)
    for file in (Path(__file__).parent / "fixtures" / "own_code").glob("*.py"):
        shutil.copyfile(file, folder / file.name)
    names = ("TinyDecoderConfig", "TinyDecoder") if decoder else ("TinyConfig", "TinyModel")
    config_class = get_class_from_dynamic_module(f"configuration_tiny.{names[0]}", str(folder))
    model_class = get_class_from_dynamic_module(f"modeling_tiny.{names[1]}", str(folder))
    config_class.register_for_auto_class()
    model_class.register_for_auto_class("AutoModel")
    tokenizer = _bert_tokenizer()
    torch.manual_seed(0)
    return _saved(folder, model_class(config_class(vocab_size=len(tokenizer), dropout=dropout)), tokenizer)


def cross_encoder_folder(root: Path) -> Path:
    """A BERT-like cross-encoder ([CLS] query [SEP] document [SEP] -> one logit), as sentence-transformers'
    CrossEncoder loads a transformers folder."""
    pair = "[CLS] $A [SEP] $B:1 [SEP]:1"
    return _bert(root / "tiny-cross-encoder", "BertForSequenceClassification", pair, num_labels=1)


def decoder_folder(root: Path, dropout: float = 0.1) -> Path:
    from transformers import Qwen3Config, Qwen3Model

    folder = root / "tiny-qwen3"
    eos = "<|endoftext|>"
    tokenizer = _tokenizer([eos, "[UNK]"], f"$A {eos}", eos, eos, "left")
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=64,
        attention_dropout=dropout,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    Qwen3Model(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def st_folder(model: Path, pooling: str, prompts: dict[str, str], include_prompt: bool = True) -> Path:
    """`model` as a sentence-transformers folder: Transformer (24 tokens), Pooling (`include_prompt`: False leaves
    the prompt out), Normalize, the prompts."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    out = model.parent / f"{model.name}-st{'' if include_prompt else '-no-prompt'}"
    encoder = Transformer(str(model), max_seq_length=24)
    width = encoder.auto_model.config.hidden_size
    modules = [encoder, Pooling(width, pooling_mode=pooling, include_prompt=include_prompt), Normalize()]
    SentenceTransformer(modules=modules, device="cpu", prompts=prompts).save(str(out))
    return out


def vl_folder(root: Path, arch: str = "qwen2_vl", dropout: float = 0.1) -> Path:
    """A tiny random Qwen2-VL, Qwen2.5-VL or Qwen3-VL model (`models.qwen_vl.random_folder`: 2 vision blocks,
    2 decoder layers, 32 wide; Qwen2(.5)-VL: 14-px patches, Qwen3-VL: 16-px; merge 2) with a word-level
    tokenizer of the words above and Qwen's vision tokens, and the image processor, at `root/tiny-{arch}`."""
    from titan_contrastive.models.qwen_vl.random_folder import write_random_folder

    return write_random_folder(root / f"tiny-{arch}", arch, "tiny", dropout, WORDS)


def albert_folder(root: Path) -> Path:
    """A 2-layer ALBERT: one layer group whose weights every layer shares (no list of repeated layers)."""
    from transformers import AlbertConfig, AlbertModel

    tokenizer = _bert_tokenizer()
    shape = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32)
    config = AlbertConfig(vocab_size=len(tokenizer), embedding_size=8, max_position_embeddings=64, **shape)
    return _saved(root / "tiny-albert", AlbertModel(config), tokenizer)


def _roberta_like(folder: Path, name: str, dropout: float) -> Path:
    """XLM-R or MPNet: <s> text </s>, <pad> = 1 (the position ids count from it, as the real ones)."""
    import transformers

    tokenizer = _tokenizer(
        ["<s>", "<pad>", "</s>", "[UNK]"], "<s> $A </s>", "<pad>", None, "right", cls="<s>", sep="</s>"
    )
    ids = dict(pad_token_id=1, bos_token_id=0, eos_token_id=2)
    drop = dict(hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    shape = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32)
    config = getattr(transformers, f"{name}Config")(
        vocab_size=len(tokenizer), max_position_embeddings=66, **ids, **drop, **shape
    )
    return _saved(folder, getattr(transformers, f"{name}Model")(config), tokenizer)


def _distilbert(folder: Path, dropout: float) -> Path:
    from transformers import DistilBertConfig, DistilBertModel

    tokenizer = _bert_tokenizer()
    config = DistilBertConfig(
        vocab_size=len(tokenizer),
        dim=16,
        n_layers=2,
        n_heads=2,
        hidden_dim=32,
        dropout=dropout,
        attention_dropout=dropout,
    )
    return _saved(folder, DistilBertModel(config), tokenizer)


def _deberta(folder: Path, dropout: float) -> Path:
    from transformers import DebertaV2Config, DebertaV2Model

    tokenizer = _bert_tokenizer()
    config = DebertaV2Config(
        vocab_size=len(tokenizer),
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        relative_attention=True,
        position_buckets=8,
        pos_att_type=["p2c", "c2p"],
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
    return _saved(folder, DebertaV2Model(config), tokenizer)


def _modernbert(folder: Path, dropout: float) -> Path:
    from transformers import ModernBertConfig, ModernBertModel

    tokenizer = _bert_tokenizer()
    config = ModernBertConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=64,
        local_attention=8,  # layer 0 global, layer 1 a sliding window of 8
        global_attn_every_n_layers=2,
        pad_token_id=0,
        cls_token_id=2,
        sep_token_id=3,
        bos_token_id=2,
        eos_token_id=3,
        attention_dropout=dropout,
        mlp_dropout=dropout,
        embedding_dropout=dropout,
    )
    return _saved(folder, ModernBertModel(config), tokenizer)


def _t5(folder: Path, dropout: float) -> Path:
    """A whole T5 (encoder and decoder, as t5-base ships); the family trains its encoder (sentence-T5, GTR)."""
    from transformers import T5Config, T5ForConditionalGeneration

    tokenizer = _tokenizer(["<pad>", "</s>", "[UNK]"], "$A </s>", "<pad>", "</s>", "right")
    config = T5Config(
        vocab_size=len(tokenizer),
        d_model=16,
        d_kv=8,
        d_ff=32,
        num_layers=2,
        num_heads=2,
        dropout_rate=dropout,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    return _saved(folder, T5ForConditionalGeneration(config), tokenizer)


def _byte_level_tokenizer():
    """Qwen's kind of tokenizer: byte-level BPE (learnt here from the words above) that appends
    <|endoftext|> and pads with it on the left. transformers loads a qwen2 folder's tokenizer as its own
    Qwen2Tokenizer, which rebuilds a BPE from the file: a word-level one would lose its words there."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    eos = "<|endoftext|>"
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=[eos], initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator([" ".join(WORDS)], trainer)
    tok.post_processor = processors.TemplateProcessing(single=f"$A {eos}", special_tokens=[(eos, tok.token_to_id(eos))])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=eos, pad_token=eos, padding_side="left", model_max_length=64
    )


def _decoder(folder: Path, name: str, dropout: float, **config) -> Path:
    """A Llama, Mistral, Qwen2 or Gemma 3 decoder with Qwen's kind of tokenizer (`_byte_level_tokenizer`); its
    config names no pad token, as theirs do (a pad id would zero that token's embedding at init)."""
    import transformers

    tokenizer = _byte_level_tokenizer()
    shape = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2)
    heads = dict(num_key_value_heads=1, head_dim=8, max_position_embeddings=64)
    built = getattr(transformers, f"{name}Config")(
        vocab_size=len(tokenizer),
        attention_dropout=dropout,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        **shape,
        **heads,
        **config,
    )
    model = getattr(transformers, f"{name}Model")(built)
    return _saved(folder, model, tokenizer)


def _with_dense(folder: Path, dropout: float) -> Path:
    """A sentence-transformers folder of the BERT-like model with two Dense modules after its mean pooling
    (16 -> 12, tanh; 12 -> 8, identity, no bias), as sentence-T5, LaBSE and EmbeddingGemma end."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Dense, Normalize, Pooling, Transformer

    base = encoder_folder(folder.parent / f"{folder.name}-base", dropout)
    torch.manual_seed(0)
    dense = [Dense(16, 12), Dense(12, 8, bias=False, activation_function=torch.nn.Identity())]
    modules = [Transformer(str(base), max_seq_length=24), Pooling(16, pooling_mode="mean"), *dense, Normalize()]
    SentenceTransformer(modules=modules, device="cpu").save(str(folder))
    return folder


ARCHITECTURES = {
    "xlm-roberta": lambda folder, dropout: _roberta_like(folder, "XLMRoberta", dropout),
    "mpnet": lambda folder, dropout: _roberta_like(folder, "MPNet", dropout),
    "distilbert": _distilbert,
    "deberta-v2": _deberta,
    "modernbert": _modernbert,
    "t5": _t5,
    "llama": lambda folder, dropout: _decoder(folder, "Llama", dropout),
    "mistral": lambda folder, dropout: _decoder(folder, "Mistral", dropout, sliding_window=None),
    "qwen2": lambda folder, dropout: _decoder(folder, "Qwen2", dropout),
    "gemma3": lambda folder, dropout: _decoder(folder, "Gemma3Text", dropout, sliding_window=8),
    "bert-dense": _with_dense,
}
"""Builders `(folder, dropout) -> folder` of tiny random models (`architecture_folder` writes them)."""


MASKED_LM = {"bert-mlm": _masked_lm}
"""A builder of a masked LM with its head (the splade pooling reads it)."""
OWN_CODE = {"own-code": _own_code, "own-code-decoder": lambda folder, dropout: _own_code(folder, dropout, True)}
"""Builders of folders that ship their own model code (they load with `[model] trust_remote_code` only)."""


def architecture_folder(root: Path, arch: str, dropout: float = 0.1) -> Path:
    """`ARCHITECTURES[arch]`'s (or `OWN_CODE[arch]`'s, `MASKED_LM[arch]`'s) model at `root / tiny-<arch>`, written on
    first use."""
    folder = root / f"tiny-{arch}"
    return folder if folder.exists() else (ARCHITECTURES | OWN_CODE | MASKED_LM)[arch](folder, dropout)


IMAGE_TEXT = ("clip", "metaclip_2", "siglip", "siglip2")
"""The transformers image-text models `image_text_folder` builds (the hf_clip family)."""
CLASSES = {"clip": "CLIP", "metaclip_2": "MetaClip2", "siglip": "Siglip", "siglip2": "Siglip2"}
CLIP_LIKE = ("clip", "metaclip_2")


def _gemma_like_tokenizer():
    """A BPE tokenizer of the folders' words as Gemma's is built (spaces as "▁", merges across them), EOS
    after the text, padding on the left: what transformers' `Siglip2Tokenizer` rebuilds from its vocabulary
    and merges (adding its lowercasing)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "[UNK]", "<s>", "</s>"]
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.Fuse()])
    g = random.Random(0)
    text = [" ".join(g.choices(WORDS, k=8)) for _ in range(200)]
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=1000, special_tokens=specials))
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 3)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="</s>", eos_token="</s>", padding_side="left"
    )


def _sentencepiece_tokenizer(root: Path):
    """transformers' `SiglipTokenizer` (Python, lowercasing, punctuation removed) over a unigram SentencePiece model of
    the folders' words, trained here: a SigLIP folder as the Hub has them, `spiece.model` and no tokenizer.json."""
    import io

    import sentencepiece as spm
    from transformers import SiglipTokenizer

    g = random.Random(0)
    text = [" ".join(g.choices(WORDS, k=8)) for _ in range(300)]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(text),
        model_writer=model,
        vocab_size=90,
        model_type="unigram",
        pad_id=0,
        eos_id=1,
        unk_id=2,
        bos_id=-1,
        pad_piece="<pad>",
        eos_piece="</s>",
        unk_piece="<unk>",
        minloglevel=2,
    )
    root.mkdir(parents=True, exist_ok=True)
    (root / "spiece.model").write_bytes(model.getvalue())
    return SiglipTokenizer(vocab_file=str(root / "spiece.model"))


def image_text_folder(root: Path, kind: str = "clip", dropout: float = 0.1) -> Path:
    """A 2-layer, 16-wide CLIP, MetaCLIP 2, SigLIP or SigLIP 2 with its tokenizer and image processor: 16 px
    images in 8 px patches; 12 tokens, the CLIP tokenizer's BOS text EOS padded with EOS (MetaCLIP 2's with
    XLM-R's ids, padded with its pad token, EOS id 2), SigLIP's text EOS padded with EOS (as theirs are: no
    attention mask, CLIP pools at the first EOS, SigLIP at the last position; SigLIP's tokenizer is transformers'
    own over a SentencePiece model, `_sentencepiece_tokenizer`). SigLIP 2
    has a BPE tokenizer padding on the left (`_gemma_like_tokenizer`), has a 2 x 2 grid of positions and a processor of
    `max_num_patches = 6`: a square picture becomes 2 x 2 patches and 2 padding rows."""
    import torch
    import transformers

    folder = root / f"tiny-{kind}"
    if folder.exists():
        return folder
    template = "<s> $A </s>" if kind in CLIP_LIKE else "$A </s>"
    if kind == "siglip2":
        tokenizer = _gemma_like_tokenizer()
    elif kind == "siglip":
        tokenizer = _sentencepiece_tokenizer(root / "sentencepiece")
    elif kind == "metaclip_2":  # XLM-R's ids: <s> 0, <pad> 1, </s> 2
        tokenizer = _tokenizer(["<s>", "<pad>", "</s>", "[UNK]"], template, "<pad>", "</s>", "right")
    else:
        tokenizer = _tokenizer(["<pad>", "[UNK]", "<s>", "</s>"], template, "</s>", "</s>", "right")
    if kind in CLIP_LIKE:
        tokenizer.bos_token = "<s>"
    shape = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2)
    name = CLASSES[kind]
    text = getattr(transformers, f"{name}TextConfig")(
        vocab_size=len(tokenizer),
        max_position_embeddings=12,
        attention_dropout=dropout,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **shape,
        **({"bos_token_id": tokenizer.convert_tokens_to_ids("<s>")} if kind in CLIP_LIKE else {}),
    )
    size = {"num_patches": 4} if kind == "siglip2" else {"image_size": 16}
    vision = getattr(transformers, f"{name}VisionConfig")(patch_size=8, attention_dropout=dropout, **size, **shape)
    config = getattr(transformers, f"{name}Config")(
        text_config=text, vision_config=vision, **({"projection_dim": 8} if kind in CLIP_LIKE else {})
    )
    model = getattr(transformers, f"{name}Model")(config)
    if kind not in CLIP_LIKE:
        with torch.no_grad():
            model.logit_scale.fill_(2.3)
            model.logit_bias.fill_(-3.0)
    _saved(folder, model, tokenizer)
    processor = getattr(transformers, f"{'CLIP' if kind in CLIP_LIKE else name}ImageProcessorPil")
    if kind in CLIP_LIKE:
        images = processor(
            size={"shortest_edge": 16},
            crop_size={"height": 16, "width": 16},
            image_mean=[0.48, 0.46, 0.41],
            image_std=[0.27, 0.26, 0.28],
        )
    elif kind == "siglip":
        images = processor(size={"height": 16, "width": 16}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    else:
        images = processor(patch_size=8, max_num_patches=6, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    images.save_pretrained(folder)
    return folder
