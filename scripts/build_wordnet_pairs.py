"""Extract WordNet 3.0 definition <-> lemma pairs into the bundle titan_contrastive/assets/wordnet/.

    apt-get download wordnet-base && dpkg-deb -x wordnet-base_*.deb /tmp/wn
    python scripts/build_wordnet_pairs.py /tmp/wn/usr/share/wordnet

One pair per synset: its gloss up to the first example sentence, and its first lemma (underscores
as spaces, adjective markers such as "(a)" dropped). Test split: 2,000 synsets, drawn with seed 0
from those whose lemma names no other synset and whose definition no other synset shares, so
each test definition has exactly one right answer among the test lemmas and neither its lemma
nor its definition text occurs in training; the training split is every other synset. Writes
pairs_{train,test}.tsv.gz and copies the licence.
"""

from __future__ import annotations

import collections
import gzip
import random
import re
import shutil
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "titan_contrastive" / "assets" / "wordnet"
TEST_SIZE = 2000


def synsets(folder: Path) -> list[tuple[str, str]]:
    pairs = []
    for pos in ("noun", "verb", "adj", "adv"):
        for line in (folder / f"data.{pos}").read_text(encoding="latin-1").splitlines():
            if line.startswith("  ") or "|" not in line:  # licence header
                continue
            fields, gloss = line.split("|", 1)
            parts = fields.split()
            lemma = re.sub(r"\([a-z]+\)$", "", parts[4]).replace("_", " ")
            definition = re.split(r';\s*"|"', gloss, maxsplit=1)[0].strip().rstrip(";").strip()
            if definition:
                pairs.append((definition, lemma))
    return pairs


def main(folder: str) -> None:
    pairs = synsets(Path(folder))
    lemmas = collections.Counter(lemma.lower() for _, lemma in pairs)
    definitions = collections.Counter(d for d, _ in pairs)
    unique = [i for i, (d, lemma) in enumerate(pairs) if lemmas[lemma.lower()] == 1 and definitions[d] == 1]
    test = set(random.Random(0).sample(unique, TEST_SIZE))
    OUT.mkdir(parents=True, exist_ok=True)
    for split, keep in (("train", lambda i: i not in test), ("test", lambda i: i in test)):
        rows = [f"{d}\t{lemma}" for i, (d, lemma) in enumerate(pairs) if keep(i)]
        with gzip.GzipFile(OUT / f"pairs_{split}.tsv.gz", "wb", mtime=0) as f:
            f.write(("\n".join(rows) + "\n").encode("utf-8"))
        print(f"{split}: {len(rows)} pairs")
    licence = Path(folder).parent / "doc" / "wordnet-base" / "copyright"
    if licence.exists():
        shutil.copy(licence, OUT / "LICENSE")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/usr/share/wordnet")
