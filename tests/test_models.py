"""Tests of the model registry and the CLIP family (CPU, a few seconds)."""

from __future__ import annotations

import dataclasses
import importlib
import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import titan_contrastive.models as models
from titan_contrastive.models import registry
from titan_contrastive.models.clip import CLIP, CLIPArgs, clip_flavors
from titan_contrastive.models.clip.model import EOS_ID, patchify


@pytest.fixture
def isolated_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Registrations made by a test do not leak into other tests."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))


@pytest.fixture
def debug_args() -> CLIPArgs:
    return clip_flavors["debug"]


@pytest.fixture
def debug_model(debug_args: CLIPArgs) -> CLIP:
    torch.manual_seed(0)
    return CLIP(debug_args)


def make_texts(batch: int, args: CLIPArgs, length: int = 10) -> torch.Tensor:
    """BOS, random tokens, EOS at `length - 1`, then PAD."""
    ids = torch.zeros(batch, args.context_length, dtype=torch.long)
    ids[:, 0] = 1
    ids[:, 1 : length - 1] = torch.randint(3, args.vocab_size, (batch, length - 2))
    ids[:, length - 1] = EOS_ID
    return ids


def make_images(batch: int, args: CLIPArgs) -> torch.Tensor:
    return torch.randn(batch, args.in_channels, args.image_size, args.image_size)


# ---------------------------------------------------------------- registry


def test_clip_is_registered() -> None:
    spec = models.get_model_spec("clip")
    assert spec.name == "clip" and spec.learns_bias
    assert "clip" in models.list_models()
    assert models.get_flavor_args("clip", "vit_b32") is clip_flavors["vit_b32"]


def test_an_empty_flavor_is_the_family_s_first() -> None:
    """`[model] flavor` unset: clip's debug, bi_encoder's shared, and the one flavor of the families with one (a
    qwen_vl, hf_clip or lit config needs no flavor line)."""
    from titan_contrastive.config import parse_args

    want = {"clip": "debug", "bi_encoder": "shared", "hf_clip": "folder", "lit": "minilm_debug", "qwen_vl": "default"}
    for name, flavor in want.items():
        assert models.get_flavor_args(name, "") is models.get_model_spec(name).flavors[flavor], name
    assert parse_args(["--model.name=qwen_vl"]).model.flavor == ""


def test_unknown_name_and_flavor_list_valid_choices() -> None:
    with pytest.raises(models.ModelRegistryError) as err:
        models.get_model_spec("foo")
    assert str(err.value) == (
        "model.name='foo' is not a registered model family; valid: bi_encoder, clip, hf_clip, lit, qwen_vl, static, "
        "vae, vlm "
        "(register your own with titan_contrastive.models.register_model)"
    )
    expected = r"^model.flavor='x' is not a flavor of 'clip'; valid: debug, vit_b32, vit_b16, vit_l14$"
    with pytest.raises(ValueError, match=expected):
        models.get_flavor_args("clip", "x")


