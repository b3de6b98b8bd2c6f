"""The `[eval]` section: when the run evaluates, on what (its held-out split, zero-shot classes, BEIR folders, STS,
reranking, clustering, pair classification, triplet, classification and MMEB sets) and how (cuts, pooling,
precisions, early stopping)."""

from __future__ import annotations

from dataclasses import dataclass

from titan_contrastive.config.fields import opt, positive

__all__ = ["EVAL_SETS", "Eval", "EvalSet"]


@dataclass(frozen=True)
class EvalSet:
    """A kind of evaluation set: `[eval] {name}_path` names one, its metrics' keys begin `{name}/`."""

    name: str
    kind: str
    """How a message calls one ("a BEIR")."""
    flag: str
    """`python -m titan_contrastive.evaluate`'s option for one."""
    task: str
    """Its task in a model card's results (sentence-transformers' names for its evaluators' tasks)."""
    one_vector: bool = True
    """It compares one vector per text (or per image): not for a late-interaction model's token sets."""
    text_documents: bool = False
    """Its documents are texts: not for a model whose documents are images."""


EVAL_SETS = (
    EvalSet("beir", "a BEIR", "--beir", "information-retrieval", one_vector=False),  # MaxSim too, and page corpora
    EvalSet("sts", "an STS", "--sts", "semantic-similarity"),
    EvalSet("reranking", "a reranking", "--reranking", "reranking", text_documents=True),
    EvalSet("clustering", "a clustering", "--clustering", "clustering"),
    EvalSet("pair_classification", "a pair classification", "--pair-classification", "binary-classification"),
    EvalSet("triplet", "a triplet", "--triplets", "triplet", text_documents=True),
    EvalSet("classification", "a classification", "--classification", "text-classification"),
    EvalSet("mmeb", "an MMEB", "--mmeb", "information-retrieval"),
)
"""The evaluation sets besides the run's own split and zero-shot classes, each read by its component
(`components/*_eval.py`); the checks that name them all read this table."""


