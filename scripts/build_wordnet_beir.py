"""Build titan_contrastive/assets/wordnet_beir: a small BEIR-format retrieval set from the WordNet bundle.

Queries: the 2,000 held-out test definitions (`q0`..). Corpus: their 2,000 lemmas (`t0`..., each
the one relevant document of its definition, grade 1) and 3,000 distractor lemmas (`d0`...) drawn
with a fixed seed from the training lemmas that are no test lemma (case-insensitive, distinct).
Every lemma is a document's text; no title. Deterministic: running it again writes the same bytes.

    python scripts/build_wordnet_beir.py
"""

from __future__ import annotations

import json
import random

from titan_contrastive.datasets.wordnet import BUNDLE_DIR, load_pairs

OUT = BUNDLE_DIR.parent / "wordnet_beir"
DISTRACTORS = 3000
SEED = 0


def main() -> None:
    test_defs, test_lemmas = load_pairs(BUNDLE_DIR, "test")
    _, train_lemmas = load_pairs(BUNDLE_DIR, "train")
    taken = {lemma.lower() for lemma in test_lemmas}
    pool = sorted({lemma for lemma in train_lemmas if lemma.lower() not in taken}, key=lambda x: (x.lower(), x))
    seen: set[str] = set()
    unique = [x for x in pool if not (x.lower() in seen or seen.add(x.lower()))]
    distractors = random.Random(SEED).sample(unique, DISTRACTORS)
    (OUT / "qrels").mkdir(parents=True, exist_ok=True)
    with open(OUT / "queries.jsonl", "w", encoding="utf-8") as f:
        for i, text in enumerate(test_defs):
            f.write(json.dumps({"_id": f"q{i}", "text": text}, ensure_ascii=False) + "\n")
    with open(OUT / "corpus.jsonl", "w", encoding="utf-8") as f:
        for i, text in enumerate(test_lemmas):
            f.write(json.dumps({"_id": f"t{i}", "title": "", "text": text}, ensure_ascii=False) + "\n")
        for i, text in enumerate(distractors):
            f.write(json.dumps({"_id": f"d{i}", "title": "", "text": text}, ensure_ascii=False) + "\n")
    with open(OUT / "qrels" / "test.tsv", "w", encoding="utf-8") as f:
        f.write("query-id\tcorpus-id\tscore\n")
        for i in range(len(test_defs)):
            f.write(f"q{i}\tt{i}\t1\n")
    print(f"wrote {OUT}: {len(test_defs)} queries, {len(test_lemmas) + len(distractors)} documents")


if __name__ == "__main__":
    main()
