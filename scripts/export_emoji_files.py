"""Write the bundled emoji as ordinary files, the shape a user's own data has, for the README walkthrough.

    python scripts/export_emoji_files.py --out mydata

writes `mydata/images/<id>.png` (32x32 RGB), `mydata/train.csv` and `mydata/val.csv` (tab-separated,
columns `filepath` and `title` as open_clip's --csv-img-key / --csv-caption-key defaults; the
bundled train / test split), and `mydata/zero_shot/<category>/<id>.png`: the held-out emoji sorted
into their Unicode categories ("smileys_and_emotion", "flags", ...), an ImageFolder for zero-shot
classification. Any CSV of image paths and captions can take the place of these files.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import numpy as np
from PIL import Image

from titan_contrastive.datasets.emoji import BUNDLE_FILE, split_ids


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder to write (created)")
    args = parser.parse_args(argv)
    with np.load(BUNDLE_FILE) as npz:
        images, names, categories = npz["images"], [str(n) for n in npz["names"]], [str(c) for c in npz["categories"]]
    (args.out / "images").mkdir(parents=True, exist_ok=True)
    for split, file in (("train", "train.csv"), ("test", "val.csv")):
        with open(args.out / file, "w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f, delimiter="\t", lineterminator="\n")
            writer.writerow(["filepath", "title"])
            for i in split_ids(len(images), split).tolist():
                path = Path("images") / f"{i:04d}.png"
                Image.fromarray(images[i]).save(args.out / path)
                writer.writerow([path.as_posix(), names[i]])
                if split == "test":
                    folder = args.out / "zero_shot" / categories[i].lower().replace(" & ", "_and_").replace(" ", "_")
                    folder.mkdir(parents=True, exist_ok=True)
                    Image.fromarray(images[i]).save(folder / path.name)
    print(
        f"wrote {len(images)} emoji to {args.out}: train.csv, val.csv, zero_shot/ ({len(set(categories))} categories)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
