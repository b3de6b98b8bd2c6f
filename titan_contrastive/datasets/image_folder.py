"""Zero-shot classification on the user's images: an ImageFolder-layout folder as a `ZeroShotDataset`.

`root/<class>/<image>`: one sub-folder per class, sorted by name (torchvision's ImageFolder
convention, so class i is the i-th folder). Class names are the folder names with underscores as
spaces, or the lines of a names file (one per class, in the same order). The classifier averages
each class's text embedding over the prompt templates (`openai`: CLIP's 80 ImageNet prompts;
`simple`: open_clip's short list; or a file). Images get the eval transform (central crop); an
image that does not decode stops the evaluation with its path (an eval set should be clean).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from titan_contrastive.datasets.base import DataError
from titan_contrastive.datasets.image_transforms import Normalize, decode_crop_resize, decode_image
from titan_contrastive.datasets.naflex import NaFlexImages
from titan_contrastive.datasets.packed_rows import PackedRows
from titan_contrastive.datasets.sources import IMAGE_EXTENSIONS
from titan_contrastive.datasets.tar_shards import read_regular

PROMPTS = Path(__file__).resolve().parents[1] / "assets" / "prompts"


def load_templates(spec: str) -> list[str]:
    """`openai`, `simple`, or a file of templates (one per line, each with `{}`)."""
    file = PROMPTS / f"{spec}.txt" if spec in ("openai", "simple") else Path(spec).expanduser()
    if not file.is_file():
        raise DataError(
            f"eval.zero_shot_templates={spec!r}: not 'openai', 'simple' or a file; give a text file with one template "
            "per line"
        )
    templates = [line.strip() for line in file.read_text(encoding="utf-8-sig").splitlines() if line.strip()]
    bad = [t for t in templates if t.count("{}") != 1]
    if not templates or bad:
        raise DataError(
            f"{file}: every template needs exactly one '{{}}' for the class name (first bad: "
            f"{bad[0] if bad else 'none given'!r})"
        )
    return templates


class ImageFolderZeroShot:
    """A `datasets.protocol.ZeroShotDataset`: image [B,3,S,S], text (each image's class under the
    first template, for the eval loss), label, index."""

    def __init__(
        self, root: str, *, names_file: str, templates: Sequence[str], tokenizer: Any, image_size: int
    ) -> None:
        folder = Path(root).expanduser()
        if not folder.is_dir():
            raise DataError(
                f"eval.zero_shot_path={root}: no such folder; give a folder with one sub-folder of images per class"
            )
        classes = sorted(p.name for p in folder.iterdir() if p.is_dir())
        paths: list[str] = []
        labels: list[int] = []
        for label, name in enumerate(classes):
            files = sorted(p for p in (folder / name).rglob("*") if p.suffix.lower().lstrip(".") in IMAGE_EXTENSIONS)
            paths += map(str, files)
            labels += [label] * len(files)
        if len(classes) < 2 or not paths:
            raise DataError(
                f"eval.zero_shot_path={root}: {len(classes)} class folder(s) with {len(paths)} images; "
                "zero-shot classification needs at least 2 class sub-folders of images"
            )
        self._files = PackedRows(paths)
        """Each image's path (shared by forked data workers, not copied: `packed_rows`)."""
        self.class_names = [name.replace("_", " ") for name in classes]
        if names_file:
            try:
                text = read_regular(Path(names_file).expanduser()).decode("utf-8-sig")
            except (OSError, UnicodeDecodeError) as e:
                raise DataError(
                    f"eval.zero_shot_names={names_file}: not a readable UTF-8 text file ({e}); give one class name "
                    "per line"
                ) from None
            names = [line.strip() for line in text.splitlines() if line.strip()]
            if len(names) != len(classes):
                raise DataError(
                    f"eval.zero_shot_names={names_file}: {len(names)} names for {len(classes)} class folders in "
                    f"{root}; give one name per line, in sorted folder order"
                )
            self.class_names = names
        self.name, self.split, self.source, self.full = "zero_shot", "test", str(folder), True
        self.templates = list(templates)
        self.tokenizer = tokenizer
        self.image_shape: tuple[int, int, int] = (3, image_size, image_size)
        self.recall_ks, self.recall_direction = (1, 5), "image_to_text"
        self.labels = torch.tensor(labels, dtype=torch.long)
        self._normalize = Normalize()
        self._naflex: NaFlexImages | None = None
        self._whole, self._mode = False, "bicubic"  # `resize`

    def __len__(self) -> int:
        return len(self._files)

    def set_epoch(self, epoch: int) -> None:
        """Deterministic: the eval transform has no randomness."""

    def resize(self, size: int, *, whole: bool = False, mode: str = "bicubic") -> None:
        """Serve size x size images resized with `mode`: each one's central square, or with `whole` the whole
        image squashed (a model folder's processor: hf_clip)."""
        self.image_shape = (3, size, size)
        self._whole, self._mode = whole, mode

    def normalize_as(self, mean: Sequence[float], std: Sequence[float]) -> None:
        """Normalize with a model folder's image statistics (hf_clip) instead of OpenAI's."""
        self._normalize = Normalize(mean, std)

    def serve_naflex(self, naflex: NaFlexImages) -> None:
        """Serve `image` as SigLIP 2's NaFlex patches of each whole image (`datasets.naflex`)."""
        self._naflex = naflex

    def _image(self, i: int, size: int) -> Any:
        data = read_regular(self._files[i])
        if self._naflex is None:
            return decode_crop_resize(data, size, train=False, whole=self._whole, mode=self._mode)
        image = decode_image(data)
        return self._naflex.sample(image, (0, 0, *image.size), self._normalize)

    def __getitems__(self, indices: Sequence[int]) -> dict[str, Any]:
        size = self.image_shape[-1]
        images = []
        for i in indices:
            try:
                images.append(self._image(i, size))
            except (OSError, ValueError, SyntaxError) as e:
                raise DataError(
                    f"{self._files[i]}: not a readable image ({type(e).__name__}: {e}); remove it from the "
                    "zero-shot folder"
                ) from None
        idx = torch.as_tensor(list(indices), dtype=torch.long)
        labels = self.labels[idx]
        text = self.encode_text([self.templates[0].format(self.class_names[c]) for c in labels.tolist()])
        if self._naflex is not None:
            image = self._naflex.batch(images)
        else:
            image = self._normalize(np.stack(images) if images else np.empty((0, size, size, 3), dtype=np.uint8))
        return {"image": image, "text": text, "label": labels, "index": idx}

    def encode_text(self, texts: list[str]) -> torch.Tensor:
        return self.tokenizer.encode(texts)
