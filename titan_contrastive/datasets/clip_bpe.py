"""OpenAI CLIP's own byte-level BPE tokenizer (49,408 tokens), from the vocabulary shipped in the package.

A CLIP text tower pretrained by OpenAI or open_clip reads these ids; any other tokenizer would feed
it meaningless tokens. The merges file is `titan_contrastive/assets/clip_bpe/bpe_simple_vocab_16e6.txt.gz`
(MIT, openai/CLIP), so nothing is downloaded. The tokenizer is built with the Hugging Face
`tokenizers` library, whose Rust BPE is far faster than the Python merge loop of openai/CLIP's
`simple_tokenizer.py`; the pipeline follows transformers' `CLIPConverter`.

`encode` gives exactly what open_clip's `SimpleTokenizer()(texts, context_length)` gives (sot, BPE
tokens, eot, then 0-padding; a long text is cut to `context_length` with eot last). open_clip first
cleans a text with `ftfy.fix_text` and `html.unescape` twice; here the same `html.unescape` runs, and
of ftfy (not a run-time dependency) only its character fixes, as one `str.translate`: curly quotes
made straight, full-width forms and Latin ligatures expanded. ftfy's mojibake repair and removal of
control characters are not done, so such text can differ. The literal strings `<start_of_text>` /
`<end_of_text>` in a text are special tokens for open_clip, plain text here. The text model pools
at the eot position, the highest id in the row (`ids.argmax(-1)`), as CLIP does.
"""

from __future__ import annotations

import gzip
import html
import unicodedata
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

VOCAB_FILE = Path(__file__).resolve().parent.parent / "assets" / "clip_bpe" / "bpe_simple_vocab_16e6.txt.gz"
# openai/CLIP's word split: contractions, letter runs, single digits, runs of other non-space chars
_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map of the 256 bytes to printable characters (openai/CLIP's order)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = bs[:], 0  # the 188 printable bytes map to themselves, the others to chr(256), chr(257), ...
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def _ftfy_table() -> dict[int, str]:
    """`str.translate` table of ftfy.fix_text's fixes for ligatures, character width and curly quotes."""
    chars = (0x132, 0x133, *range(0x1C4, 0x1CD), *range(0x1F1, 0x1F4), *range(0xFB00, 0xFB07), *range(0xFF01, 0xFFF0))
    table = {c: unicodedata.normalize("NFKC", chr(c)) for c in chars}
    table = {c: s for c, s in table.items() if s != chr(c)}
    table.update({0x149: "'n", 0xFB05: "\u017ft", 0x3000: " ", 0x2BC: "'"})  # ŉ, ﬅ -> ſt, ideographic space
    table.update({**dict.fromkeys(range(0x2018, 0x201C), "'"), **dict.fromkeys(range(0x201C, 0x2020), '"')})
    return table


_FTFY = _ftfy_table()


def vocab_and_merges() -> tuple[list[str], list[tuple[str, str]]]:
    """CLIP's 49,408 tokens in id order and its 48,894 merges, from the shipped file (openai/CLIP's
    construction: the 256 byte characters, the same with '</w>', one token per merge, 2 specials)."""
    with gzip.open(VOCAB_FILE, "rt", encoding="utf-8") as file:
        lines = file.read().split("\n")
    merges = [tuple(line.split()) for line in lines[1 : 49152 - 256 - 2 + 1]]
    vocab = list(bytes_to_unicode().values())
    vocab += [v + "</w>" for v in vocab] + ["".join(m) for m in merges] + ["<|startoftext|>", "<|endoftext|>"]
    return vocab, merges  # type: ignore[return-value]


@lru_cache(maxsize=1)
def build_tokenizer() -> Tokenizer:
    """The `tokenizers.Tokenizer`, built once per process (DataLoader workers each build their own)."""
    vocab, merges = vocab_and_merges()
    bpe = models.BPE(
        {token: i for i, token in enumerate(vocab)}, merges,
        continuing_subword_prefix="", end_of_word_suffix="</w>", unk_token=None, fuse_unk=False,
    )  # fmt: skip
    tok = Tokenizer(bpe)
    tok.normalizer = normalizers.Sequence(
        [normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Lowercase()]
    )
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT), behavior="removed", invert=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    # "</w>" -> the byte-level space "Ġ" first: ByteLevel leaves a token holding any other character undecoded
    tok.decoder = decoders.Sequence([decoders.Replace("</w>", bytes_to_unicode()[32]), decoders.ByteLevel()])
    return tok


class ClipBpeTokenizer:
    """`encode` -> [B, context_length] int64: BOS, CLIP BPE tokens, EOS, PAD... (open_clip's layout)."""

    PAD = 0  # as in CLIP: id 0 is also the token "!", but only pads follow EOS
    BOS = 49406  # <|startoftext|>
    EOS = 49407  # <|endoftext|>
    vocab_size = 49408

    def __init__(self, context_length: int = 77) -> None:
        if context_length < 2:
            raise ValueError(f"context_length={context_length}: too short for BOS and EOS; use 2 or more")
        self.context_length = context_length  # the only state: pickles small, workers rebuild the cached tokenizer

    def encode(self, texts: list[str]) -> torch.Tensor:
        """Token ids [len(texts), context_length]. A text of more than context_length - 2 tokens
        keeps its first context_length - 2, so that EOS stays the last non-pad token."""
        if isinstance(texts, str):
            raise TypeError("ClipBpeTokenizer.encode takes a list of strings, not a single string")
        # open_clip's cleaning; lower() here too because Rust's per-character Lowercase misses the Greek final sigma
        cleaned = [html.unescape(html.unescape(t)).translate(_FTFY).lower() for t in texts]
        encodings = build_tokenizer().encode_batch(cleaned, add_special_tokens=False)
        ids = np.full((len(texts), self.context_length), self.PAD, dtype=np.int64)
        ids[:, 0] = self.BOS
        for row, enc in enumerate(encodings):
            tokens = enc.ids[: self.context_length - 2]
            ids[row, 1 : 1 + len(tokens)] = tokens
            ids[row, 1 + len(tokens)] = self.EOS
        return torch.from_numpy(ids)

    def decode(self, ids: torch.Tensor) -> list[str]:
        """The text between BOS and the first EOS: lower-cased, words (and punctuation runs) separated by spaces."""
        rows = []
        for row in ids.tolist():
            start = 1 if row and row[0] == self.BOS else 0
            end = row.index(self.EOS) if self.EOS in row else len(row)
            rows.append(row[start:end])
        return [text.rstrip(" ") for text in build_tokenizer().decode_batch(rows, skip_special_tokens=False)]
