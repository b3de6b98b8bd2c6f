"""A guide model (GISTEmbed, `[loss] guide_model`) through the trainer: all-MiniLM-L6-v2 trains on
a pairs file with two hard negatives per row while a frozen guide (MiniLM with perturbed weights,
saved as a sentence-transformers folder) decides the margin and relative masks. Each step kind's
loss and every parameter gradient equal the objective's dense form over the whole batch with the
guide's masks (float64, <= 1e-10), on one process and on two gloo ranks, and with a guide of
another vocabulary, which reads the model's ids as text; the guide masks other candidates than the
model would; the guide stays frozen; bad settings are one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from tests.needs import needs
from tests.test_hard_negatives import REL, K, assert_grads_close, make_trainer, pairs_file
from tests.test_trainer import full, grads
from titan_contrastive.batching import document_ids, with_negatives
from titan_contrastive.config import ConfigError
from titan_contrastive.losses import build_objective, split_documents, split_ids
from titan_contrastive.losses.base import columns
from titan_contrastive.losses.guide import Guide

KINDS = {  # local batch, accumulation steps, options
    "accumulate-oneway-margin": (6, 1, ["--loss.symmetric=false", "--loss.mask_margin=-0.05"]),
    "gradcache-relative": (
        6,
        1,
        ["--gradcache.enabled=true", "--gradcache.chunk_sizes=4", "--loss.mask_relative=0.95"],
    ),
    "global-gte-margin-duplicates": (
        3,
        2,
        [
            "--loss.negatives=global",
            "--loss.stream_chunk_size=5",
            "--loss.symmetric=false",
            "--loss.joint_directions=query_to_query,doc_to_query,doc_to_doc",
            "--loss.mask_margin=-0.05",
            "--loss.mask_duplicates=true",
        ],
    ),
}


def guided_reference(trainer, samples: dict) -> tuple[float, dict[str, torch.Tensor]]:
    """The objective's dense form over all samples at once, its masks on the guide's cosines of them."""
    model = trainer.spec.build_model(trainer.model_args).double()
    model.load_state_dict({k: full(v) for k, v in trainer.model.state_dict().items()})
    model.train(trainer.model.training)
    docs = with_negatives(samples["doc"], samples["neg"], model.pad_id)
    q, d, scale = model(samples["query"], docs)
    cols = columns(*split_documents(d.reshape(len(q), 1 + K, -1)))
    with torch.no_grad():
        gq, gd = trainer.step_context.guide(samples["query"], docs)[:2]
    guide = Guide(gq, columns(*split_documents(gd.reshape(len(q), 1 + K, -1))))
    plain = build_objective(trainer.cfg.loss)
    ids = columns(*split_ids(document_ids(samples["doc"], samples["neg"], model.pad_id))) if plain.needs_ids else None
    objective = plain.with_guide(guide)
    by_guide, by_model = objective.false_negatives.dense(q, cols, ids), plain.false_negatives.dense(q, cols, ids)
    assert by_guide.any() and not by_guide.all(1).any() and (by_guide != by_model).any()  # the guide decides
    loss = objective.dense(q, cols, scale, ids=ids)
    loss.backward()
    return loss.item(), grads(model)


def _step(tmp: Path, guide: Path, kind: str) -> None:
    """One step of `kind` (dropout off) against the guided dense reference; P ranks x GA microbatches."""
    local, ga, extra = KINDS[kind]
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    trainer = make_trainer(
        tmp,
        f"--training.local_batch_size={local}",
        f"--training.global_batch_size={local * ga * world}",
        f"--loss.guide_model={guide}",
        *extra,
    )
    assert "the frozen guide's cosines" in trainer.gradient_step.describe()
    trainer.model.eval()
    data = trainer.train_set
    steps = [data.__getitems__(list(range(j * local * world, (j + 1) * local * world))) for j in range(ga)]
    mine = [{k: v[rank * local : (rank + 1) * local] for k, v in s.items()} for s in steps]
    every = {k: torch.cat([s[k] for s in steps]) for k in steps[0]}
    want_loss, want = guided_reference(trainer, every)
    before = {k: v.clone() for k, v in trainer.step_context.guide.state_dict().items()}
    out = trainer.train_step(mine)
    assert_grads_close(grads(trainer.model), want)
    assert abs(out["loss"] - want_loss) <= REL * want_loss
    guide_model = trainer.step_context.guide
    assert not guide_model.training and not any(p.requires_grad or p.grad is not None for p in guide_model.parameters())
    assert all(torch.equal(v, before[k]) for k, v in guide_model.state_dict().items())
    trainer.metrics.close()


@needs("hf")
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_guide_decides_the_masks_in_every_step_kind_exactly(tmp_path: Path, guide_dir: Path, kind: str) -> None:
    pairs_file(tmp_path)
    _step(tmp_path, guide_dir, kind)


def _step_distributed(tmp: str, guide: str) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    _step(Path(tmp), Path(guide), "global-gte-margin-duplicates")


@needs("hf")
def test_a_guide_with_another_tokenizer_trains_exactly(tmp_path: Path) -> None:
    """A tiny word-level BERT guides MiniLM: it reads MiniLM's token ids as text (`Retokenizer`), and
    global negatives with GTE's directions equal the dense objective with its masks."""
    from tests.hf_folders import encoder_folder

    pairs_file(tmp_path)
    _step(tmp_path, encoder_folder(tmp_path, dropout=0.0), "global-gte-margin-duplicates")


