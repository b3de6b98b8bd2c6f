"""`python -m titan_contrastive.export SRC --to hf --out DIR`: a clip checkpoint as a Hugging Face CLIP folder.

SRC is anything `[model] init_from` reads (`interop.detect_format`): one of our step-N folders
(FSDP shards are consolidated by DCP on load) or a Hugging Face CLIP folder. DIR receives what
`transformers.CLIPModel.from_pretrained(DIR)` and `CLIPTokenizerFast.from_pretrained(DIR)` load:
`config.json`, `model.safetensors` and CLIP's BPE tokenizer files (built by transformers from the
vocabulary this package ships). The folder is written under a temporary name and renamed when
complete. Needs transformers (`pip install -e '.[hf]'`).

Why through transformers' own `CLIPModel`: the weights are loaded into it strictly before they
are saved, so a folder this writes is one transformers has already accepted.
"""

from __future__ import annotations

import argparse
import gzip
import inspect
import json
import shutil
import sys
import tempfile
from pathlib import Path

FORMATS = ("hf",)


def write_hf_tokenizer(out: Path, context_length: int) -> None:
    """CLIP's BPE as transformers' CLIPTokenizerFast files (vocab.json + merges.txt -> its converter)."""
    from transformers import CLIPTokenizerFast

    from titan_contrastive.datasets.clip_bpe import VOCAB_FILE, bytes_to_unicode

    lines = gzip.decompress(VOCAB_FILE.read_bytes()).decode("utf-8").split("\n")
    merges = lines[1 : 49152 - 256 - 2 + 1]
    vocab = list(bytes_to_unicode().values())
    vocab += [v + "</w>" for v in vocab] + ["".join(m.split()) for m in merges] + ["<|startoftext|>", "<|endoftext|>"]
    ids = {t: i for i, t in enumerate(vocab)}
    if "vocab" in inspect.signature(CLIPTokenizerFast.__init__).parameters:  # transformers >= 5 takes them directly
        CLIPTokenizerFast(vocab=ids, merges=[tuple(m.split()) for m in merges], model_max_length=context_length).save_pretrained(str(out))
        return
    with tempfile.TemporaryDirectory() as tmp:  # transformers 4 reads files
        (Path(tmp) / "vocab.json").write_text(json.dumps(ids, ensure_ascii=False))
        (Path(tmp) / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
        CLIPTokenizerFast(vocab_file=str(Path(tmp) / "vocab.json"), merges_file=str(Path(tmp) / "merges.txt"),
                          model_max_length=context_length).save_pretrained(str(out))


def export_hf(src: str, out: Path) -> None:
    from transformers import CLIPModel

    from titan_contrastive.interop import read_checkpoint
    from titan_contrastive.interop.hf_clip import hf_config_from_args, to_hf_state_dict

    args, state = read_checkpoint(src)
    model = CLIPModel(hf_config_from_args(args))
    model.load_state_dict(to_hf_state_dict(state, args), strict=False)  # position_ids buffers are the model's own
    missing = [k for k in model.state_dict() if k not in to_hf_state_dict(state, args) and not k.endswith("position_ids")]
    if missing:
        raise ValueError(f"{src}: transformers' CLIPModel has weights the checkpoint lacks: {missing[:3]}")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp), safe_serialization=True)
    if args.vocab_size == 49408:  # CLIP's vocabulary: ship its tokenizer (the byte tokenizer has no HF equivalent)
        write_hf_tokenizer(tmp, args.context_length)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m titan_contrastive.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("src", help="one of our step-N checkpoint folders, or a Hugging Face CLIP folder")
    parser.add_argument("--to", choices=FORMATS, required=True, help="hf: a transformers CLIPModel folder")
    parser.add_argument("--out", type=Path, required=True, help="folder to write (replaced if it exists)")
    args = parser.parse_args(argv)
    try:
        export_hf(args.src, args.out)
    except ImportError as e:
        print(f"error: --to hf needs {e.name}: pip install -e '.[hf]'", file=sys.stderr)
        return 2
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out} ({args.to}) from {args.src}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
