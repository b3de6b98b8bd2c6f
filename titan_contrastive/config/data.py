"""The `[data]` section: which data, where it is, and how samples are decoded, tokenized and served."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from titan_contrastive.config.fields import opt

__all__ = ["Data", "RetrievalMode"]

RetrievalMode = Literal["t2i", "i2t", "i2i", "t2t", "m2i", "m2t", "t2m", "i2m", "m2m"]


@dataclass
class Data:
    dataset: Literal[
        "fashion_mnist", "emoji", "wordnet", "csv", "webdataset", "hf", "pairs", "vl_pairs", "synthetic"
    ] = "fashion_mnist"
    """Bundled: `fashion_mnist` (image-caption, zero-shot eval), `emoji` (image <-> name), `wordnet`
    (definition <-> lemma, bi_encoder). Yours: `csv` (image paths + captions), `webdataset` (tar shards),
    `hf` (a Hugging Face dataset on disk) for clip; `pairs` (JSONL/CSV/TSV/Parquet/HF text pairs) for
    bi_encoder; `vl_pairs` (rows query_image, query_text, doc_image, doc_text) for qwen_vl. `synthetic`:
    generated image-caption JPEGs (`synthetic_samples` of them) for speed runs (clip)."""
    synthetic_samples: int = opt(65536, lambda v: v >= 1, "an integer >= 1")
    """synthetic: samples per epoch (every one decoded, cropped and tokenized like your own data)."""
    path: str = ""
    """Training data. Bundled sets: a folder (empty = the Debian package if installed, else the bundle).
    csv: the file. webdataset: tars as a brace pattern (`shards/{00000..00099}.tar`) or make_shards'
    `shards.json`. hf: a save_to_disk folder or a Parquet/JSON/Arrow/CSV file. pairs: a .jsonl/.json/.csv/.tsv (each
    also compressed: .jsonl.gz, .bz2, .xz, .zst)/.parquet/.arrow file or a save_to_disk folder. Several of one kind
    (csv, webdataset, hf, pairs, vl_pairs): `::`."""
    val_path: str = ""
    """Held-out data for evaluation (retrieval recall@1/5/10 both ways, or pair recall@1/10), of
    the same kind as `dataset`, except that a .csv/.tsv file is always read as csv; empty = no
    retrieval eval for your own data (the bundled sets bring their test split)."""
    upsampling_factors: list[float] = opt([], lambda v: all(x > 0 for x in v), "a list of numbers > 0")
    """One factor per `::`-joined source of the training data: source i gives round(factor x its size)
    samples per epoch (open_clip's --train-data-upsampling-factors); empty = 1 each."""
    same_source_batches: bool = False
    """With several `::`-joined sources: each optimizer step's global batch comes from one source, the
    sources drawn in proportion to the steps they fill per epoch, so a query's in-batch negatives come
    from its own dataset (sentence-transformers' proportional multi-dataset batches); a source's
    remainder of a whole step is left out of that epoch (another part each epoch)."""
    query_prompts: list[str] = opt([], None)
    """pairs: one prompt per `::`-joined source of `path`, prepended to its queries in place of model.query_prompt
    (a task's instruction), "" = none; vl_pairs: one template per source ("" = the model's). Evaluation keeps
    model.query_prompt. Empty = model.query_prompt for every source."""
    doc_prompts: list[str] = opt([], None)
    """pairs, vl_pairs: the same for each source's documents and hard negatives; empty = model.doc_prompt."""
    image_root: str = ""
    """csv and vl_pairs: the folder that the files' relative image paths start from (VLM2Vec's `image_dir`, for
    annotations kept apart from their images); empty = each file's own folder."""
    image_cache: str = ""
    """vl_pairs: the folder the images held in the files' cells (a Parquet file's Hugging Face Image column, or
    encoded bytes) are written to once, each named by the SHA-1 of its bytes; empty = titan_contrastive/images in
    $XDG_CACHE_HOME, else ~/.cache."""
    csv_img_key: str = "filepath"
    """csv: column of image paths (relative paths resolve against `image_root`, else the CSV's folder)."""
    csv_caption_key: str = "title"
    """csv: column of captions."""
    csv_separator: str = "\t"
    """csv: the column separator (open_clip's default is a tab)."""
    csv_negative_keys: list[str] = opt([], None)
    """csv: columns of negative captions, one per column (hard negatives of the image); empty = none."""
    wds_image_key: str = "jpg;jpeg;png;webp"
    """webdataset: the image member's extensions, tried in order."""
    wds_caption_key: str = "txt"
    """webdataset: the caption member's extension, or `json:<field>` for a field of the sample's .json."""
    wds_negative_key: str = ""
    """webdataset: negative captions, `json:<field>` (a list in the sample's .json) or a member's
    extension whose text holds one caption per line; empty = none."""
    hf_image_column: str = "image"
    """hf: the column of images (an Image feature, bytes, or paths)."""
    hf_text_column: str = "text"
    """hf: the column of captions."""
    hf_negative_columns: list[str] = opt([], None)
    """hf: string columns of negative captions, or one column holding a list of them; empty = none."""
    pairs_columns: list[str] = opt([], lambda v: len(v) != 1, "empty or at least two column names")
    """pairs: the columns (query, positive, negatives...) of the rows; empty = the row's columns in
    order (sentence-transformers' convention: anchor, positive, then negatives; an `id` column is
    the positive's id, label/score columns are teacher scores for loss.distill)."""
    pairs_id_column: str = "id"
    """pairs: the column holding the id of each row's positive document, used by loss.mask_duplicates
    instead of the token ids (a negative whose text is a positive's gets that id); empty = none."""
    corpus: str = ""
    """pairs: a file of documents by id (tevatron's corpus: `docid`, `text`[, `title`] rows; BEIR's `_id`; MS MARCO's
    collection.tsv), which the rows' documents then name by id (tevatron's `positive_document_ids`,
    `negative_document_ids`); only the documents the rows name are kept. vl_pairs: `docid`, `image`, `text` rows (an
    image, a text or both). Empty = the rows hold their documents."""
    hard_negatives: bool = True
    """Serve the data's hard negatives (a pairs file's extra columns, WordNet's mined negative, the
    negative captions of csv/webdataset/hf); false = in-batch negatives only."""
    negatives_per_row: int = opt(0, lambda v: v >= 0, "an integer >= 0")
    """pairs, vl_pairs: k >= 1 serves k of each row's hard negatives (and one of its positives) per epoch, drawn by
    the seed, the row and the epoch (tevatron's and FlagEmbedding's train_group_size - 1): rows may then hold any
    number of negatives and a list of positives (`{"query", "pos": [...], "neg": [...]}`); 0 = rows served whole."""
    in_batch_negatives: list[bool] = opt([], None)
    """pairs, vl_pairs: one per `::`-joined source of `path`; false scores that source's queries against their own
    positive and hard negatives only, not the batch's other documents (FlagEmbedding's `no_in_batch_neg` files:
    classification and clustering data, whose other rows are often of the same class). Empty = true for every
    source."""
    tokenizer: Literal["auto", "byte", "clip_bpe"] = "auto"
    """Caption tokenizer of image-text data: `byte` (UTF-8 bytes, the bundled sets' default) or
    `clip_bpe` (CLIP's 49,408-token BPE, context 77 as in CLIP; auto = clip_bpe for your own data)."""
    max_bad_fraction: float = opt(0.001, lambda v: 0 <= v <= 1, "a fraction in [0, 1]")
    """Undecodable images, missing captions and unreadable files or shards are skipped, counted and
    logged; past this fraction of the samples loaded (at least one epoch's worth) the run stops."""
    pixels_on_device: bool = True
    """On a GPU, images decoded from files (csv, webdataset, hf, synthetic) leave the loader as uint8
    and are normalized on the device (a quarter of the bytes to pin and copy); false: float32 from the workers."""
    num_workers: int = opt(0, lambda v: v >= 0, "an integer >= 0")
    """DataLoader worker processes (0 loads in the training process; right for the in-memory
    bundled sets; 2 or more for your own data, which is decoded per sample)."""
    context_length: int = opt(0, lambda v: v == 0 or v >= 4, "0 (the tokenizer's default) or an integer >= 4")
    """Text tokens per caption, start and end tokens included; 0 = 32 for the byte tokenizer and
    the pairs' queries, 77 for clip_bpe, the folder's positions for hf_clip (SigLIP: exactly those)."""
    doc_context_length: int = opt(0, lambda v: v == 0 or v >= 4, "0 (the model's default) or an integer >= 4")
    """Text pairs: tokens per document (context_length is the queries'); 0 = the model folder's max_seq_length
    (512 at most), 16 for the bundled MiniLM."""
    augment: bool = True
    """Per-sample augmentation in the train split (a pure function of seed, epoch and index): flips
    of the bundled images, random-resized crops of your own."""
    image_size: int = opt(0, lambda v: v >= 0, "0 (native size) or a size in pixels")
    """0 = the dataset's native size (224 for your own data; hf_clip: its folder's size; another multiple of
    its patch resizes its position table); N = images resized to N x N, e.g. 224 for clip/vit_b32 (patch 32)
    on the 28x28 Fashion-MNIST."""
    image_sizes: list[int] = opt([], lambda v: all(x >= 1 for x in v), "a list of sizes in pixels, each >= 1")
    """Mixed resolutions (model.name=vlm or vae): each image is served at one of these square sizes
    (train: drawn per sample and epoch; test: cycled), as Qwen-VL-style packed patches (vlm) or
    zero-padded with a pixel mask (vae). Empty = one size (image_size or native)."""
    retrieval_mode: RetrievalMode = "t2i"
    """qwen_vl: each side's kind, t (text), i (image) or m (an image and a text): t2i (texts query images), i2t, i2i,
    t2t, m2i, m2t, t2m, i2m, m2m; image-text data trains t2i and i2t, the others need data.dataset = "vl_pairs".
    With retrieval_modes, the mode of evaluation (val_path) and of the exported model."""
    retrieval_modes: list[str] = opt(
        [],
        lambda v: set(v) <= {*get_args(RetrievalMode), "auto"},
        f"a list of {', '.join(get_args(RetrievalMode))} or auto",
    )
    """vl_pairs: one retrieval mode per `::`-joined source of `path` (MMEB's tasks: VQA in m2t beside retrieval in t2i,
    ...); a batch mixes the sources' rows, each of its own mode, unless same_source_batches (a step one source's); a
    t2t source joins no other mode. "auto": the mode the source's first rows hold (texts, images or both on each
    side); ["auto"] alone: every source's. Empty = retrieval_mode for every source."""
    min_pixels: int = opt(0, lambda v: v >= 0, "an integer >= 0")
    """qwen_vl: images resized to at least this many pixels; 0 = the model folder's image processor's."""
    max_pixels: int = opt(0, lambda v: v >= 0, "an integer >= 0")
    """qwen_vl: and to at most this many (visual tokens = pixels / (14·2)² for Qwen2-VL); 0 = the folder's."""