@needs("hf")
@pytest.mark.slow  # 16 s: the default suite's time; the objective's forms run on 2 and 4 processes in test_guide.py
def test_a_guide_under_global_negatives_on_two_ranks(tmp_path: Path, guide_dir: Path) -> None:
    """FSDP2 on 2 gloo processes: each rank's guide embeddings are gathered into the global problem's."""
    pairs_file(tmp_path)
    run_distributed(_step_distributed, 2, str(tmp_path), str(guide_dir))


class WithoutGuide:
    """A registered objective that cannot take a guide (InfoNCE without `with_guide`)."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __getattr__(self, name: str):
        if name == "with_guide":
            raise AttributeError(name)
        return getattr(self.inner, name)


@needs("hf")
def test_a_guide_pooling_without_the_prompt_skips_the_model_s_prompts(tmp_path: Path, guide_dir: Path) -> None:
    """sentence-transformers' GISTEmbedLoss hands the model's prompt length to the guide, whose Pooling with
    `include_prompt` false leaves those tokens out: the guide's embeddings of the model's prompted ids equal
    `SentenceTransformer(guide).encode(texts, prompt=...)` (float32, <= 1e-5), and differ from pooling over the
    prompt; per-source prompts with such a guide are refused in one line."""
    from sentence_transformers import SentenceTransformer

    from tests.test_hard_negatives import WORDS
    from titan_contrastive.models.bi_encoder import build_tokenizer

    st = SentenceTransformer(str(guide_dir), device="cpu")
    st[1].include_prompt = False
    no_prompt = tmp_path / "guide-no-prompt"
    st.save(str(no_prompt))
    pairs_file(tmp_path)
    prompts = {"query": "query: ", "doc": "passage: "}  # within the 16 tokens of the longest query
    trainer = make_trainer(
        tmp_path,
        "--training.local_batch_size=6",
        "--training.global_batch_size=6",
        f"--loss.guide_model={no_prompt}",
        "--loss.mask_margin=0",
        f"--model.query_prompt={prompts['query']}",
        f"--model.doc_prompt={prompts['doc']}",
    )
    samples = trainer.train_set.__getitems__(list(range(6)))
    queries, positives = [w[0] for w in WORDS[:6]], [w[1] for w in WORDS[:6]]
    tokenizer = build_tokenizer(trainer.model_args)
    assert torch.equal(samples["query"], tokenizer.encode_queries(queries, 16))  # rows in file order
    assert torch.equal(samples["doc"], tokenizer.encode_docs(positives))
    guide = trainer.step_context.guide
    assert guide.prompt_skip[0] > 1 and guide.prompt_skip[1] > 1
    with torch.no_grad():
        gq, gd = guide(samples["query"], samples["doc"])[:2]
    reference = SentenceTransformer(str(no_prompt), device="cpu")
    want_q = reference.encode(queries, prompt=prompts["query"], convert_to_tensor=True)
    want_d = reference.encode(positives, prompt=prompts["doc"], convert_to_tensor=True)
    assert (gq.float() - want_q).abs().max() <= 1e-5 and (gd.float() - want_d).abs().max() <= 1e-5
    pooled_over = SentenceTransformer(str(guide_dir), device="cpu").encode(
        queries, prompt=prompts["query"], convert_to_tensor=True
    )
    assert (gq.float() - pooled_over).abs().max() > 1e-2
    trainer.metrics.close()
    with pytest.raises(ConfigError, match=r"data.query_prompts / doc_prompts: the guide or teacher .* pools without"):
        make_trainer(
            tmp_path / "per-source",
            f"--data.path={tmp_path / 'pairs.jsonl'}",
            f"--loss.guide_model={no_prompt}",
            "--loss.mask_margin=0",
            "--data.query_prompts=find: ",
        )


@needs("hf")
def test_a_guide_is_refused_where_it_cannot_work(tmp_path: Path, guide_dir: Path, monkeypatch) -> None:
    """Without a margin or relative mask; for a family without guides; with the model's tokenizer and
    fewer positions than its sequences; a folder that holds no model; a registered objective without
    `with_guide`: one line naming loss.guide_model and the fix, before any step."""
    from transformers import BertConfig, BertModel

    from tests.test_trainer import make_trainer as clip_trainer
    from titan_contrastive import losses
    from titan_contrastive.models.bi_encoder.folder import bundled_minilm, load_tokenizer

    pairs_file(tmp_path)

    def make(*extra: str):
        return make_trainer(tmp_path, "--training.local_batch_size=6", "--training.global_batch_size=6", *extra)

    with pytest.raises(ConfigError, match=r"loss.guide_model=.* neither is set: set loss.mask_margin"):
        make(f"--loss.guide_model={guide_dir}")
    with pytest.raises(
        ConfigError,
        match=r"the vlm family takes no frozen guide or teacher model \(bi_encoder, clip, hf_clip, qwen_vl, static",
    ):
        clip_trainer(
            str(tmp_path / "vlm"),
            "--model.name=vlm",
            "--data.dataset=emoji",
            f"--loss.guide_model={guide_dir}",
            "--loss.mask_margin=0",
        )
    short = tmp_path / "short-bert"  # MiniLM's tokenizer, 8 positions: the model's ids reach 16 tokens
    tokenizer = load_tokenizer(str(bundled_minilm()))
    config = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    BertModel(BertConfig(vocab_size=len(tokenizer), max_position_embeddings=8, **config)).save_pretrained(short)
    tokenizer.save_pretrained(short)
    with pytest.raises(ConfigError, match=r"holds 8 positions and the model's sequences reach 16 tokens: use a guide"):
        make(f"--loss.guide_model={short}", "--loss.mask_margin=0")
    with pytest.raises(
        ConfigError, match=r"loss.guide_model='/no/such/guide' is not a local folder .* set loss.guide_model=DIR"
    ):
        make("--loss.guide_model=/no/such/guide", "--loss.mask_margin=0")
    monkeypatch.setattr(losses, "OBJECTIVES", dict(losses.OBJECTIVES))
    losses.register_objective("no_guide", lambda loss, masking: WithoutGuide(losses.InfoNCE(False, masking)))
    with pytest.raises(
        ConfigError, match=r"loss.name='no_guide' has no with_guide .* add it or leave loss.guide_model empty"
    ):
        make(f"--loss.guide_model={guide_dir}", "--loss.mask_margin=0", "--loss.name=no_guide")
