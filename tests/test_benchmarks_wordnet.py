"""The WordNet training benchmarks' variants (benchmarks/mixed_sources.py, wordnet_*.py): each
variant's command is a valid config that differs from the others only in what the benchmark compares."""

from __future__ import annotations

from pathlib import Path

from tests.needs import needs

REPO = Path(__file__).resolve().parents[1]


def test_mixed_sources_writes_two_tasks_of_the_same_pairs(tmp_path: Path) -> None:
    """benchmarks.mixed_sources: `describe` is `define` with its columns swapped, the test split is
    definition -> lemma, and each variant's command is a valid config that joins the two files."""
    from benchmarks import mixed_sources
    from titan_contrastive.config.manager import parse_args

    files = mixed_sources.write_tasks(tmp_path / "tasks")
    define, describe, test = ([line.split("\t") for line in files[k].read_text().splitlines()] for k in files)
    assert len(define) == len(describe) > 100_000 and len(test) == 2000
    assert [row[::-1] for row in define] == describe and all(len(row) == 2 for row in define + test)
    for name in mixed_sources.VARIANTS:
        cfg = parse_args(
            [f"--job.config_file={REPO / mixed_sources.CONFIG}", *mixed_sources.command(name, tmp_path / name)[1:]]
        )
        assert cfg.data.path == f"{files['define']}::{files['describe']}" and cfg.data.dataset == "pairs"
        assert cfg.data.same_source_batches == (name == "same_source")


def test_wordnet_instructions_joins_two_tasks_of_the_same_queries(tmp_path: Path) -> None:
    """benchmarks.wordnet_instructions: `relate` has `define`'s queries with the sibling lemma as the
    positive; the joined variants differ only in the prompts (one per file, the held-out queries
    behind `define`'s), and define_only trains on `define` alone."""
    from benchmarks import wordnet_instructions as wi
    from titan_contrastive.config.manager import parse_args

    files = wi.write_tasks(tmp_path / "tasks")
    define, relate, test = ([line.split("\t") for line in files[k].read_text().splitlines()] for k in files)
    assert len(define) == len(relate) > 100_000 and len(test) == 2000
    assert [r[0] for r in define] == [r[0] for r in relate] and sum(
        a[1] != b[1] for a, b in zip(define, relate)
    ) > 0.9 * len(define)
    seen = {}
    for name in wi.VARIANTS:
        cfg = parse_args([f"--job.config_file={REPO / wi.CONFIG}", *wi.command(name, tmp_path / name)[1:]])
        assert cfg.data.val_path == str(files["test"]) and cfg.data.context_length == wi.CONTEXT
        seen[name] = (cfg.data.path, cfg.data.same_source_batches, cfg.data.query_prompts, cfg.model.query_prompt)
    joined = f"{files['define']}::{files['relate']}"
    instructions = list(wi.INSTRUCTIONS.values())
    assert seen == {
        "plain": (joined, True, [], "auto"),
        "instructed": (joined, True, instructions, instructions[0]),
        "define_only": (str(files["define"]), False, [], "auto"),
    }


def test_wordnet_mined_trains_each_variant_on_its_file(tmp_path: Path) -> None:
    """benchmarks.wordnet_mined: each variant's command is a valid config on its own file, the
    mined ones on theirs, and serves the file's negative unless it is a no-negative variant."""
    from benchmarks import wordnet_mined
    from titan_contrastive.config.manager import parse_args

    files = wordnet_mined.files(tmp_path / "data")
    sources = {"inbatch": "train", "siblings": "train", "mined": "mined", "mined_rows": "mined"}
    for name in wordnet_mined.VARIANTS:
        argv = wordnet_mined.command(name, tmp_path / name)
        cfg = parse_args([f"--job.config_file={REPO / wordnet_mined.CONFIG}", *argv[1:]])
        assert cfg.data.dataset == "pairs" and cfg.data.val_path == str(files["test"])
        assert cfg.data.path == str(files[sources.get(name, name)])
        assert cfg.data.hard_negatives == (name not in ("inbatch", "mined_rows"))