def test_custom_family_from_user_package(
    isolated_registry: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "user_family_pkg.py").write_text(
        textwrap.dedent(
            """
            from dataclasses import dataclass
            from torch import nn
            from titan_contrastive.models import ModelSpec, register_model

            @dataclass(frozen=True)
            class ToyArgs:
                width: int

                def update_from_data(self, **data):
                    return self

                def update_from_config(self, cfg):
                    return self

                def num_params(self):
                    return 2 * (self.width * self.width + self.width)

                def flops_per_sample(self):
                    return 0

            class Toy(nn.Module):
                def __init__(self, args):
                    super().__init__()
                    self.layers = nn.ModuleList(nn.Linear(args.width, args.width) for _ in range(2))

            register_model(ModelSpec(name="toy", flavors={"tiny": ToyArgs(3)}, build_model=Toy,
                                     blocks=lambda m: list(m.layers), learns_bias=True))
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        module = importlib.import_module("user_family_pkg")  # what `job.custom_import` does
    finally:
        sys.modules.pop("user_family_pkg", None)
    spec = models.get_model_spec("toy")
    model = spec.build_model(models.get_flavor_args("toy", "tiny"))
    assert len(spec.blocks(model)) == 2 and spec.learns_bias
    assert {"clip", "toy"} <= set(models.list_models())
    with pytest.raises(ValueError, match="'toy' is already registered"):
        models.register_model(dataclasses.replace(spec, build_model=module.Toy))
    models.register_model(dataclasses.replace(spec, learns_bias=False), overwrite=True)
    assert not models.get_model_spec("toy").learns_bias


def test_a_family_s_state_dict_adapter_is_what_init_from_and_export_go_through(
    isolated_registry: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """A family of the user's own brings its formats in one `StateDictAdapter`: `[model] init_from`
    reads with it, `titan_contrastive.export` finds the family of a path it claims and writes with it;
    a format the source's family does not write is one line naming the ones it does."""
    from titan_contrastive import export as export_module

    (tmp_path / "user_adapter_pkg.py").write_text(
        textwrap.dedent(
            """
            import json
            from dataclasses import dataclass
            from pathlib import Path
            import torch
            from torch import nn
            from titan_contrastive.models import ModelSpec, StateDictAdapter, register_model

            @dataclass(frozen=True)
            class ToyArgs:
                width: int

                def update_from_data(self, **data):
                    return self

                def update_from_config(self, cfg):
                    return self

                def num_params(self):
                    return self.width * self.width + self.width

                def flops_per_sample(self):
                    return 0

            def read(path):
                weights = json.loads(Path(path).read_text())
                return ToyArgs(len(weights["bias"])), {k: torch.tensor(v) for k, v in weights.items()}

            def write(src, out, tower):
                args, state = read(src)
                (out / "toy.json").write_text(json.dumps({k: (v * 2).tolist() for k, v in state.items()}))

            register_model(ModelSpec(
                name="toy", flavors={"tiny": ToyArgs(3)}, build_model=lambda a: nn.Linear(a.width, a.width),
                blocks=lambda m: [m],
                state_dict_adapter=StateDictAdapter(
                    read=read, claims=lambda p: p.suffix == ".toy", writes={"toy_json": write}),
            ))
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "user_adapter_pkg", raising=False)
    src = tmp_path / "w.toy"
    src.write_text(json.dumps({"weight": [[1.0, 2.0], [3.0, 4.0]], "bias": [0.5, -0.5]}))
    out = tmp_path / "exported"
    code = export_module.main([str(src), "--to", "toy_json", "--out", str(out), "--custom-import", "user_adapter_pkg"])
    assert code == 0 and json.loads((out / "toy.json").read_text())["bias"] == [1.0, -1.0]
    assert (out / export_module.MARKER).is_file()
    args, state = models.resolve_model_args("toy", "tiny", init_from=str(src))
    assert args.width == 2 and torch.equal(state["weight"], torch.tensor([[1.0, 2.0], [3.0, 4.0]]))

    capsys.readouterr()
    assert export_module.main([str(src), "--to", "hf", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is a toy checkpoint, which exports to toy_json; pick one of those" in err[0], err
    assert not (tmp_path / "x").exists() and not list(tmp_path.glob(".x.tmp-*"))
    unknown = tmp_path / "w.nothing"
    unknown.write_text("{}")
    assert export_module.main([str(unknown), "--to", "hf", "--out", str(tmp_path / "x")]) == 2
    assert "not a checkpoint this project reads" in capsys.readouterr().err


def test_every_flavor_is_model_args_and_a_flavor_without_them_is_refused() -> None:
    from titan_contrastive.models import ModelArgs

    for name in models.list_models():
        for flavor, args in models.get_model_spec(name).flavors.items():
            assert isinstance(args, ModelArgs), (name, flavor)

    @dataclasses.dataclass(frozen=True)
    class Half:
        def update_from_data(self, **data):
            return self

        def num_params(self):
            return 0

    with pytest.raises(ValueError, match=r"flavor 'x': its args \(Half\) lack update_from_config, flops_per_sample;"):
        models.ModelSpec(name="half", flavors={"x": Half()}, build_model=nn.Identity, blocks=lambda m: [])


def test_duplicate_builtin_name_errors(isolated_registry: None) -> None:
    with pytest.raises(ValueError, match="'clip' is already registered"):
        models.register_model(models.get_model_spec("clip"))


# ---------------------------------------------------------------- CLIP args


def test_update_from_data(debug_args: CLIPArgs) -> None:
    args = debug_args.update_from_data(image_shape=(3, 32, 32), vocab_size=1000, context_length=16)
    assert (args.in_channels, args.image_size, args.vocab_size, args.context_length) == (3, 32, 1000, 16)
    assert args.patch_size == debug_args.patch_size and debug_args.image_size == 28  # a copy
    fix = "patch_size=4 does not divide 30; resize the images to a multiple of 4"
    with pytest.raises(ValueError, match=fix):
        debug_args.update_from_data(image_shape=(1, 30, 30), vocab_size=259, context_length=32)
    with pytest.raises(ValueError, match="needs square images"):
        debug_args.update_from_data(image_shape=(1, 28, 32), vocab_size=259, context_length=32)
    with pytest.raises(ValueError, match="vision_width=60 is not divisible by vision_heads=8"):
        dataclasses.replace(debug_args, vision_width=60, vision_heads=8)


@pytest.mark.parametrize("image_shape", [(1, 28, 28), (3, 32, 32)])
def test_num_params_matches_module(debug_args: CLIPArgs, image_shape: tuple[int, int, int]) -> None:
    args = debug_args.update_from_data(image_shape=image_shape, vocab_size=300, context_length=20)
    args = dataclasses.replace(args, mlp_ratio=2.5)
    with torch.device("meta"):
        model = CLIP(args)
    assert args.num_params() == sum(p.numel() for p in model.parameters())


def test_vit_b32_matches_open_clip_param_count() -> None:
    args = clip_flavors["vit_b32"]
    with torch.device("meta"):
        model = CLIP(args)
    assert sum(p.numel() for p in model.parameters()) == args.num_params() == 151_277_313
    assert sum(p.numel() for p in model.visual.parameters()) == 87_849_216
    assert len(model.blocks()) == 24


@pytest.mark.parametrize("flavor, params", [("vit_b16", 149_620_737), ("vit_l14", 427_616_513)])
def test_larger_flavors_match_openai_param_counts(flavor: str, params: int) -> None:
    args = clip_flavors[flavor]
    with torch.device("meta"):
        model = CLIP(args)
    assert sum(p.numel() for p in model.parameters()) == args.num_params() == params


def test_flops_per_sample_matches_flop_counter(debug_model: CLIP, debug_args: CLIPArgs) -> None:
    batch = 2
    images, texts = make_images(batch, debug_args), make_texts(batch, debug_args)
    # The math backend lowers attention to bmm, which FlopCounterMode counts on CPU.
    with sdpa_kernel(SDPBackend.MATH):
        with FlopCounterMode(display=False) as forward:
            image_emb, text_emb, _ = debug_model(images, texts)
        with FlopCounterMode(display=False) as training:
            image_emb, text_emb, _ = debug_model(images, texts)
            (image_emb.sum() + text_emb.sum()).backward()
    analytic = debug_args.flops_per_sample() * batch
    assert forward.get_total_flops() * 3 == analytic
    # The backward skips the patch embedding's input gradient (pixels need none), 0.2% here.
    assert abs(training.get_total_flops() - analytic) <= 0.01 * analytic
    assert debug_args.loss_flops(batch) == 3 * 2 * batch * batch * debug_args.embed_dim


# ---------------------------------------------------------------- CLIP model


def test_forward_shapes_and_unit_norm(debug_model: CLIP, debug_args: CLIPArgs) -> None:
    image_emb, text_emb, _ = debug_model(make_images(3, debug_args), make_texts(3, debug_args))
    assert image_emb.shape == text_emb.shape == (3, debug_args.embed_dim)
    torch.testing.assert_close(image_emb.norm(dim=-1), torch.ones(3))
    torch.testing.assert_close(text_emb.norm(dim=-1), torch.ones(3))
    assert debug_model.encoder_x is debug_model.visual and debug_model.encoder_y is debug_model.text
    torch.testing.assert_close(debug_model.logit_scale, torch.tensor([debug_args.init_logit_scale]))
    assert models.get_model_spec("clip").blocks(debug_model) == debug_model.blocks()
    assert len(debug_model.blocks()) == debug_args.vision_layers + debug_args.text_layers


def test_wrong_input_shapes_raise_one_line(debug_model: CLIP, debug_args: CLIPArgs) -> None:
    bad_inputs = [
        (debug_model.encode_image, torch.randn(2, 3, 28, 28), r"\[B, 1, 28, 28\].*got \[2, 3, 28, 28\]"),
        (debug_model.encode_image, torch.randn(2, 1, 32, 32), r"got \[2, 1, 32, 32\]"),
        (debug_model.encode_text, torch.zeros(2, 16, dtype=torch.long), r"\[B, 32\].*torch.int64 \[2, 16\]"),
        (debug_model.encode_text, torch.zeros(2, 32), r"got torch.float32"),
    ]
    for encode, bad, pattern in bad_inputs:
        with pytest.raises(ValueError, match=pattern) as err:
            encode(bad)
        assert "\n" not in str(err.value)


def test_text_pools_at_eos(debug_model: CLIP, debug_args: CLIPArgs) -> None:
    texts = make_texts(2, debug_args, length=10)
    reference = debug_model.encode_text(texts)
    after_eos = texts.clone()
    after_eos[:, 12] = 7  # a token after EOS: invisible to the causal EOS position
    torch.testing.assert_close(debug_model.encode_text(after_eos), reference, rtol=0, atol=0)
    before_eos = texts.clone()
    before_eos[:, 5] = (before_eos[:, 5] + 1 - 3) % (debug_args.vocab_size - 3) + 3
    assert not torch.allclose(debug_model.encode_text(before_eos), reference)


def test_init_is_deterministic_and_complete_after_meta(debug_args: CLIPArgs) -> None:
    reference_model = CLIP(debug_args)
    torch.manual_seed(1)
    reference_model.init_weights()
    reference = reference_model.state_dict()
    with torch.device("meta"):
        model = CLIP(debug_args)
    model.to_empty(device="cpu")  # uninitialized memory: init_weights must cover every tensor
    torch.manual_seed(1)
    model.init_weights()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, reference[name], rtol=0, atol=0, msg=name)
    model.init_weights(seed=5)
    seeded = {k: v.clone() for k, v in model.state_dict().items()}
    model.init_weights(seed=5)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, seeded[name], rtol=0, atol=0, msg=name)


def test_dropout_is_random_in_train_and_off_in_eval(debug_args: CLIPArgs) -> None:
    torch.manual_seed(0)
    model = CLIP(dataclasses.replace(debug_args, dropout=0.2))
    images = make_images(2, debug_args)
    torch.manual_seed(3)
    first = model.encode_image(images)
    torch.manual_seed(3)
    torch.testing.assert_close(model.encode_image(images), first, rtol=0, atol=0)
    assert not torch.allclose(model.encode_image(images), first)
    model.eval()
    torch.testing.assert_close(model.encode_image(images), model.encode_image(images), rtol=0, atol=0)
    assert not any(isinstance(m, nn.Dropout) for m in CLIP(debug_args).modules())


@pytest.mark.parametrize(("channels", "patch", "height", "width"), [(3, 4, 12, 20), (1, 7, 21, 14), (3, 16, 32, 32)])
def test_patch_embedding_as_one_gemm_is_the_strided_convolution(
    channels: int, patch: int, height: int, width: int
) -> None:
    """The image tower's patch embedding (patchify + F.linear) against nn.functional.conv2d with
    stride = kernel, from its definition: outputs and the gradients of pixels and weight, float64."""
    gen = torch.Generator().manual_seed(0)
    images = torch.randn(2, channels, height, width, dtype=torch.float64, generator=gen, requires_grad=True)
    weight = torch.randn(5, channels, patch, patch, dtype=torch.float64, generator=gen, requires_grad=True)
    probe = torch.randn(2, (height // patch) * (width // patch), 5, dtype=torch.float64, generator=gen)
    ours = torch.nn.functional.linear(patchify(images, patch), weight.flatten(1))
    conv = torch.nn.functional.conv2d(images, weight, stride=patch).flatten(2).transpose(1, 2)
    assert ours.shape == conv.shape
    torch.testing.assert_close(ours, conv, rtol=0, atol=1e-12)
    grads = torch.autograd.grad((ours * probe).sum(), (images, weight))
    expected = torch.autograd.grad((conv * probe).sum(), (images, weight))
    for got, want in zip(grads, expected, strict=True):
        assert want.abs().max() > 0
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
