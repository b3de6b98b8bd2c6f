"""Extract WordNet 3.0 definition <-> lemma pairs into the bundle titan_contrastive/assets/wordnet/.

    apt-get download wordnet-base && dpkg-deb -x wordnet-base_*.deb /tmp/wn
    python scripts/build_wordnet_pairs.py /tmp/wn/usr/share/wordnet

One pair per synset: its gloss up to the first example sentence, and its first lemma (underscores
as spaces, adjective markers such as "(a)" dropped). Each training pair also gets one mined hard
negative, a third column: the first lemma of a sibling synset, drawn with seed 0 (nouns and verbs:
another hyponym of one of its hypernyms; adjectives: another satellite of its head, or the head's
antonym; synsets with no such sibling, mostly adverbs, take a random synset of the same part of
speech). A negative is never the positive's lemma (case-insensitive) nor a test lemma.

Test split: 2,000 synsets, drawn with seed 0 from those whose lemma names no other synset and
whose definition no other synset shares, so each test definition has exactly one right answer
among the test lemmas and neither its lemma nor its definition text occurs in training; the
training split is every other synset. Writes pairs_{train,test}.tsv.gz (train: definition,
lemma, negative; test: definition, lemma) and copies the licence.
"""

from __future__ import annotations

import collections
import gzip
import random
import re
import shutil
import sys
from pathlib import Path
from typing import NamedTuple

OUT = Path(__file__).resolve().parents[1] / "titan_contrastive" / "assets" / "wordnet"
TEST_SIZE = 2000


class Synset(NamedTuple):
    key: str
    """Offset and part of speech ("00001740n"): what pointers name."""
    definition: str
    lemma: str
    pointers: list[tuple[str, str]]
    """(symbol, target key): "@" hypernym, "@i" instance hypernym, "&" similar to, "!" antonym..."""


def synsets(folder: Path) -> list[Synset]:
    found = []
    for pos in ("noun", "verb", "adj", "adv"):
        for line in (folder / f"data.{pos}").read_text(encoding="latin-1").splitlines():
            if line.startswith("  ") or "|" not in line:  # licence header
                continue
            fields, gloss = line.split("|", 1)
            parts = fields.split()
            lemma = re.sub(r"\([a-z]+\)$", "", parts[4]).replace("_", " ")
            definition = re.split(r';\s*"|"', gloss, maxsplit=1)[0].strip().rstrip(";").strip()
            n_words = int(parts[3], 16)
            at = 4 + 2 * n_words
            pointers = [
                (parts[at + 1 + 4 * j], parts[at + 2 + 4 * j] + parts[at + 3 + 4 * j].replace("s", "a"))
                for j in range(int(parts[at]))
            ]
            if definition:
                found.append(Synset(parts[0] + parts[2].replace("s", "a"), definition, lemma, pointers))
    return found


def siblings(found: list[Synset]) -> list[list[int]]:
    """Per synset, the indices of its siblings (see the module docstring), in file order."""
    where = {s.key: i for i, s in enumerate(found)}
    children: dict[str, list[int]] = collections.defaultdict(list)
    for i, s in enumerate(found):
        for symbol, target in s.pointers:
            if symbol in ("@", "@i") or (symbol == "&" and s.key.endswith("a")):
                children[target].append(i)
    out = []
    for i, s in enumerate(found):
        near = [j for symbol, t in s.pointers if symbol in ("@", "@i", "&") for j in children[t]]
        near += [where[t] for symbol, t in s.pointers if symbol in ("&", "!") and t in where]
        out.append(list(dict.fromkeys(j for j in near if j != i)))
    return out


def main(folder: str) -> None:
    found = synsets(Path(folder))
    pairs = [(s.definition, s.lemma) for s in found]
    lemmas = collections.Counter(lemma.lower() for _, lemma in pairs)
    definitions = collections.Counter(d for d, _ in pairs)
    unique = [i for i, (d, lemma) in enumerate(pairs) if lemmas[lemma.lower()] == 1 and definitions[d] == 1]
    test = set(random.Random(0).sample(unique, TEST_SIZE))
    negatives = hard_negatives(found, siblings(found), {pairs[i][1].lower() for i in test})
    OUT.mkdir(parents=True, exist_ok=True)
    for split, keep in (("train", lambda i: i not in test), ("test", lambda i: i in test)):
        rows = [
            f"{d}\t{lemma}\t{negatives[i]}" if split == "train" else f"{d}\t{lemma}"
            for i, (d, lemma) in enumerate(pairs)
            if keep(i)
        ]
        with gzip.GzipFile(OUT / f"pairs_{split}.tsv.gz", "wb", mtime=0) as f:
            f.write(("\n".join(rows) + "\n").encode("utf-8"))
        print(f"{split}: {len(rows)} pairs")
    licence = Path(folder).parent / "doc" / "wordnet-base" / "copyright"
    if licence.exists():
        shutil.copy(licence, OUT / "LICENSE")


def hard_negatives(found: list[Synset], near: list[list[int]], test_lemmas: set[str]) -> list[str]:
    """One negative lemma per synset: a random sibling's, else a random same-part-of-speech one."""
    rng = random.Random(0)
    by_pos: dict[str, list[int]] = collections.defaultdict(list)
    for i, s in enumerate(found):
        by_pos[s.key[-1]].append(i)

    def usable(i: int, j: int) -> bool:
        lemma = found[j].lemma.lower()
        return lemma != found[i].lemma.lower() and lemma not in test_lemmas

    out, counts = [], collections.Counter()
    for i, s in enumerate(found):
        choices = [j for j in near[i] if usable(i, j)]
        counts["sibling" if choices else "random"] += 1
        while not choices:
            j = rng.choice(by_pos[s.key[-1]])
            choices = [j] if usable(i, j) else []
        out.append(found[rng.choice(choices)].lemma)
    print(f"hard negatives: {counts['sibling']} siblings, {counts['random']} random same-POS")
    return out


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/usr/share/wordnet")
