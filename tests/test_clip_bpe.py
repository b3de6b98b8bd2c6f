"""ClipBpeTokenizer: token ids identical to open_clip's reference SimpleTokenizer, vocabulary, pickling, decode."""

from __future__ import annotations

import importlib.util
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from titan_contrastive.datasets import emoji
from titan_contrastive.datasets.clip_bpe import ClipBpeTokenizer, build_tokenizer
from titan_contrastive.datasets.fashion_mnist import CLASS_NAMES, TEMPLATES

LONG = "a very long caption of a black and white photo, " * 12  # ~130 tokens: cut at 77

# Not in this list, because open_clip's cleaning (ftfy.fix_text) or regex quirks change them and
# ClipBpeTokenizer deliberately does not (see its module docstring): mojibake ("cafÃ©"), control and
# format characters (non-whitespace U+0000-001F, U+007F-009F, U+FEFF, U+FFF9-FFFC: ftfy drops or remaps them),
# U+0345 (open_clip's case-insensitive regex drops it), letters of recent Unicode versions (the `regex`
# module and the Rust Oniguruma regex disagree on their \p{L}), and the literal "<start_of_text>" /
# "<end_of_text>" (special tokens inside a text for open_clip only). A sweep over every character
# assigned in Unicode 14 found no other difference.
HANDWRITTEN = [
    "",
    " ",
    "   \t\n  ",
    "a",
    "A",
    "!",
    "!!!",
    "...",
    "?!",
    "#hashtag @user",
    "(parenthesised) [bracketed] {braced}",
    "hello, world!",
    "Hello,World!",
    "semi;colon: dash - em—dash",
    "quote \"double\" 'single'",
    "$5.99 & 100%",
    "don't",
    "it's",
    "DON'T IT'S",
    "we're they've I'm you'll he'd",
    "rock 'n' roll",
    "o'clock",
    "'s 't 're",
    "0",
    "42",
    "3.14159",
    "2024-01-31",
    "1,000,000",
    "x2 4k 1080p",
    "route 66",
    "mp3 h2o",
    "Mixed CaSe WoRdS",
    "ALL CAPS CAPTION",
    "CamelCaseWord",
    "snake_case_word",
    "kebab-case-word",
    "  leading spaces",
    "trailing spaces   ",
    "multiple   inner    spaces",
    "tab\tand\nnewline",
    "nbsp\u00a0space",
    "café crème brûlée",
    "naïve façade",
    "Ünïcödé Ärger Öl",
    "straße über größe",
    "mañana señor",
    "ΟΔΟΣ σας λόγος",
    "Привет мир",
    "东京塔 北京",
    "日本語のテキスト",
    "한국어 텍스트",
    "مرحبا بالعالم",
    "नमस्ते दुनिया",
    "e\u0301 decomposed",
    "I ❤️ pizza 🍕",
    "😀",
    "👍🏽 thumbs up",
    "👨‍👩‍👧 family",
    "🇫🇷 flag",
    "★ ☆ ♥ ♦ → ←",
    "© ® ™ °C ±",
    "don’t “curly” ‘quotes’",
    "ﬁne ﬂour",
    "ＦＵＬＬ　ｗｉｄｔｈ，！",
    "&amp; &lt;3 &quot;html&quot;",
    "&amp;amp; twice",
    "a photo of a t-shirt/top.",
    "http://example.com/path?q=1",
    "email@example.com",
    "C++ and C#",
    "<|startoftext|>",
    LONG,
    LONG.upper(),
]


def varied_texts() -> list[str]:
    captions = [template.format(name) for name in CLASS_NAMES for template in TEMPLATES]
    names = np.load(emoji.BUNDLE_FILE, allow_pickle=False)["names"].tolist()
    return captions + names[::10] + HANDWRITTEN


