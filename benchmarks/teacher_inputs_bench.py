"""What an hf_clip teacher of another tokenizer or other image statistics costs per batch for reading the run's batch
adapted (`models/hf_clip/teacher_inputs.py`), on the host, beside the data workers' own tokenization of the captions.

    python -m benchmarks.teacher_inputs_bench                 # batches of 256: WordNet definitions, 224 px pixels
    python -m benchmarks.teacher_inputs_bench --batch 1024 --repeats 9

The captions are `--batch` WordNet definitions of the bundled set (10 to 20 words, like web captions), tokenized by
the bundled MiniLM's tokenizer (a fast WordPiece one) at 77 tokens as the run's ids; the teacher's tokenizer is the
same one at 64 (the cost is a fast tokenizer's decode and encode, whichever vocabulary). Rows (median of
`harness.round_robin`, interleaved, after a warm-up; one thread):
- `encode`: the run's own tokenization of the captions (what a data worker does per batch);
- `retokenize`: the teacher's reading of the run's ids, `TeacherInputs` (to the host, decode, encode);
- `renormalize`: the pixels normalized again, [batch, 3, 224, 224] float32 on the CPU (on a GPU it is one kernel).
Each row gives milliseconds per batch and the samples per second one host core sustains at that cost.
Writes teacher_inputs_bench.{json,csv,png}.
"""

from __future__ import annotations

import argparse
import gzip
from typing import Any

from benchmarks import harness

NAME = "teacher_inputs_bench"
FIELDS = ["work", "batch", "ms_per_batch", "samples_per_s_per_core"]


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", default=str(harness.RESULTS))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    import torch

    from titan_contrastive.datasets.tokenizer import CaptionTokenizer, PairTokenizer
    from titan_contrastive.models.bi_encoder.folder import bundled_minilm, load_tokenizer
    from titan_contrastive.models.hf_clip.teacher_inputs import TeacherInputs, run_decoder

    torch.set_num_threads(1)
    meta = harness.metadata("cpu")
    assets = harness.REPO / "titan_contrastive" / "assets" / "wordnet" / "pairs_train.tsv.gz"
    with gzip.open(assets, "rt", encoding="utf-8") as f:
        captions = [next(f).split("\t")[0] for _ in range(args.batch)]
    hf = load_tokenizer(str(bundled_minilm()))

    def tokenizer(length: int) -> CaptionTokenizer:
        return CaptionTokenizer(PairTokenizer(hf, doc_length=length, pad_id=int(hf.pad_token_id)), length)

    run = tokenizer(77)
    ids = run.encode(captions)
    reads = TeacherInputs(run_decoder(str(bundled_minilm())), tokenizer(64))
    stats = ((0.481, 0.458, 0.408), (0.269, 0.261, 0.276)), ((0.5,) * 3, (0.5,) * 3)
    pixels = torch.randn(args.batch, 3, args.size, args.size)
    renormalize = TeacherInputs(pixels_from=stats[0], pixels_to=stats[1])
    variants = {
        "encode": lambda: run.encode(captions),
        "retokenize": lambda: reads(pixels[:1], ids),
        "renormalize": lambda: renormalize(pixels, ids[:1]),
    }
    measured = harness.round_robin(variants, args.repeats, device="cpu", rss=False)
    rows = [
        {
            "work": work,
            "batch": args.batch,
            "ms_per_batch": 1e3 * result.median_s,
            "samples_per_s_per_core": args.batch / result.median_s,
            "times_s": result.times_s,
        }
        for work, result in measured.items()
    ]

    def figure() -> Any:
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.bar([r["work"] for r in rows], [r["ms_per_batch"] for r in rows])
        ax.set_ylabel(f"ms per batch of {args.batch} (median)")
        ax.set_title(f"A teacher's adapted inputs on one host core, {meta['cpu']}", fontsize=9)
        fig.tight_layout()
        return fig

    harness.write_results(args.out, NAME, meta, {"config": vars(args)}, rows=rows, fields=FIELDS, figure=figure)


if __name__ == "__main__":
    main()
