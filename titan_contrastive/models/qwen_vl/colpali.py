"""ColPali's ColQwen folders (colpali-engine's `ColQwen2`, `ColQwen2_5`, `ColQwen3`): the Qwen-VL base model's
config and weights with the token projection beside them as `custom_text_proj` (a Linear with bias), the tokenizer
and the image processor. colpali-engine runs the base model on the ids (so image tokens get M-RoPE's positions, as
here), projects every token's last hidden state, normalizes it and zeroes the padding: what `[model] pooling =
"colbert"` computes on the qwen_vl family. Its classes fix the width: 128 (ColQwen2, ColQwen2.5), 320 (ColQwen3).

A run reads the projection of a merged ColQwen folder given as `[model] path` (or of a sentence-transformers
MultiVectorEncoder's Dense, a run's `--to sentence-transformers` export, or of transformers' own
`ColQwen2ForRetrieval` folder, vidore's `-hf` ports: its `embedding_proj_layer`, the base model under `vlm.`,
`bi_encoder.folder.WRAPPERS`), and exports `--to colpali` (`export.py`). transformers' folder is read, not written:
its forward runs the language model on embeddings without the ids, so its image tokens get text positions, where
colpali-engine (which trained those weights) and this family give them M-RoPE's.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from titan_contrastive.config import ConfigError

PROJECTION = "custom_text_proj"
HF_PROJECTION = "embedding_proj_layer"
"""transformers' `ColQwen2ForRetrieval`'s name for it."""
CLASSES = {"qwen2_vl": ("ColQwen2", 128), "qwen2_5_vl": ("ColQwen2_5", 128), "qwen3_vl": ("ColQwen3", 320)}
"""colpali-engine's class for a model type, and the width it fixes."""


def _weight_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def read_projection(folder: str) -> dict[str, torch.Tensor]:
    """The folder's `custom_text_proj` (or `embedding_proj_layer`) weight and bias, or a sentence-transformers
    MultiVectorEncoder's Dense (its bias 0 where it has none); {} for a plain Qwen-VL folder. Read without the rest."""
    from safetensors import safe_open

    found: dict[str, torch.Tensor] = {}
    for file in _weight_files(Path(folder)):
        with safe_open(str(file), "pt") as weights:
            for key in weights.keys():  # noqa: SIM118 (safe_open is not a mapping)
                name = key.split(".", 1)
                if name[0] in (PROJECTION, HF_PROJECTION) and len(name) == 2:
                    found[name[1]] = weights.get_tensor(key)
    modules = Path(folder) / "modules.json"
    dense = (
        [m for m in json.loads(modules.read_text()) if m.get("type", "").endswith(".Dense")]
        if modules.is_file()
        else []
    )
    if not found and dense:
        from safetensors.torch import load_file

        state = load_file(str(Path(folder) / dense[0].get("path", "") / "model.safetensors"))
        weight = state["linear.weight"]
        found = {"weight": weight, "bias": state.get("linear.bias", torch.zeros(len(weight), dtype=weight.dtype))}
    return found


def colbert_dim(folder: str, model_type: str, given: int) -> int:
    """A ColQwen's token width: the folder's projection's, else `given`, else colpali-engine's for the model type
    (else 128); ConfigError where `given` is not the folder's."""
    found = read_projection(folder)
    if found:
        width = int(found["weight"].shape[0])
        if given and given != width:
            raise ConfigError(
                f"model.colbert_dim={given}: {folder} projects tokens to {width} (its custom_text_proj); remove the "
                "setting, or start from the Qwen-VL model alone for a new projection"
            )
        return width
    return given or CLASSES.get(model_type, ("", 128))[1]


def projection(width: int, dim: int, folder: str) -> nn.Linear:
    """ColPali's projection from `width` to `dim`: the folder's weights, else new ones (torch's default init)."""
    linear = nn.Linear(width, dim)
    found = read_projection(folder)
    if found:
        try:
            linear.load_state_dict(found)
        except RuntimeError as e:
            raise ConfigError(f"{folder}: its custom_text_proj does not fit its config ({str(e)[:160]})") from None
    return linear


def write_colpali(tower: nn.Module, head: nn.Linear, out: Path) -> None:
    """`tower` (a plain transformers Qwen-VL model) and `head` as a ColQwen folder in `out`: the base model's
    config and weights, `custom_text_proj.*` among them."""
    state = dict(tower.state_dict())
    state.update({f"{PROJECTION}.{k}": v.detach() for k, v in head.state_dict().items()})
    tower.save_pretrained(str(out), state_dict=state)


def reload_colpali(out: Path) -> tuple[nn.Module, nn.Linear]:
    """(the base model, the projection) of a ColQwen folder, loaded as a user without colpali-engine would: the model
    by transformers (which leaves `custom_text_proj` aside), the projection from the weights."""
    from titan_contrastive.models.bi_encoder.tower import load_text_tower

    tower = load_text_tower(str(out)).eval()
    found = read_projection(str(out))
    head = nn.Linear(found["weight"].shape[1], found["weight"].shape[0]).to(found["weight"].dtype)
    head.load_state_dict(found)
    return tower, head
