"""Adaptive layers (`loss.adaptive_layers`) in a bi_encoder: every step kind (GradCache in chunks that divide nothing
and in token budgets, global negatives over accumulated microbatches; on 1 and 2 processes, FSDP2 and DDP) against
the loss written from the tower's hidden states, layers drawn per step, GradCache with dropout on, the held-out recall
at each exit, the export cut to an earlier layer, a decoder's exits through its final norm; the refusals are one
line. The objective's forms against the definition: `tests/test_adaptive_layers.py`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.dist_utils import run_distributed
from tests.needs import needs
from tests.test_adaptive_layers import _mean
from tests.test_trainer import full

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