def test_wordnet_pools_changes_only_the_negative_each_query_sees(tmp_path: Path) -> None:
    """benchmarks.wordnet_pools: each variant's command is a valid config on the mined file (fixed_random on its
    own, top1 on the first mined negatives), the same samples and seed, differing only in which negative it serves;
    the held-out file is read as it is (no column names)."""
    from benchmarks import wordnet_pools as wp
    from titan_contrastive.config.manager import parse_args

    files = wp.files(tmp_path / "data")
    served = {}
    for name in wp.VARIANTS:
        cfg = parse_args([f"--job.config_file={REPO / wp.CONFIG}", *wp.command(name, tmp_path / name)[1:]])
        assert (
            cfg.data.val_path == str(files["test"]) and cfg.training.steps * cfg.training.local_batch_size == wp.SAMPLES
        )
        served[name] = (
            Path(cfg.data.path).name,
            cfg.data.hard_negatives,
            cfg.data.pairs_columns,
            cfg.data.negatives_per_row,
        )
    assert served == {
        "inbatch": ("mined.jsonl", False, [], 0),
        "top1": ("top1.jsonl", True, [], 0),
        "fixed_random": ("fixed_random.jsonl", True, [], 0),
        "drawn": ("mined.jsonl", True, [], 1),
    }


def test_wordnet_directions_changes_only_the_objective(tmp_path: Path) -> None:
    """benchmarks.wordnet_directions: each variant's command is a valid config whose objective is its
    own (symmetric, one-way, Qwen3's and GTE's joint directions, hardness) on the same in-batch data."""
    from benchmarks import wordnet_directions
    from titan_contrastive.config.manager import parse_args
    from titan_contrastive.losses import build_objective

    described = {}
    for name in wordnet_directions.VARIANTS:
        argv = wordnet_directions.command(name, tmp_path / name)
        cfg = parse_args([f"--job.config_file={REPO / wordnet_directions.CONFIG}", *argv[1:]])
        assert cfg.data.hard_negatives is False and cfg.training.local_batch_size == wordnet_directions.BATCH
        described[name] = build_objective(cfg.loss).describe()
    assert described == {
        "symmetric": "clip loss (InfoNCE, symmetric)",
        "oneway": "clip loss (InfoNCE, one-way)",
        "qwen3": "clip loss (InfoNCE, one-way, joint with query_to_query, doc_to_doc)",
        "gte": "clip loss (InfoNCE, one-way, joint with query_to_query, doc_to_query, doc_to_doc)",
        "hardness": "clip loss (InfoNCE, one-way, hardness 9 x cos on in batch negatives)",
    }


@needs("hf")
def test_wordnet_guide_changes_only_the_mask(tmp_path: Path) -> None:
    """benchmarks.wordnet_guide: each variant's command is a valid config, one-way with the sibling
    negatives, that differs only in its mask: none, the margin on the model's cosines, the margin on
    the bundled MiniLM guide's."""
    from benchmarks import wordnet_guide
    from titan_contrastive.config.manager import parse_args
    from titan_contrastive.losses import build_objective
    from titan_contrastive.models.bi_encoder.folder import bundled_minilm

    masks = {}
    for name in wordnet_guide.VARIANTS:
        argv = wordnet_guide.command(name, tmp_path / name)
        cfg = parse_args([f"--job.config_file={REPO / wordnet_guide.CONFIG}", *argv[1:]])
        assert cfg.data.hard_negatives is True and cfg.training.local_batch_size == wordnet_guide.BATCH
        masks[name] = (build_objective(cfg.loss).describe(), cfg.loss.guide_model)
    one_way = "clip loss (InfoNCE, one-way"
    assert masks == {
        "none": (f"{one_way})", ""),
        "self": (f"{one_way}, false negatives masked (cos > positive + 0))", ""),
        "guide": (f"{one_way}, false negatives masked (cos > positive + 0))", str(bundled_minilm())),
    }