@pytest.fixture(scope="module")
def reference():
    """open_clip's SimpleTokenizer, loaded from its file: `import open_clip` also imports torchvision."""
    spec = importlib.util.find_spec("open_clip")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("open_clip is not installed: no reference tokenizer")
    path = Path(next(iter(spec.submodule_search_locations))) / "tokenizer.py"
    if not path.is_file():
        pytest.skip(f"{path} not found: no reference tokenizer")
    for module in ("ftfy", "regex"):
        pytest.importorskip(module, reason=f"open_clip's tokenizer.py needs {module}")
    saved = os.environ.get("TOKENIZERS_PARALLELISM")  # tokenizer.py sets it to "false" on import
    module_spec = importlib.util.spec_from_file_location("_open_clip_tokenizer", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    if saved is None:
        os.environ.pop("TOKENIZERS_PARALLELISM", None)
    else:
        os.environ["TOKENIZERS_PARALLELISM"] = saved
    return module.SimpleTokenizer()


@pytest.mark.parametrize("context_length", [77, 16])
def test_ids_match_open_clip(reference, context_length):
    texts = varied_texts()
    assert len(texts) >= 300
    ours = ClipBpeTokenizer(context_length).encode(texts)
    expected = reference(texts, context_length)
    assert ours.dtype == torch.int64 and ours.shape == (len(texts), context_length)
    mismatched = [text for text, a, b in zip(texts, ours, expected) if not torch.equal(a, b)]
    assert not mismatched, f"{len(mismatched)} texts tokenized differently, e.g. {mismatched[:5]}"
    long_row = ours[texts.index(LONG)]
    assert long_row[-1] == ClipBpeTokenizer.EOS and (long_row != ClipBpeTokenizer.PAD).all()
    assert torch.equal(ours.argmax(-1), (ours == ClipBpeTokenizer.EOS).int().argmax(-1))  # EOS is the row max


def test_vocabulary(reference):
    tok = ClipBpeTokenizer()
    assert tok.vocab_size == 49408 == build_tokenizer().get_vocab_size() == reference.vocab_size
    assert (tok.BOS, tok.EOS) == (reference.sot_token_id, reference.eot_token_id) == (49406, 49407)
    ours = {token: i for token, i in build_tokenizer().get_vocab().items() if i < tok.BOS}
    assert ours == {token: i for token, i in reference.encoder.items() if i < tok.BOS}
    ids = tok.encode(varied_texts())
    assert int(ids.min()) >= 0 and int(ids.max()) < tok.vocab_size


def test_str_and_short_context_rejected():
    with pytest.raises(TypeError):
        ClipBpeTokenizer().encode("a photo of a dress")
    with pytest.raises(ValueError):
        ClipBpeTokenizer(context_length=1)
    ids = ClipBpeTokenizer(context_length=2).encode(["a dress", ""])
    assert ids.tolist() == [[ClipBpeTokenizer.BOS, ClipBpeTokenizer.EOS]] * 2


def test_pickle_round_trip():
    tok = ClipBpeTokenizer(context_length=24)
    texts = ["a photo of a sneaker.", "grinning face", ""]
    expected = tok.encode(texts)
    blob = pickle.dumps(tok)
    assert len(blob) < 200  # only context_length travels to DataLoader workers, not the 49k vocabulary
    build_tokenizer.cache_clear()  # as in a fresh worker process: rebuilt on first use
    copy = pickle.loads(blob)
    assert copy.context_length == 24 and torch.equal(copy.encode(texts), expected)


def test_decode_round_trip():
    tok = ClipBpeTokenizer()
    texts = ["a photo of a dress", "grinning face with smiling eyes", "  Two   Words  ", "café crème", ""]
    assert tok.decode(tok.encode(texts)) == [" ".join(t.split()).lower() for t in texts]
    assert tok.decode(tok.encode(["hello, world!"])) == ["hello , world !"]
    cut = ClipBpeTokenizer(context_length=6).encode(["one two three four five six"])
    assert tok.decode(cut) == ["one two three four"]
