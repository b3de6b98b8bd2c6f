"""Random-init Qwen-VL folders of a given size, for tests and benchmarks (nothing downloaded): the
model's config and weights, a word-level tokenizer holding Qwen's vision tokens, and the image
processor (PIL backend). `tiny`: 2 vision blocks, 2 decoder layers, 32 wide (tests, float64);
`small`: 4 and 4, 128 wide (CPU benchmarks); `2b`: Qwen2-VL-2B's dimensions (GPU benchmarks; its
151,936-entry embedding too, whatever the tokenizer's size)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

__all__ = ["SIZES", "VL_SPECIALS", "write_random_folder"]

VL_SPECIALS = ["<|endoftext|>", "[UNK]", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# text: hidden, layers, heads, kv heads, intermediate; vision: depth, width, heads; vocabulary (0: the tokenizer's)
SIZES = {
    "tiny": dict(hidden=32, layers=2, heads=4, kv=2, inter=64, depth=2, width=32, vheads=4, vocab=0),
    "small": dict(hidden=128, layers=4, heads=4, kv=2, inter=256, depth=4, width=128, vheads=4, vocab=0),
    "base": dict(hidden=384, layers=6, heads=6, kv=2, inter=1024, depth=6, width=384, vheads=6, vocab=0),
    "2b": dict(hidden=1536, layers=28, heads=12, kv=2, inter=8960, depth=32, width=1280, vheads=16, vocab=151936),
}


def _tokenizer(words: Sequence[str]):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate([*VL_SPECIALS[:2], *dict.fromkeys(words)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    eos = VL_SPECIALS[0]
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token=eos, eos_token=eos, padding_side="right"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": VL_SPECIALS[2:]})
    return tokenizer


def write_random_folder(
    folder: Path, arch: str = "qwen2_vl", size: str = "tiny", dropout: float = 0.0, words: Sequence[str] = ()
) -> Path:
    """A random `arch` (qwen2_vl, qwen2_5_vl or qwen3_vl) model of `size` saved to `folder` with its tokenizer
    (`words` and Qwen's special tokens) and image processor; the model's seed is torch's."""
    import transformers
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    s = SIZES[size]
    tokenizer = _tokenizer(words)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VL_SPECIALS}
    eos = ids[VL_SPECIALS[0]]
    text = dict(
        vocab_size=s["vocab"] or len(tokenizer),
        hidden_size=s["hidden"],
        intermediate_size=s["inter"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv"],
        max_position_embeddings=32768,
        attention_dropout=dropout,
        pad_token_id=eos,
        eos_token_id=eos,
        bos_token_id=None,
    )
    head = s["hidden"] // s["heads"]
    section = [head // 4, head // 8, head // 8]  # M-RoPE: temporal, height, width halves of the rotary dims
    tokens = dict(
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    mrope_text = {**text, "rope_scaling": {"type": "mrope", "mrope_section": section}}  # Qwen2-VL and Qwen2.5-VL
    if arch == "qwen2_vl":
        patch = 14
        config = transformers.Qwen2VLConfig(
            text_config=mrope_text,
            vision_config=dict(
                depth=s["depth"],
                embed_dim=s["width"],
                hidden_size=s["hidden"],
                num_heads=s["vheads"],
                mlp_ratio=4 if size == "2b" else 2,
                patch_size=patch,
            ),
            **tokens,
        )
        model = transformers.Qwen2VLModel(config)
    elif arch == "qwen2_5_vl":
        patch = 14
        config = transformers.Qwen2_5_VLConfig(
            text_config=mrope_text,
            vision_config=dict(
                depth=s["depth"],
                hidden_size=s["width"],
                intermediate_size=2 * s["width"],
                num_heads=s["vheads"],
                out_hidden_size=s["hidden"],
                patch_size=patch,
                window_size=2 * patch * 2,  # windows of 2 x 2 merged patches: windowed and full attention both run
                fullatt_block_indexes=[s["depth"] - 1],
            ),
            **tokens,
        )
        model = transformers.Qwen2_5_VLModel(config)
    elif arch == "qwen3_vl":
        patch = 16
        config = transformers.Qwen3VLConfig(
            text_config={
                **text,
                "head_dim": head,
                "rope_scaling": {"rope_type": "default", "mrope_section": section, "mrope_interleaved": True},
            },
            vision_config=dict(
                depth=s["depth"],
                hidden_size=s["width"],
                intermediate_size=2 * s["width"],
                num_heads=s["vheads"],
                out_hidden_size=s["hidden"],
                patch_size=patch,
                num_position_embeddings=64,
                deepstack_visual_indexes=[s["depth"] // 2],
            ),
            **tokens,
        )
        model = transformers.Qwen3VLModel(config)
    else:
        raise ValueError(f"arch={arch!r}: qwen2_vl, qwen2_5_vl or qwen3_vl")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    merge = 2
    Qwen2VLImageProcessorPil(
        patch_size=patch, merge_size=merge, min_pixels=(patch * merge) ** 2, max_pixels=(patch * merge) ** 2 * 1024
    ).save_pretrained(folder)
    return folder
