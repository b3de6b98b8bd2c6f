"""open_clip ViT-B-32 <-> titan_contrastive: random-init weights load both ways, same embeddings.

    bash benchmarks/peers_venv.sh                                   # once: /tmp/peers_venv
    /tmp/peers_venv/bin/python -m benchmarks.interop_openclip [--out benchmarks/results/interop_openclip.json]

Runs in the peers venv (benchmarks/peers_venv.sh: torch 2.14.1, torchvision, open_clip, safetensors),
since open_clip needs torchvision, which does not import beside the repo's torch 2.13; from the
repository root, so this tree's titan_contrastive is the one imported. open_clip is imported only
when it runs (`--help` works in the repo venv). Nothing is timed: the harness gives the metadata.

What it checks (CPU, float32, eval, torch.manual_seed(0), no download):
a) open_clip -> ours: `open_clip.create_model("ViT-B-32", pretrained=None)` with its LayerNorms, logit_scale
   and zero-initialized tensors (attention biases) perturbed, so a mapping mistake cannot hide behind
   ones and zeros, is saved as `open_clip_model.safetensors` + `open_clip_config.json` and read by
   `models.clip.load_clip`; max |difference| of the normalized image / text embeddings (4 random 224x224
   images, 4 captions from open_clip's tokenizer). The same weights without the json (shape inference,
   which assumes OpenAI's quick GELU where open_clip's ViT-B-32 uses GELU) are reported, not hidden.
b) ours -> open_clip: `export.main([SRC, "--to", "open_clip", "--out", DIR])`, read back by
   `open_clip.create_model_and_transforms("local-dir:DIR")`, for SRC = the folder of (a) and SRC = one of
   our own step folders (DCP files + manifest.json, as the trainer writes) holding the loaded model.
c) parameter counts (ours, open_clip, CLIPArgs.num_params) and our tokenizer's ids vs open_clip's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import tempfile
from pathlib import Path

import torch

from benchmarks import harness
from titan_contrastive import export
from titan_contrastive.datasets.clip_bpe import ClipBpeTokenizer
from titan_contrastive.models.clip.model import CLIP
from titan_contrastive.models.clip.state_dict_adapter import detect_format, load_clip

TEXTS = ["a photo of a cat", "a diagram of a transformer block", "Two dogs, playing in the snow!", "x"]


def embed(model, images, ids, **kw):
    """(image, text) embeddings; open_clip's with normalize=True, ours are normalized already."""
    with torch.no_grad():
        return model.encode_image(images, **kw), model.encode_text(ids, **kw)


def compare(pair_a, pair_b) -> dict[str, float]:
    """max |a - b| of the image and of the text embeddings."""
    return {tower: (a - b).abs().max().item() for tower, a, b in zip(("image", "text"), pair_a, pair_b)}