@needs("hf")
def test_wordnet_distill_changes_only_the_loss(tmp_path: Path) -> None:
    """benchmarks.wordnet_distill: each variant's command is a valid config training the student
    folder (the `teacher` run: the bundled MiniLM, checkpointed) on a scored file, one-way, that
    differs only in the distillation term, the objective's weight and the teacher; the variants of
    the fine-tuned teacher read what its run trained, the others never do."""
    from benchmarks import wordnet_distill
    from titan_contrastive.config.manager import parse_args
    from titan_contrastive.losses import build_objective
    from titan_contrastive.models.bi_encoder.folder import bundled_minilm

    files = wordnet_distill.files(tmp_path / "data")
    described, trained = {}, {}
    for name in wordnet_distill.VARIANTS:
        argv = wordnet_distill.command(name, tmp_path / name)
        cfg = parse_args([f"--job.config_file={REPO / wordnet_distill.CONFIG}", *argv[1:]])
        trained[name] = (Path(cfg.model.path).name, Path(cfg.data.path).name, cfg.loss.teacher_model)
        assert cfg.checkpoint.enable is (name == "teacher")
        assert cfg.data.hard_negatives is True and cfg.training.local_batch_size == wordnet_distill.BATCH
        described[name] = build_objective(cfg.loss).describe()
    one_way = "clip loss (InfoNCE, one-way)"
    own = "over each query's own documents"
    kl_own = f"1 x {one_way} + 1 x distillation (KL to the teacher's softmax at tau 1) {own}"
    margin_mse = f"1 x distillation (margin MSE) {own}, without the contrastive objective"
    kl_model = f"1 x {one_way} + 1 x distillation (KL to the teacher model's softmax over every column at tau 0.05)"
    assert described == {
        "contrastive": one_way,
        "kl": kl_own,
        "margin_mse": margin_mse,
        "kl_model": kl_model,
        "teacher": one_way,
        "kl_ft": kl_own,
        "margin_mse_ft": margin_mse,
        "kl_model_ft": kl_model,
    }
    minilm, ft = str(bundled_minilm()), str(files["teacher_ft"])
    assert trained == {
        "contrastive": ("student", "train.jsonl", ""),
        "kl": ("student", "train.jsonl", ""),
        "margin_mse": ("student", "train.jsonl", ""),
        "kl_model": ("student", "train.jsonl", minilm),
        "teacher": (Path(minilm).name, "train.jsonl", ""),
        "kl_ft": ("student", "train_ft.jsonl", ""),
        "margin_mse_ft": ("student", "train_ft.jsonl", ""),
        "kl_model_ft": ("student", "train.jsonl", ft),
    }
    assert [n for n in wordnet_distill.VARIANTS if wordnet_distill.uses_finetuned(n)] == [
        "kl_ft",
        "margin_mse_ft",
        "kl_model_ft",
    ]
    assert list(wordnet_distill.VARIANTS).index("teacher") < list(wordnet_distill.VARIANTS).index("kl_ft")


def test_static_distill_variants_differ_only_in_the_teacher(tmp_path: Path) -> None:
    """benchmarks.static_distill: one config cut alike; `ahead` reads the embeddings file the benchmark writes,
    `model` runs the bundled MiniLM, `none` has no teacher."""
    from benchmarks import static_distill as sd
    from titan_contrastive.config.manager import parse_args

    cfgs = {
        name: parse_args(
            [f"--job.config_file={REPO / sd.CONFIG}", *sd.command(name, tmp_path / name, tmp_path / "sd")[1:]]
        )
        for name in sd.VARIANTS
    }
    for name, cfg in cfgs.items():
        assert (cfg.training.steps, cfg.training.local_batch_size, cfg.model.name) == (sd.STEPS, sd.BATCH, "static")
        assert cfg.loss.teacher_embeddings == (str(sd.embeddings(tmp_path / "sd")) if name == "ahead" else "")
        assert bool(cfg.loss.teacher_model) == (name == "model") and bool(cfg.loss.distill) == (name != "none")
