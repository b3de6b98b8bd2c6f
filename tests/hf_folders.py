"""Tiny random Hugging Face text models saved to folders at test time (nothing downloaded).

`encoder_folder`: a BERT-like encoder ([CLS] text [SEP], [PAD]). `decoder_folder`: a Qwen3-like
decoder whose tokenizer appends <|endoftext|> and pads with that same token on the left, as
Qwen3-Embedding's does. `st_folder`: either wrapped as a sentence-transformers folder with its
pooling and prompts. One word-level vocabulary, built from the words the tests use.
"""

from __future__ import annotations

import re
from pathlib import Path

WORDS = (
    "a an the of to with for and in on who that is by from what query passage represent this find "
    "small animal kept as pet feline domestic cat dog wolf tiger vehicle wheels car bus bicycle frozen "
    "water ice steam snow season after summer autumn winter spring person flies aircraft pilot sailor "
    "driver musical instrument black white keys piano guitar violin instruct retrieve relevant"
).split()


def _tokenizer(specials: list[str], template: str, pad: str, eos: str | None, side: str):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate([*specials, *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace()])
    used = sorted(set(re.findall(r"\[\w+\]|<\|\w+\|>", template)))
    tok.post_processor = processors.TemplateProcessing(single=template, special_tokens=[(t, vocab[t]) for t in used])
    extra = {"eos_token": eos} if eos else {"cls_token": "[CLS]", "sep_token": "[SEP]"}
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token=pad, padding_side=side, model_max_length=64, **extra
    )


def encoder_folder(root: Path, dropout: float = 0.1) -> Path:
    from transformers import BertConfig, BertModel

    folder = root / "tiny-bert"
    tokenizer = _tokenizer(["[PAD]", "[UNK]", "[CLS]", "[SEP]"], "[CLS] $A [SEP]", "[PAD]", None, "right")
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=64,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
    BertModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


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


def st_folder(model: Path, pooling: str, prompts: dict[str, str]) -> Path:
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    out = model.parent / f"{model.name}-st"
    encoder = Transformer(str(model), max_seq_length=24)
    width = encoder.auto_model.config.hidden_size
    modules = [encoder, Pooling(width, pooling_mode=pooling), Normalize()]
    SentenceTransformer(modules=modules, device="cpu", prompts=prompts).save(str(out))
    return out


VL_SPECIALS = ["<|endoftext|>", "[UNK]", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def vl_folder(root: Path, arch: str = "qwen2_vl", dropout: float = 0.1) -> Path:
    """A tiny random Qwen2-VL or Qwen3-VL model (2 vision blocks, 2 decoder layers, 32 wide) with a
    word-level tokenizer holding Qwen's vision tokens and the image processor (PIL backend; Qwen2-VL:
    14-px patches, Qwen3-VL: 16-px; merge 2), saved to `root/tiny-{arch}`."""
    import transformers
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    folder = root / f"tiny-{arch}"
    eos = VL_SPECIALS[0]
    tokenizer = _tokenizer(VL_SPECIALS[:2], "$A", eos, eos, "right")
    tokenizer.add_special_tokens({"additional_special_tokens": VL_SPECIALS[2:]})
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VL_SPECIALS}
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        attention_dropout=dropout,
        pad_token_id=ids[eos],
        eos_token_id=ids[eos],
        bos_token_id=None,
    )
    tokens = dict(
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    if arch == "qwen2_vl":
        patch = 14
        config = transformers.Qwen2VLConfig(
            text_config={**text, "rope_scaling": {"type": "mrope", "mrope_section": [2, 1, 1]}},
            vision_config=dict(depth=2, embed_dim=32, hidden_size=32, num_heads=4, mlp_ratio=2, patch_size=patch),
            **tokens,
        )
        model = transformers.Qwen2VLModel(config)
    else:
        patch = 16
        config = transformers.Qwen3VLConfig(
            text_config={
                **text,
                "head_dim": 8,
                "rope_scaling": {"rope_type": "default", "mrope_section": [2, 1, 1], "mrope_interleaved": True},
            },
            vision_config=dict(
                depth=2,
                hidden_size=32,
                intermediate_size=64,
                num_heads=4,
                out_hidden_size=32,
                patch_size=patch,
                num_position_embeddings=64,
                deepstack_visual_indexes=[1],
            ),
            **tokens,
        )
        model = transformers.Qwen3VLModel(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    merge = 2
    Qwen2VLImageProcessorPil(
        patch_size=patch, merge_size=merge, min_pixels=(patch * merge) ** 2, max_pixels=(patch * merge) ** 2 * 16
    ).save_pretrained(folder)
    return folder