@dataclass
class Eval:
    enable: bool = True
    """Evaluate at all (every `freq` steps and after the last step)."""
    freq: int = opt(0, lambda v: v >= 0, "an integer >= 0 (0 = only after the last step)")
    """Evaluate every this many steps (and always after the last step)."""
    every_epoch: bool = False
    """Evaluate after each epoch's last step (the optimizer step holding its last batch), in place of `freq`."""
    batch_size: int = positive(500)
    """Images per evaluation batch; the eval loss is the mean over consecutive batches of this size."""
    patience: int = opt(0, lambda v: v >= 0, "an integer >= 0 (0 = never stop early)")
    """Stop the run after this many evaluations in a row without checkpoint.keep_best's metric improving."""
    patience_threshold: float = opt(0.0, lambda v: v >= 0, "a number >= 0")
    """The least change of that metric that counts as improving (Hugging Face's early_stopping_threshold)."""
    zero_shot_path: str = ""
    """Zero-shot classification on an ImageFolder-layout folder (one sub-folder of images per
    class), as well as the run's own evaluation; empty = none."""
    zero_shot_names: str = ""
    """A text file of class names, one per line in sorted sub-folder order; empty = the folder
    names (underscores as spaces)."""
    zero_shot_templates: str = "openai"
    """Prompt templates: `openai` (CLIP's 80 ImageNet prompts, as open_clip), `simple` (open_clip's
    short list), or a text file with one template per line, each with `{}` for the class name."""
    beir_path: str = ""
    """Text pairs and qwen_vl (t2i, t2t): also retrieval on a BEIR folder (corpus.jsonl, queries.jsonl, qrels/; a
    corpus of page images; ViDoRe's sets saved to disk), embedded once across the ranks: nDCG@5/10, MRR@10,
    MAP@100, Recall@1/5/10/100 (keys `beir/...`); `bundled` = the WordNet set in assets/wordnet_beir; empty = none."""
    beir_split: str = "test"
    """Which qrels split of `beir_path` (qrels/{split}.tsv; a saved DatasetDict's split). Several, separated by commas,
    or `*` for every one (NanoBEIR's 13 sets): each set's keys `beir/{split}/...`, and `beir/...` their mean."""
    beir_graded: bool = False
    """nDCG with the qrels' grades as gains (pytrec_eval's, as MTEB and ViDoRe report it); off = binary relevance,
    as sentence-transformers' InformationRetrievalEvaluator."""
    beir_pool_factor: float = opt(1.0, lambda v: 1 <= v < float("inf"), "a number >= 1 (1 = no pooling)")
    """Late interaction (ColBERT, ColQwen): each BEIR document's tokens pooled to about 1 / this many (Ward clusters'
    means, sentence-transformers' HierarchicalTokenPooling), the index PyLate and colpali-engine build with a pool
    factor; `beir/corpus_tokens` reports the tokens a document keeps. 1 = every token."""
    beir_pool_protected: int = opt(1, lambda v: v >= 0, "an integer >= 0")
    """The first tokens of each document kept out of the pooling (1: ColBERT's [CLS]; 0 as colpali-engine pools)."""
    beir_precisions: list[str] = opt([], lambda v: set(v) <= {"int8", "ubinary"}, "a list of 'int8', 'ubinary'")
    """One dense vector per text: also BEIR's metrics with the corpus quantized to each precision (keys
    `{precision}/beir/...`, at each `dims` cut too), searched as sentence-transformers' embedding quantization does
    (`quantize_embeddings`, `semantic_search_usearch`: the float queries rescore the 2 x k best; needs usearch, in
    .[hf]): `int8` (4x smaller than float32), `ubinary` (the signs, 32x smaller)."""
    sts_path: str = ""
    """Text pairs: also semantic similarity on scored sentence pairs (STS-B's `sentence1`, `sentence2`, `score`, or
    three columns in that order; .jsonl/.csv/.tsv/.parquet or a saved dataset), embedded once across the ranks,
    both sentences through the query side: Pearson and Spearman correlation of their cosine with the score, as
    sentence-transformers' EmbeddingSimilarityEvaluator (keys `sts/pearson_cosine`, `sts/spearman_cosine`)."""
    sts_split: str = "test"
    """Which split of a saved DatasetDict `sts_path` reads."""
    reranking_path: str = ""
    """Text queries: also reranking, each query against its own candidates (rows of `query`, `positive`, `negative`,
    as sentence-transformers' RerankingEvaluator and MTEB's reranking tasks hold them; .jsonl/.json/.parquet or a saved
    dataset's `reranking_split`), by cosine: MAP, MRR@10, nDCG@10 (keys `reranking/...`); empty = none."""
    reranking_split: str = "test"
    clustering_path: str = ""
    """Text queries: also clustering, as MTEB measures it (rows of `sentences` and their `labels`; .jsonl/.json/.parquet
    or a saved dataset's `clustering_split`): each row's embeddings by k-means into as many clusters as labels, the
    V-measure averaged over the rows (key `clustering/v_measure`); empty = none."""
    clustering_split: str = "test"
    pair_classification_path: str = ""
    """Text queries: also pair classification, as sentence-transformers' BinaryClassificationEvaluator (rows of
    `sentence1`, `sentence2`, a 0/1 `label`, or MTEB's lists), by cosine (keys `pair_classification/cosine_ap`, ...)."""
    pair_classification_split: str = "test"
    triplet_path: str = ""
    """Text queries: also triplet accuracy, as sentence-transformers' TripletEvaluator (rows of `anchor`, `positive`,
    `negative`): the share whose anchor is nearer its positive by cosine (key `triplet/cosine_accuracy`)."""
    triplet_split: str = "test"
    classification_path: str = ""
    """Text queries: also classification, as MTEB measures it (a folder of `train` and `test` tables of `text` and
    `label` rows, .jsonl/.json/.csv/.parquet, or a saved DatasetDict): a logistic regression fit on
    `classification_per_label` train rows of each label, 10 times, labels the test rows: accuracy, F1, precision and
    recall (macro and weighted), AP with two labels, the means (keys `classification/...`)."""
    classification_split: str = "test"
    """The split `classification_path` labels (the classifier is fit on its `train` split)."""
    classification_per_label: int = positive(8)
    """Train rows per label each of the 10 fits takes (MTEB's samples_per_label)."""
    mmeb_path: str = ""
    """qwen_vl: also MMEB's evaluation (VLM2Vec's MMEB-eval rows `qry_text`, `qry_img_path`, `tgt_text`,
    `tgt_img_path`: each query against its own candidates, the right one first), a set's file or a folder of them
    (the hub's layout), each set in the retrieval mode its items hold: the share of queries whose best candidate is the
    right one (key `mmeb/hit@1`; several sets: `mmeb/{set}/hit@1` and `mmeb/hit@1` their mean); empty = none."""
    mmeb_image_root: str = ""
    """The folder `mmeb_path`'s image paths are relative to (where MMEB-eval's images were unpacked, VLM2Vec's
    `image_dir`); empty = each file's folder."""
    dims: list[int] = opt([], lambda v: all(x >= 1 for x in v), "integers >= 1")
    """Also the retrieval recall (and the BEIR and STS metrics) of the embeddings cut to their first m dims and
    re-normalized, per m (keys `dim{m}/...`): a Matryoshka model's smaller embeddings, or a plain model's
    truncated ones; empty = `loss.matryoshka_dims`."""
