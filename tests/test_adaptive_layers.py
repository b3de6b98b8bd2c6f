"""Adaptive layers (`loss.adaptive_layers`, `losses/layers.py`): the objective at the last layer and at earlier
layers, plus each earlier layer's KL from the last's, against the definition written here one text at a time
(float64, <= 1e-10): the dense, streamed (chunks that divide nothing) and microbatch forms, on 1, 2 and 4 gloo
processes, over InfoNCE with hard negatives and masks, Matryoshka inside it, and the sigmoid loss. Then a bi_encoder
trained with it, every step kind (GradCache in chunks that divide nothing and in token budgets, global negatives
over accumulated microbatches; on 1 and 2 processes) against the loss written from the tower's hidden states, and
GradCache with dropout on; the refusals are one line."""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.dist_utils import run_distributed
from tests.needs import needs
from tests.test_objectives import CASES, N, _close, leaves, objective_of, problem, reference
from tests.test_trainer import full
from titan_contrastive.losses import MicrobatchLoss, Ranks
from titan_contrastive.losses.layers import AdaptiveLayers

BASE = {c["name"]: c for c in CASES}
LAYERS = [  # the inner objective's case, the earlier exits' weights, the KL's weight and temperature, exits per step
    ("clip-oneway-k2-all-full", (0.5, 0.25), 1.0, 0.3, 0),
    ("clip-sym-k0-none-mat", (1.0,), 2.0, 0.7, 0),
    ("siglip-sym-k2-margin-full", (0.3, 0.6), 0.5, 0.3, 0),
    ("clip-oneway-k0-relative-full", (0.5,), 1.0, 0.0, 0),
    ("clip-oneway-k2-all-full", (0.5, 0.25, 0.4), 1.0, 0.3, 2),
    ("siglip-sym-k2-margin-full", (0.3, 0.6), 0.5, 0.3, 1),
]
LAYERS = [
    (BASE[name], dict(w=w, a=a, t=t, n=n, name=f"{name}-{len(w)}exits-a{a}-t{t}-drawn{n}"))
    for name, w, a, t, n in LAYERS
]
STEP = 5  # the optimizer step the drawn cases are at


def wide(case: dict, count: int, seed: int = 0):
    """`count` problems side by side: each text's exits [last | earlier ...], each a unit vector, with the ids,
    scale and bias of the first."""
    blocks = [problem(case, seed + 10 * i) for i in range(count)]
    q, p, n = (None if b[0] is None else torch.cat(list(b), 1) for b in zip(*(x[:3] for x in blocks)))
    return (q, p, n, *blocks[0][3:])


def definition(case: dict, lcase: dict, q, p, n, scale, bias, ids, drawn=None) -> torch.Tensor:
    """L(last) + sum_k w_k L(exit k) + a T sum_k 1/R sum over the R texts of sum_j p_j (log p_j - log q_j), p the
    last exit's softmax at T (held), q exit k's; `drawn` (0-based earlier exits): the sums over them alone, each w_k
    times K / len(drawn)."""
    d = q.shape[1] // (1 + len(lcase["w"]))
    exits = range(len(lcase["w"])) if drawn is None else drawn
    share = len(lcase["w"]) / len(exits)

    def block(x, i):
        return None if x is None else x[:, i * d : (i + 1) * d]

    total = reference(case, block(q, 0), block(p, 0), block(n, 0), scale, bias, ids)
    for e in exits:
        w, i = lcase["w"][e] * share, e + 1
        total = total + w * reference(case, block(q, i), block(p, i), block(n, i), scale, bias, ids)
    t = lcase["t"]
    if not (lcase["a"] and t):
        return total
    texts = [x for x in (q, p, n) if x is not None]
    texts = [row for x in texts for row in x]
    kl = 0.0
    for row in texts:
        last = row[:d].detach() / t
        target = [math.exp(v) for v in (last - last.logsumexp(0)).tolist()]
        for i in (e + 1 for e in exits):
            log_q = row[i * d : (i + 1) * d] / t
            log_q = log_q - log_q.logsumexp(0)
            kl = kl + sum(pj * (math.log(pj) - log_q[j]) for j, pj in enumerate(target))
    return total + lcase["a"] * t * kl / len(texts)


