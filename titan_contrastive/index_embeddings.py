"""`python -m titan_contrastive.index_embeddings FILE [FILE ...]`: a teacher file's index, written beside it as
FILE.index (`datasets/frozen_index.py`), so that every rank of a run reading FILE as `[loss] teacher_embeddings` or
`guide_embeddings` maps where each text's row is, instead of hashing every key of the file and checking every vector.

`python -m titan_contrastive.embed` and `embed_images` write the index with the file (`embed.write_rows`); this is
for a .parquet or .arrow file written by anything else (an embedding API, another framework), or one changed since
its index was written (the run says so). FILE is read and checked as a run reads it whole (`frozen.EmbeddingTable`),
then its index is written under a temporary name and renamed when complete. A bad file is one `error: ...` line and
exit code 2, with no index written. Needs the `data` extra.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from titan_contrastive.datasets.base import DataError
from titan_contrastive.datasets.frozen import EmbeddingTable
from titan_contrastive.datasets.frozen_index import Saved, index_path, save
from titan_contrastive.extras import import_failure

FORMATS = (".parquet", ".arrow")
"""What an index is written for: a .jsonl file is read whole into each process anyway."""


def write_index(file: Path) -> Saved:
    """Read and check `file` as a run reads it whole, and write its index beside it (`frozen_index`); a DataError
    writes nothing."""
    saved = EmbeddingTable.read(str(file), "FILE", indexed=False).saved()
    save(file, saved, file)
    return saved


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m titan_contrastive.index_embeddings", description=__doc__.split("\n")[0])
    p.add_argument("files", metavar="FILE", nargs="+", help="a .parquet or .arrow file of embeddings")
    opts = p.parse_args(argv)
    files = [Path(name).expanduser() for name in opts.files]
    for name, file in zip(opts.files, files):  # all of them before any is read
        if file.suffix not in FORMATS or not file.is_file():
            print(f"error: FILE={name}: not an existing {' or '.join(FORMATS)} file of embeddings", file=sys.stderr)
            return 2
    for file in files:
        try:
            saved = write_index(file)
        except ImportError as e:
            print(f"error: {import_failure(e, 'indexing embeddings', 'data')}", file=sys.stderr)
            return 2
        except (OSError, DataError) as e:
            print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
            return 2
        sides = ", ".join(sorted(side or "no side" for side in saved.index.sides))
        print(f"wrote {index_path(file)}: {len(saved.index.rows)} keys ({sides}) of {saved.rows} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
