"""`python -m titan_contrastive.export SRC --to hf|sentence-transformers --out DIR`: checkpoints for the ecosystem.

`--to hf` (clip family): SRC is anything `[model] init_from` reads (`interop.detect_format`): one
of our step-N folders (FSDP shards are consolidated by DCP on load) or a Hugging Face CLIP folder.
DIR receives what `transformers.CLIPModel.from_pretrained(DIR)` and
`CLIPTokenizerFast.from_pretrained(DIR)` load: `config.json`, `model.safetensors` and CLIP's BPE
tokenizer files (built by transformers from the vocabulary this package ships).

`--to open_clip` (clip family, same SRC): `open_clip_config.json` + `open_clip_model.safetensors`,
the layout open_clip reads from a local folder or the hub (`create_model_and_transforms(
"local-dir:DIR")`).

`--to sentence-transformers` (bi_encoder family): SRC is one of our step folders; DIR is what
`sentence_transformers.SentenceTransformer(DIR)` loads: the tower (`--tower query|doc`; the same
one when shared) with its tokenizer, mean pooling over real tokens and L2 normalization, the
embedding the bi_encoder trains, cut at its query / document length.

The folder is written under a temporary name and renamed when complete. Needs transformers
(`pip install -e '.[hf]'`; sentence-transformers for its format).

Why through transformers' own `CLIPModel`: the weights are loaded into it strictly before they
are saved, so a folder this writes is one transformers has already accepted.
"""

from __future__ import annotations

import argparse
import inspect
import json
import shutil
import sys
import tempfile
from pathlib import Path

FORMATS = ("hf", "open_clip", "sentence-transformers")


def write_hf_tokenizer(out: Path, context_length: int) -> None:
    """CLIP's BPE as transformers' CLIPTokenizerFast files (vocab.json + merges.txt -> its converter)."""
    from transformers import CLIPTokenizerFast

    from titan_contrastive.datasets.clip_bpe import vocab_and_merges

    vocab, merges = vocab_and_merges()
    ids = {t: i for i, t in enumerate(vocab)}
    if "vocab" in inspect.signature(CLIPTokenizerFast.__init__).parameters:  # transformers >= 5 takes them directly
        CLIPTokenizerFast(vocab=ids, merges=merges, model_max_length=context_length).save_pretrained(str(out))
        return
    with tempfile.TemporaryDirectory() as tmp:  # transformers 4 reads files
        (Path(tmp) / "vocab.json").write_text(json.dumps(ids, ensure_ascii=False))
        (Path(tmp) / "merges.txt").write_text("#version: 0.2\n" + "\n".join(" ".join(m) for m in merges) + "\n")
        CLIPTokenizerFast(vocab_file=str(Path(tmp) / "vocab.json"), merges_file=str(Path(tmp) / "merges.txt"),
                          model_max_length=context_length).save_pretrained(str(out))


def _replace(tmp: Path, out: Path) -> None:
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def export_sentence_transformers(src: str, out: Path, tower: str = "query") -> None:
    from sentence_transformers import SentenceTransformer, models

    from titan_contrastive.interop import read_ours

    family, args, model = read_ours(Path(src).expanduser())
    if family != "bi_encoder":
        raise ValueError(f"{src}: a {family} checkpoint; --to sentence-transformers exports the bi_encoder family (clip: --to hf)")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with tempfile.TemporaryDirectory() as hf_dir:
        from titan_contrastive.models.bi_encoder.model import load_tokenizer

        getattr(model, f"{tower}_tower").save_pretrained(hf_dir)
        load_tokenizer().save_pretrained(hf_dir)
        length = args.query_length if tower == "query" else args.doc_length
        encoder = models.Transformer(hf_dir, max_seq_length=length)
        pooling = models.Pooling(encoder.get_word_embedding_dimension(), pooling_mode="mean")
        SentenceTransformer(modules=[encoder, pooling, models.Normalize()], device="cpu").save(str(tmp))
    _replace(tmp, out)


def export_open_clip(src: str, out: Path) -> None:
    from safetensors.torch import save_file

    from titan_contrastive.interop import read_checkpoint
    from titan_contrastive.interop.openclip import CONFIG_FILE, WEIGHT_FILES, open_clip_config, to_open_clip_state_dict

    args, state = read_checkpoint(src)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / CONFIG_FILE).write_text(json.dumps(open_clip_config(args), indent=1))
    save_file(to_open_clip_state_dict(state), str(tmp / WEIGHT_FILES[0]))
    _replace(tmp, out)


def export_hf(src: str, out: Path) -> None:
    from transformers import CLIPModel

    from titan_contrastive.interop import read_checkpoint
    from titan_contrastive.interop.hf_clip import hf_config_from_args, to_hf_state_dict

    args, state = read_checkpoint(src)
    model = CLIPModel(hf_config_from_args(args))
    result = model.load_state_dict(to_hf_state_dict(state, args), strict=False)  # position_ids buffers are the model's own
    missing = [k for k in result.missing_keys if not k.endswith("position_ids")]
    if missing or result.unexpected_keys:
        raise ValueError(f"{src}: transformers' CLIPModel lacks {result.unexpected_keys[:3]} and wants {missing[:3]}")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp), safe_serialization=True)
    if args.vocab_size == 49408:  # CLIP's vocabulary: ship its tokenizer (the byte tokenizer has no HF equivalent)
        write_hf_tokenizer(tmp, args.context_length)
    _replace(tmp, out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m titan_contrastive.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("src", help="one of our step-N checkpoint folders, or a Hugging Face CLIP folder")
    parser.add_argument("--to", choices=FORMATS, required=True,
                        help="hf: a transformers CLIPModel folder, open_clip: open_clip's folder layout (clip); "
                             "sentence-transformers: a SentenceTransformer folder (bi_encoder)")
    parser.add_argument("--out", type=Path, required=True, help="folder to write (replaced if it exists)")
    parser.add_argument("--tower", choices=("query", "doc"), default="query", help="sentence-transformers: which tower (default: query)")
    args = parser.parse_args(argv)
    try:
        if args.to == "hf":
            export_hf(args.src, args.out)
        elif args.to == "open_clip":
            export_open_clip(args.src, args.out)
        else:
            export_sentence_transformers(args.src, args.out, args.tower)
    except ImportError as e:
        print(f"error: --to {args.to} needs {e.name}: pip install -e '.[hf]'" + (" sentence-transformers" if args.to != "hf" else ""),
              file=sys.stderr)
        return 2
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out} ({args.to}) from {args.src}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