def write_our_step(model, folder: Path) -> Path:
    """One of our step folders (as the checkpoint manager writes it, one process): DCP + manifest."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": model.state_dict()}, checkpoint_id=str(folder))
    files = {p.relative_to(folder).as_posix(): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}
    manifest = {
        "step": 0,
        "dp_degree": 1,
        "world_size": 1,
        "files": files,
        "model": {"family": "clip", "args": dataclasses.asdict(model.args)},
    }
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return folder


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=harness.RESULTS / "interop_openclip.json", help="the JSON file")
    out_file = parser.parse_args(argv).out
    import open_clip  # needs torchvision: the peers venv
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    theirs = open_clip.create_model("ViT-B-32", pretrained=None).eval()
    perturbed = []
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if ".ln_" in name or name.startswith("ln_") or name == "logit_scale" or not p.any():
                p.add_(torch.rand_like(p) * 0.2 - 0.1)
                perturbed.append(name)
    images = torch.randn(4, 3, 224, 224)
    ids = open_clip.get_tokenizer("ViT-B-32")(TEXTS)
    want = embed(theirs, images, ids, normalize=True)
    meta = harness.metadata("cpu", open_clip=open_clip.__version__)
    result: dict = {
        "device": "cpu",
        "dtype": "float32",
        "threads": torch.get_num_threads(),
        "model": "ViT-B-32 (random init, seed 0)",
        "perturbed_params": len(perturbed),
        "inputs": {"images": list(images.shape), "texts": TEXTS},
    }
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "oc").mkdir()
        save_file(
            {k: v.contiguous() for k, v in theirs.state_dict().items()}, str(tmp / "oc" / "open_clip_model.safetensors")
        )
        config = {"model_cfg": open_clip.get_model_config("ViT-B-32")}
        (tmp / "oc" / "open_clip_config.json").write_text(json.dumps(config))
        # a) open_clip -> ours, with the config json and without it (shape inference)
        ours = load_clip(tmp / "oc")
        got = embed(ours, images, ids)
        (tmp / "oc_noconf").mkdir()
        shutil.copy(tmp / "oc" / "open_clip_model.safetensors", tmp / "oc_noconf")
        inferred = load_clip(tmp / "oc_noconf")
        gelu = CLIP(dataclasses.replace(inferred.args, act="gelu")).eval()  # the same inferred shapes, GELU
        gelu.load_state_dict(inferred.state_dict())
        result["open_clip_to_ours"] = {
            "format": detect_format(tmp / "oc"),
            "act": ours.args.act,
            "max_abs_diff": compare(got, want),
            "logit_scale_equal": torch.equal(ours.logit_scale.reshape(()), theirs.logit_scale.detach()),
            "without_config_json": {
                "act": inferred.args.act,
                "max_abs_diff": compare(embed(inferred, images, ids), want),
                "max_abs_diff_inferred_shapes_with_gelu": compare(embed(gelu, images, ids), want),
                "note": "shape inference assumes OpenAI's quick GELU; open_clip's ViT-B-32 "
                "config uses nn.GELU, so without open_clip_config.json the activation is wrong (expected)",
            },
        }
        # b) ours -> open_clip: from the open_clip folder of (a) and from one of our own step folders
        sources = {"open_clip_folder": tmp / "oc", "our_step_folder": write_our_step(ours, tmp / "step-0")}
        result["ours_to_open_clip"] = {}
        for label, src in sources.items():
            dst = tmp / f"export_{label}"
            rc = export.main([str(src), "--to", "open_clip", "--out", str(dst)])
            back = open_clip.create_model_and_transforms(f"local-dir:{dst}")[0].eval()
            again = embed(back, images, ids, normalize=True)
            exported, original = load_file(str(dst / "open_clip_model.safetensors")), theirs.state_dict()
            result["ours_to_open_clip"][label] = {
                "src_format": detect_format(src),
                "export_rc": rc,
                "loader": 'open_clip.create_model_and_transforms("local-dir:DIR")',
                "max_abs_diff_vs_ours": compare(again, got),
                "max_abs_diff_vs_original_open_clip": compare(again, want),
                "state_dict_bit_identical_to_original": exported.keys() == original.keys()
                and all(torch.equal(exported[k], original[k]) for k in original),
                "loaded_state_bit_identical": all(torch.equal(v, original[k]) for k, v in back.state_dict().items()),
            }
    # c) parameter counts and tokenizers
    n_ours, n_theirs = (sum(p.numel() for p in m.parameters()) for m in (ours, theirs))
    result["params"] = {
        "ours": n_ours,
        "open_clip": n_theirs,
        "equal": n_ours == n_theirs,
        "clip_args_num_params": ours.args.num_params(),
    }
    our_ids = ClipBpeTokenizer(77).encode(TEXTS)
    result["tokenizer_ids_equal"] = torch.equal(our_ids.long(), ids.long())
    result["caveats"] = [
        "random init (no pretrained download): equality of the mapping, not of trained behaviour",
        f"torch {torch.__version__} is the only torch 2.14.1 wheel on the local index (a CUDA build), run on the CPU",
        "without open_clip_config.json the activation falls back to quick GELU (see without_config_json)",
    ]
    harness.write_json(out_file, meta, result)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