def layers_of(case: dict, lcase: dict, width: int) -> AdaptiveLayers:
    """The objective of the case, at step `STEP` where it draws exits."""
    objective = AdaptiveLayers(objective_of(case), width, lcase["w"], lcase["a"], lcase["t"], lcase["n"], seed=3)
    return objective.at_step(STEP) if lcase["n"] else objective


@pytest.mark.parametrize("pair", LAYERS, ids=[c["name"] for _, c in LAYERS])
def test_every_form_matches_the_definition(pair) -> None:
    case, lcase = pair
    q, p, n, scale, bias, ids = wide(case, 1 + len(lcase["w"]))
    objective = layers_of(case, lcase, q.shape[1] // (1 + len(lcase["w"])))
    assert (objective.drawn is None) == (not lcase["n"]) and len(objective.drawn or lcase["w"]) == (
        lcase["n"] or len(lcase["w"])
    )
    rq, rp, rn, rs, rb = leaves(q, p, n, scale, bias)
    want_loss = definition(case, lcase, rq, rp, rn, rs, rb, ids, objective.drawn)
    wanted = [x for x in (rq, rp, rn, rs) if x is not None]
    want_q, want_p, *want_n, want_s = torch.autograd.grad(want_loss, wanted)
    cols, want_cols = (p, want_p) if n is None else (torch.cat([p, n]), torch.cat([want_p, *want_n]))
    b = bias if objective.has_bias else None

    dq, dcols, ds = leaves(q, cols, scale)
    loss = objective.dense(dq, dcols, ds, b, ids)
    loss.backward()
    for got, want, what in ((loss, want_loss, "loss"), (dq.grad, want_q, "dq"), (dcols.grad, want_cols, "dD")):
        _close(got.detach(), want.detach(), f"dense {what}")
    _close(ds.grad, want_s, "dense ds")
    for chunk in (5, 7, N):
        out = objective.streamed(q, cols, scale, b, first_row=0, num_queries=N, chunk=chunk, ranks=Ranks(None), ids=ids)
        _close(out.loss, want_loss.detach(), f"streamed loss, chunk {chunk}")
        _close(out.grad_rows, want_q, f"streamed dq, chunk {chunk}")
        _close(out.grad_cols, want_cols, f"streamed dD, chunk {chunk}")
        _close(out.scale_rows.sum(), want_s, f"streamed ds, chunk {chunk}")

    mq, ms, mb = leaves(q, scale, bias)
    k = case["k"]
    mdocs = (p if n is None else torch.cat([p[:, None], n.view(N, k, -1)], 1)).clone().requires_grad_()
    local_ids = ids if n is None else torch.cat([ids[:N, None], ids[N:].view(N, k)], 1)
    loss = MicrobatchLoss(objective)(mq, mdocs, ms, mb if objective.has_bias else None, ids=local_ids)
    loss.backward()
    _close(loss.detach(), want_loss.detach(), "microbatch loss")
    _close(mq.grad, want_q, "microbatch dq")
    _close(mdocs.grad if n is None else mdocs.grad[:, 0], want_p, "microbatch dp")
    assert "KL" in objective.describe() or not lcase["t"]


def test_the_draws_are_the_seeds_and_the_steps() -> None:
    """The exits drawn at a step depend on the seed and the step alone (every rank, every pass draws the same), vary
    from step to step, and each exit is drawn about equally often."""
    case, lcase = LAYERS[4]
    made = AdaptiveLayers(objective_of(case), 8, lcase["w"], per_step=1, seed=3)
    draws = [made.at_step(step).drawn for step in range(300)]
    assert draws == [made.at_step(step).drawn for step in range(300)]
    assert draws != [dataclasses.replace(made, seed=4).at_step(step).drawn for step in range(300)]
    counts = [draws.count((k,)) for k in range(3)]
    assert sum(counts) == 300 and min(counts) > 70, counts
    assert made.at_step(0).inner == made.inner and dataclasses.replace(made, per_step=0).at_step(7).drawn is None


def test_the_kl_term_counts() -> None:
    """The cases' KL terms are not zero: the definition without them differs."""
    case, lcase = LAYERS[0]
    q, p, n, scale, bias, ids = wide(case, 3)
    with_kl = definition(case, lcase, q, p, n, scale, bias, ids)
    assert abs(with_kl - definition(case, dict(lcase, a=0.0), q, p, n, scale, bias, ids)) > 1e-3


def _distributed(names: list[str]) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    ranks = Ranks(dist.group.WORLD)
    for case, lcase in (pair for pair in LAYERS if pair[1]["name"] in names):
        q, p, n, scale, bias, ids = wide(case, 1 + len(lcase["w"]), seed=1)
        objective = layers_of(case, lcase, q.shape[1] // (1 + len(lcase["w"])))
        rq, rp, rn, rs, rb = leaves(q, p, n, scale, bias)
        want_loss = definition(case, lcase, rq, rp, rn, rs, rb, ids, objective.drawn)
        want_q, want_p, *want_n = torch.autograd.grad(want_loss, [x for x in (rq, rp, rn) if x is not None])
        c, k = N // world, case["k"]
        own, own_neg = slice(rank * c, (rank + 1) * c), slice(rank * c * k, (rank + 1) * c * k)
        b = bias if objective.has_bias else None
        cols = p if n is None else torch.cat([p, n])
        out = objective.streamed(
            q[own], cols, scale, b, first_row=own.start, num_queries=N, chunk=2, ranks=ranks, ids=ids
        )
        _close(out.loss, want_loss.detach(), f"{lcase['name']} streamed loss")
        _close(out.grad_rows, want_q[own], f"{lcase['name']} streamed dq")
        shares = out.grad_cols.clone()
        dist.all_reduce(shares)
        _close(shares, want_p if n is None else torch.cat([want_p, *want_n]), f"{lcase['name']} streamed dD")

        lq, ls, lb = leaves(q[own], scale, bias)
        ldocs = (p[own] if n is None else torch.cat([p[own, None], n[own_neg].view(c, k, -1)], 1)).clone()
        ldocs.requires_grad_()
        local_ids = ids[own] if n is None else torch.cat([ids[:N][own, None], ids[N:][own_neg].view(c, k)], 1)
        loss = MicrobatchLoss(objective, dist.group.WORLD)(
            lq, ldocs, ls, lb if objective.has_bias else None, ids=local_ids
        )
        loss.backward()
        _close(loss.detach(), want_loss.detach(), f"{lcase['name']} microbatch loss")
        _close(lq.grad / world, want_q[own], f"{lcase['name']} microbatch dq")


@pytest.mark.parametrize("world", [2, 4])
def test_the_distributed_forms_match_the_definition(world: int) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_distributed(_distributed, world, [LAYERS[i][1]["name"] for i in (0, 2, 4)])


# ------------------------------------------------------------------ a bi_encoder trained with it

KINDS = {
    "gradcache": (6, 1, ["--gradcache.enabled=true", "--gradcache.chunk_sizes=4"]),
    "gradcache-tokens": (6, 1, ["--gradcache.enabled=true", "--gradcache.chunk_tokens=40"]),
    "global": (3, 2, ["--loss.negatives=global", "--loss.stream_chunk_size=5"]),
}
SETTINGS = ("--loss.adaptive_layers", "1", "--loss.adaptive_kl_weight=2.0", "--loss.adaptive_kl_temperature=0.5")


def _reference(trainer, samples: dict) -> tuple[float, dict[str, torch.Tensor]]:
    """The loss written from the tower's hidden states: mean pooling of the last layer and of each trained earlier
    one (all of the run's `loss.adaptive_layers`, or those its objective draws at this step), each normalized;
    InfoNCE of each (an earlier one's x 1 / K, times K / drawn); 2 x 0.5 x the mean over the texts of each one's
    KL(softmax(last / 0.5) || softmax(layer / 0.5)), the last held. Its loss and its gradients."""
    from tests.test_hf_text import grads
    from titan_contrastive.losses import InfoNCE

    model = trainer.spec.build_model(trainer.model_args).double()
    model.load_state_dict({k: full(v) for k, v in trainer.model.state_dict().items()})
    tower, pad, layers = model.query_tower, model.pad_id, trainer.model_args.exits
    drawn = trainer.objective.at_step(trainer.step).drawn
    trained = [layers[e] for e in (range(len(layers)) if drawn is None else drawn)]

    def exits(ids: torch.Tensor) -> list[torch.Tensor]:
        mask = ids != pad
        out = tower(input_ids=ids.masked_fill(~mask, 0), attention_mask=mask.long(), output_hidden_states=True)
        hidden = [out.last_hidden_state, *(out.hidden_states[k] for k in trained)]
        return [F.normalize(_mean(h, mask), dim=-1) for h in hidden]

    (q_last, *q_exits), (d_last, *d_exits) = exits(samples["query"]), exits(samples["doc"])
    scale = model.temperature()[0]
    loss = InfoNCE().dense(q_last, d_last, scale)
    last = torch.cat([q_last, d_last]).detach()
    for q, d in zip(q_exits, d_exits):
        loss = loss + InfoNCE().dense(q, d, scale) / len(trained)
        kl = F.kl_div(
            torch.log_softmax(torch.cat([q, d]) / 0.5, -1), torch.softmax(last / 0.5, -1), reduction="batchmean"
        )
        loss = loss + 2.0 * 0.5 * kl
    loss.backward()
    return loss.item(), grads(model)


def _mean(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)


def _step(tmp: Path, kind: str, *extra: str) -> None:
    """One step of `kind` against `_reference` over the whole batch (dropout off), within 1e-10."""
    from tests.test_hard_negatives import assert_grads_close
    from tests.test_hf_text import folder_run, grads

    local, ga, args = KINDS[kind]
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    trainer = folder_run(
        tmp, "encoder", f"--training.local_batch_size={local}", f"--training.global_batch_size={local * ga * world}",
        *args, *SETTINGS, *extra, dropout=0.0,
    )  # fmt: skip
    assert trainer.model.training and "earlier" in trainer.objective.describe()
    data = trainer.train_set
    steps = [data.__getitems__(list(range(j * local * world, (j + 1) * local * world))) for j in range(ga)]
    mine = [{k: v[rank * local : (rank + 1) * local] for k, v in s.items()} for s in steps]
    want_loss, want = _reference(trainer, {k: torch.cat([s[k] for s in steps]) for k in steps[0]})
    out = trainer.train_step(mine)
    assert_grads_close(grads(trainer.model), want, 1e-10)
    assert abs(out["loss"] - want_loss) <= 1e-10 * want_loss
    trainer.metrics.close()


@needs("hf")
@pytest.mark.parametrize("kind", list(KINDS))
def test_every_step_kind_equals_the_loss_of_the_hidden_states(tmp_path: Path, kind: str) -> None:
    _step(tmp_path, kind)


@needs("hf")
@pytest.mark.parametrize("kind", ["gradcache", "global"])
def test_a_layer_drawn_per_step_is_the_one_every_pass_trains(tmp_path: Path, kind: str) -> None:
    """Layers 0 and 1, one drawn per step: GradCache's two passes and the streamed step over two microbatches train
    the layer drawn for the step, as the loss written with that layer alone."""
    _step(tmp_path, kind, "--loss.adaptive_layers", "0", "1", "--loss.adaptive_layers_per_step=1")


def _two_ranks(tmp: str, kind: str, ddp: bool) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    layout = ("--parallelism.data_parallel_shard_degree=1", "--parallelism.data_parallel_replicate_degree=2")
    _step(Path(tmp), kind, *(layout if ddp else ()))


@needs("hf")
@pytest.mark.parametrize("kind, ddp", [("global", False), ("global", True), ("gradcache", False)])
def test_two_ranks(tmp_path: Path, kind: str, ddp: bool) -> None:
    """FSDP2, and DDP (whose wrapper holds the model: its exits and unit-norm check are the wrapped model's)."""
    from tests.hf_folders import encoder_folder

    encoder_folder(tmp_path, 0.0)
    run_distributed(_two_ranks, 2, str(tmp_path), kind, ddp)


@needs("hf")
def test_gradcache_with_dropout_on_equals_the_objective_of_its_forwards(tmp_path: Path) -> None:
    """Dropout on, GradCache chunks of 4 over 6: the step against the objective over the same forwards (the exits'
    embeddings side by side in training, the last layer's alone in evaluation)."""
    from tests.test_hard_negatives import assert_step_equals_its_forwards
    from tests.test_hf_text import folder_run

    trainer = folder_run(
        tmp_path, "encoder", "--training.local_batch_size=6", "--gradcache.enabled=true", "--gradcache.chunk_sizes=4",
        *SETTINGS,
    )  # fmt: skip
    batch = trainer.train_set.__getitems__(list(range(6)))
    chunks = [{k: v[s] for k, v in batch.items()} for s in (slice(0, 4), slice(4, 6))]
    assert_step_equals_its_forwards(trainer, [batch], chunks, seed=5, objective=trainer.objective)
    assert trainer.model(batch["query"], batch["doc"])[0].shape[-1] == 2 * 16
    assert trainer.model.eval()(batch["query"], batch["doc"])[0].shape[-1] == 16
    assert "earlier" not in trainer.eval_objective.describe()  # evaluation's loss: the last layer's objective
    trainer.metrics.close()


@needs("hf")
def test_what_it_cannot_take_is_one_line(tmp_path: Path) -> None:
    from tests.test_hf_text import folder_run
    from tests.test_trainer import make_trainer
    from titan_contrastive.config import ConfigError

    refusals = {
        ("--loss.adaptive_layers", "2"): "has 2 layers; give distinct layers from 0 \\(the token embeddings\\) to 1",
        (*SETTINGS[:2], "--loss.adaptive_layer_weights", "0.5", "0.5"): "one weight per loss.adaptive_layers entry",
        ("--loss.adaptive_kl_weight=2",): "applies to the earlier layers' terms, and loss.adaptive_layers is empty",
        (*SETTINGS[:2], "--model.pooling=colbert"): "this model's are ColBERT's; use a dense pooling",
    }
    for extra, message in refusals.items():
        with pytest.raises(ConfigError, match=message):
            folder_run(tmp_path, "encoder", *extra, dropout=0.0)
    with pytest.raises(ConfigError, match=r"the clip family's model embeds with its last alone; use model.name=bi_enc"):
        make_trainer(str(tmp_path / "clip"), *SETTINGS[:2])


@needs("hf")
def test_it_is_adaptive_layer_loss_over_every_layer() -> None:
    """sentence-transformers' AdaptiveLayerLoss around MultipleNegativesRankingLoss with every layer at every step
    (`n_layers_per_step=-1`, uniform weights, its KL at T 0.3) on all-MiniLM-L6-v2 with two hard negatives, float64:
    our objective at layers 0 to 5 (each 1/6) on the same model's exits, the same loss and every parameter's
    gradient."""
    from tests.test_objectives_vs_sentence_transformers import (
        SCALE,
        _assert_same,
        _features,
        _grads,
        _model,
        _st_losses,
    )
    from titan_contrastive.losses import InfoNCE

    model = _model()
    st = _st_losses().AdaptiveLayerLoss(model, _st_losses().MultipleNegativesRankingLoss(model, scale=SCALE), -1)
    value = st(_features(model), None)
    value.backward()
    want = (value.item(), _grads(model))

    def exits(features: dict) -> torch.Tensor:
        out = model[0].auto_model(**{k: v for k, v in features.items() if k != "modality"}, output_hidden_states=True)
        mask = features["attention_mask"]
        layers = [out.hidden_states[-1], *out.hidden_states[:-1]]
        return torch.cat([F.normalize(_mean(h, mask), dim=-1) for h in layers], -1)

    q, p, *negs = (exits(dict(f)) for f in _features(model))
    cols = torch.cat([p, torch.stack(negs, 1).flatten(0, 1)])
    objective = AdaptiveLayers(InfoNCE(symmetric=False), 384, (1 / 6,) * 6, 1.0, 0.3)
    loss = objective.dense(q, cols, torch.tensor(SCALE, dtype=torch.float64))
    loss.backward()
    _assert_same((loss.item(), _grads(model)), want)


@needs("hf")
def test_evaluation_reports_recall_at_each_exit(tmp_path: Path) -> None:
    """With `eval.enable`, the held-out recall of each earlier exit under `layer{k}/`, from that layer's pooled hidden
    states (here written out), beside the last layer's, whose keys and loss are as without exits."""
    from tests.test_hf_text import folder_run, write_pairs
    from titan_contrastive.components.evaluate import recall_at_k

    pairs = write_pairs(tmp_path)
    trainer = folder_run(
        tmp_path, "encoder", "--training.local_batch_size=6", *SETTINGS, "--eval.enable=true",
        f"--data.val_path={pairs}", "--eval.batch_size=5", dropout=0.0,
    )  # fmt: skip
    results = trainer.evaluate()
    val = trainer.data.eval_sets[""]
    batch = val.__getitems__(list(range(len(val))))
    model, pad = trainer.model.eval(), trainer.model.pad_id
    with torch.no_grad():
        for prefix, layer in (("layer1/", 1), ("", -1)):
            embedded = []
            for ids in (batch["query"], batch["doc"]):
                mask = ids != pad
                out = model.query_tower(
                    input_ids=ids.masked_fill(~mask, 0), attention_mask=mask.long(), output_hidden_states=True
                )
                embedded.append(F.normalize(_mean(out.hidden_states[layer], mask), dim=-1))
            sims = embedded[0] @ embedded[1].T
            want = recall_at_k(sims, val.recall_ks, "query_to_doc") | recall_at_k(sims.T, val.recall_ks, "doc_to_query")
            for key, value in want.items():
                assert abs(results[prefix + key] - value) < 1e-12, prefix + key
    assert {"loss", "query_to_doc_r@1"} <= results.keys() and 0 <= results["layer1/query_to_doc_r@1"] <= 1
    assert not trainer.model.exits_in_eval  # back to training's embeddings
    trainer.metrics.close()


@needs("hf")
@pytest.mark.parametrize("lora", [False, True])
def test_a_run_exports_cut_to_an_earlier_layer(tmp_path: Path, lora: bool, capsys) -> None:
    """`export --layers 1`: the towers (LoRA merged) cut to their first layer, a sentence-transformers folder of one
    layer whose embeddings are the run's layer-1 pooled hidden states (written out here), and a transformers one;
    a layer the run did not train, --to peft, and a decoder whose final norm moved (it normalizes its last layer's
    output, an exit's was not) are refused in one line, nothing written; under LoRA that norm stays at 1, which
    leaves the directions alone, and the cut decoder exports."""
    from sentence_transformers import SentenceTransformer

    from tests.test_hf_text import folder_run
    from tests.test_qwen_vl import LORA
    from titan_contrastive.export import main as export_main
    from titan_contrastive.models.bi_encoder.export import plain_tower
    from titan_contrastive.models.export_check import PROBE_TEXTS
    from titan_contrastive.models.weights import read_ours

    common = ("--training.local_batch_size=6", "--training.steps=1", "--checkpoint.enable=true", "--optimizer.lr=1e-2")
    common = (*common, "--lr_scheduler.warmup_steps=0", *SETTINGS)  # the decoder's final norm moves off 1
    for arch in ("encoder", "decoder"):
        run = folder_run(tmp_path, arch, *common, *(LORA if lora else ()), dropout=0.0)
        run.train()
        run.metrics.close()
    step = tmp_path / "run-encoder" / "checkpoint" / "step-1"
    out = tmp_path / "cut"
    assert export_main([str(step), "--to", "sentence-transformers", "--layers", "1", "--out", str(out)]) == 0
    assert export_main([str(step), "--to", "hf", "--layers", "1", "--out", str(tmp_path / "cut-hf")]) == 0
    theirs = SentenceTransformer(str(out), device="cpu")
    assert theirs[0].auto_model.config.num_hidden_layers == 1 and len(theirs[0].auto_model.encoder.layer) == 1
    _, args, model = read_ours(step)
    tokenizer = theirs.tokenizer
    with torch.no_grad():
        for text in PROBE_TEXTS[:2]:
            ids = torch.tensor([tokenizer(text)["input_ids"]])
            tower = plain_tower(args, model.query_tower)  # LoRA merged
            hidden = tower(input_ids=ids, output_hidden_states=True).hidden_states[1]
            want = F.normalize(hidden.mean(1), dim=-1)[0]
            assert torch.allclose(theirs.encode(text, convert_to_tensor=True).double(), want.double(), atol=1e-5)
    capsys.readouterr()
    refusals = [
        ("run-encoder", "2", "sentence-transformers", "this run trained the earlier layers [1]"),
        ("run-encoder", "1", "peft", "a cut model goes --to sentence-transformers or --to hf"),
    ]
    decoder = tmp_path / "run-decoder" / "checkpoint" / "step-1"
    if lora:  # its final norm froze at 1, which leaves the directions alone: the cut decoder is the exit
        assert (
            export_main([str(decoder), "--to", "sentence-transformers", "--layers", "1", "--out", str(tmp_path / "d")])
            == 0
        )
    else:
        refusals.append(("run-decoder", "1", "sentence-transformers", "away from the run's layer-1 exit (a decoder"))
    for run_dir, layers, to, message in refusals:
        src = tmp_path / run_dir / "checkpoint" / "step-1"
        assert export_main([str(src), "--to", to, "--layers", layers, "--out", str(tmp_path / "no")]) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert message in err and not (tmp_path / "no").exists(), err


@needs("hf")
def test_a_decoders_exits_through_its_final_norm_cut_exactly(tmp_path: Path, capsys) -> None:
    """`loss.adaptive_final_norm`: a decoder's layer-1 exit is its hidden states through the final norm, last-token
    pooled (written out here); GradCache with dropout on equals the objective over its forwards; trained with its
    norm moved (lr 1e-2), the model cut to layer 1 now exports; an encoder, with no final norm, is refused."""
    from tests.test_hard_negatives import assert_step_equals_its_forwards
    from tests.test_hf_text import folder_run
    from titan_contrastive.config import ConfigError
    from titan_contrastive.export import main as export_main

    settings = (*SETTINGS, "--loss.adaptive_final_norm=true", "--training.local_batch_size=6")
    trainer = folder_run(
        tmp_path, "decoder", *settings, "--gradcache.enabled=true", "--gradcache.chunk_sizes=4", dropout=0.0
    )
    batch = trainer.train_set.__getitems__(list(range(6)))
    model, pad = trainer.model, trainer.model.pad_id
    with torch.no_grad():
        ids = batch["query"]
        mask = ids != pad
        out = model.query_tower(
            input_ids=ids.masked_fill(~mask, 0), attention_mask=mask.long(), output_hidden_states=True
        )
        last = mask.long().cumsum(1).argmax(1)  # the last real token (right padding)
        want = F.normalize(model.query_tower.norm(out.hidden_states[1])[torch.arange(len(ids)), last], dim=-1)
        got = model(batch["query"], batch["doc"])[0]
    assert got.shape[-1] == 2 * want.shape[-1] and torch.allclose(got[:, want.shape[-1] :], want, atol=1e-12)
    chunks = [{k: v[s] for k, v in batch.items()} for s in (slice(0, 4), slice(4, 6))]
    assert_step_equals_its_forwards(trainer, [batch], chunks, seed=5, objective=trainer.objective)
    trainer.metrics.close()

    run = folder_run(
        tmp_path / "cut", "decoder", *settings, "--training.steps=1", "--checkpoint.enable=true",
        "--optimizer.lr=1e-2", "--lr_scheduler.warmup_steps=0", dropout=0.0,
    )  # fmt: skip
    run.train()
    run.metrics.close()
    step = tmp_path / "cut" / "run-decoder" / "checkpoint" / "step-1"
    out_dir = tmp_path / "cut-st"
    assert export_main([str(step), "--to", "sentence-transformers", "--layers", "1", "--out", str(out_dir)]) == 0
    with pytest.raises(ConfigError, match="adaptive_final_norm=true: .* has no final norm after its layers"):
        folder_run(tmp_path, "encoder", *settings, dropout=0.0)
