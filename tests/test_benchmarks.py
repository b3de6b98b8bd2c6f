"""The benchmarks' shape and runs: every benchmarks/*.py imports without side effects (no sys.path edits, no
environment changes, nothing written) and answers --help (a `_`-prefixed module is part of the harness or of one
benchmark, and imports with it); each benchmark's small run on CPU; `gpu_session.sh`'s stages. The harness
itself: `tests/test_harness.py`."""

from __future__ import annotations

import contextlib
import csv
import importlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

from tests.needs import require

REPO = Path(__file__).resolve().parents[1]
# the benchmarks; not the harness, nor a `_`-prefixed module: a part of one (`_harness_results`, `_peers_sides`)
MODULES = sorted(
    p.stem for p in (REPO / "benchmarks").glob("*.py") if p.stem != "harness" and not p.stem.startswith("_")
)


def test_benchmarks_import_without_side_effects_and_answer_help(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in MODULES:
        source = (REPO / "benchmarks" / f"{name}.py").read_text()
        assert "sys.path" not in source, f"benchmarks/{name}.py edits sys.path: run it as python -m benchmarks.{name}"
        assert f"python -m benchmarks.{name}" in source or f"-m benchmarks.{name}" in source, name  # its usage
    results = REPO / "benchmarks" / "results"
    before = {p.name: p.stat().st_mtime_ns for p in results.iterdir()}
    env, path, cwd = dict(os.environ), list(sys.path), os.getcwd()
    modules = {name: importlib.import_module(f"benchmarks.{name}") for name in MODULES}
    assert dict(os.environ) == env and sys.path == path and os.getcwd() == cwd
    assert {p.name: p.stat().st_mtime_ns for p in results.iterdir()} == before
    for name, module in modules.items():
        out = io.StringIO()
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
            module.main(["--help"])
        assert exit_.value.code == 0 and out.getvalue().startswith("usage:"), name
        assert "--out" in out.getvalue(), f"{name}: every benchmark writes where --out says"


def test_decoder_lora_bench_search_doubles_to_oom_and_halves_a_start_that_does_not_fit() -> None:
    """The batch search of benchmarks/decoder_lora_bench.py on a stand-in trainer that runs out of memory above
    16 samples: doubling stops at the first OOM, a start that does not fit is halved until one does, a spent time
    budget measures nothing, and another error ends the mode as an error."""
    from benchmarks import decoder_lora_bench as bench

    class Trainer:
        device = torch.device("cpu")

        def train_step(self, batches: list[dict[str, torch.Tensor]]) -> dict[str, float]:
            if len(batches[0]["query"]) > 16:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 TiB")
            return {"loss": 1.0}

    args = bench.parse(["--seq-len", "4", "--repeats", "1", "--max-batch", "1024"])

    def run(start: int, deadline: float | None = None, trainer: object = None) -> tuple[list[dict], dict]:
        rows: list[dict] = []
        end = bench.search(args, "plain", trainer or Trainer(), start, deadline, rows.append)
        return [(r["batch"], r["status"]) for r in rows], end

    assert run(4) == ([(4, "ok"), (8, "ok"), (16, "ok"), (32, "OOM")], {"stop": "out of memory at batch 32"})
    assert run(64) == ([(64, "OOM"), (32, "OOM"), (16, "ok")], {"stop": "out of memory at batch 32"})
    assert run(4, deadline=0.0) == ([], {"stop": "time budget: no time left"})

    class Broken(Trainer):
        def train_step(self, batches: list[dict[str, torch.Tensor]]) -> dict[str, float]:
            raise ValueError("not a memory problem")

    rows, end = run(4, trainer=Broken())
    assert rows == [(4, "error")] and end == {"stop": "error at batch 4: ValueError: not a memory problem"}


@pytest.mark.slow  # a benchmark's run end to end, ~4 s: the default suite's time (CI runs the slow marker too)
def test_decoder_lora_bench_runs_a_tiny_decoder_on_cpu(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """benchmarks/decoder_lora_bench.py end to end on CPU (what gpu_session.sh 7 runs at 0.6B on an H100): a
    tiny random Qwen3-like folder with LoRA through the trainer's own step, plain and GradCache at 4 and 8."""
    require("hf")
    from benchmarks import decoder_lora_bench

    cmd = ["--size", "tiny", "--device", "cpu", "--seq-len", "16", "--start-batch", "4", "--chunk", "2"]
    decoder_lora_bench.main([*cmd, "--max-batch", "8", "--repeats", "1", "--out", str(tmp_path)])  # in this process
    stdout = capsys.readouterr().out
    saved = json.loads((tmp_path / "decoder_lora_bench.json").read_text())
    for mode in ("plain", "gradcache"):
        rows = [r for r in saved["rows"] if r["mode"] == mode]
        assert [(r["batch"], r["status"]) for r in rows] == [(4, "ok"), (8, "ok")], rows
        assert all(r["samples_per_s"] > 0 and r["median_s"] > 0 for r in rows)
    summary = saved["summary"]
    assert summary["largest_batch"] == {"plain": 8, "gradcache": 8}
    assert summary["stop"] == {"plain": "max batch 8", "gradcache": "max batch 8"}
    assert summary["gradcache_vs_plain_samples_per_s"] > 0 and summary["gradcache_vs_plain_batch"] == 1
    assert summary["at_plain_largest_batch"]["batch"] == 8 and summary["at_plain_largest_batch"]["ratio"] > 0
    assert saved["layout"] == "single" and saved["lora_targets"] == ["q_proj", "v_proj"]
    assert 0 < saved["trainable_params"] < saved["params"]
    assert "GradCache at its largest batch against plain at its largest: 1x the batch" in stdout
    assert (tmp_path / "decoder_lora_bench.png").read_bytes()[:4] == b"\x89PNG"
    assert len(list(csv.DictReader(open(tmp_path / "decoder_lora_bench.csv")))) == 4


@pytest.mark.slow  # a benchmark's run end to end, ~3 s: the default suite's time (CI runs the slow marker too)
def test_hf_clip_bench_runs_both_families_on_the_same_weights(tmp_path: Path) -> None:
    """benchmarks/hf_clip_bench.py (gpu_session.sh 20 at vit_b32 on a GPU) with clip/debug on CPU: both families,
    both step kinds, the same first loss."""
    require("hf")
    from benchmarks import hf_clip_bench

    hf_clip_bench.main(["--flavor", "debug", "--batch", "6", "--chunk", "4", "--repeats", "1", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "hf_clip_bench.json").read_text())
    rows = {(r["family"], r["kind"]): r for r in saved["rows"]}
    assert set(rows) == {(f, k) for f in ("clip", "hf_clip") for k in ("plain", "gradcache")}
    assert all(r["samples_per_s"] > 0 and r["ratio"] > 0 for r in rows.values())
    assert rows["clip", "plain"]["ratio"] == 1 and saved["first_loss_rel_diff"] < 1e-5
    assert (tmp_path / "hf_clip_bench.png").read_bytes()[:4] == b"\x89PNG"
    assert len(list(csv.DictReader(open(tmp_path / "hf_clip_bench.csv")))) == 4


@pytest.mark.slow  # 10-12 s of the default suite's time
def test_static_bench_times_both_trainers_on_the_same_table(tmp_path: Path) -> None:
    """benchmarks/static_bench.py with a narrow table: a row per variant, and the first step's loss and table gradient
    equal sentence-transformers' to float32 rounding."""
    require("hf")
    from benchmarks import static_bench

    static_bench.main(
        ["--batches", "48", "--dim", "16", "--dims", "8", "16", "--stream-chunk", "20", "--repeats", "1", "--out",
         str(tmp_path)]
    )  # fmt: skip
    saved = json.loads((tmp_path / "static_bench.json").read_text())
    assert {r["variant"] for r in saved["rows"]} == set(static_bench.VARIANTS)
    (first,) = saved["agreement"]
    assert first["loss_rel_diff"] < 1e-5 and first["grad_rel_diff"] < 1e-5
    assert (tmp_path / "static_bench.png").read_bytes()[:4] == b"\x89PNG"


def test_gpu_session_accepts_every_stage_it_defines(tmp_path: Path) -> None:
    """benchmarks/gpu_session.sh: each stage its second `case` runs is one the setup accepts and the usage names
    (stage 20 was once defined but refused), and the header describes it; an unknown stage exits 2."""
    script = (REPO / "benchmarks" / "gpu_session.sh").read_text()
    defined = {int(n) for n in re.findall(r"^ {2}(\d+)\) ", script, flags=re.M)}
    accepted = re.search(r"^ {2}((?:\d+\|)+\d+)\)$", script, flags=re.M)
    usage = re.search(r"gpu_session\.sh wheels\|([\d|]+)\"", script)
    assert accepted and usage and len(defined) >= 20
    assert set(map(int, accepted[1].split("|"))) == defined == set(map(int, usage[1].split("|")))
    assert all(re.search(rf"^# +{n} ", script, flags=re.M) for n in defined), "each stage described in the header"
    bad = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_session.sh"), "99"], capture_output=True, text=True)
    assert bad.returncode == 2 and "usage" in bad.stderr


def test_patch_dropout_bench_times_each_rate_beside_its_flops(tmp_path: Path) -> None:
    """benchmarks/patch_dropout_bench.py with clip/debug on 28 px images: a row per rate, the prediction from the
    kept tokens."""
    from benchmarks import patch_dropout_bench

    argv = ["--flavor", "debug", "--batch", "4", "--image-size", "28", "--rates", "0", "0.5", "--repeats", "1"]
    patch_dropout_bench.main([*argv, "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "patch_dropout_bench_debug.json").read_text())["rows"]
    assert [r["patch_dropout"] for r in rows] == [0.0, 0.5] and all(r["samples_per_s"] > 0 for r in rows)
    assert rows[0]["speedup"] == rows[0]["predicted"] == 1 and rows[1]["predicted"] > 1
    assert (tmp_path / "patch_dropout_bench_debug.png").read_bytes()[:4] == b"\x89PNG"
    assert len(list(csv.DictReader(open(tmp_path / "patch_dropout_bench_debug.csv")))) == 2


def test_splade_head_bench_counts_what_each_path_keeps(tmp_path: Path) -> None:
    """benchmarks/splade_head_bench.py on a small head: a row per path and pooling, the fused path keeping a small
    fraction of the logits path's bytes, equal to it within float32 rounding."""
    from benchmarks import splade_head_bench

    argv = ["--batch", "2", "--length", "16", "--hidden", "8", "--vocab", "300", "--repeats", "1"]
    splade_head_bench.main([*argv, "--out", str(tmp_path)])
    rows = {
        (r["path"], r["strategy"]): r for r in json.loads((tmp_path / "splade_head_bench.json").read_text())["rows"]
    }
    assert set(rows) == {(p, s) for p in ("logits", "fused") for s in ("max", "sum")}
    for strategy in ("max", "sum"):
        assert rows["fused", strategy]["saved_mib"] * 4 < rows["logits", strategy]["saved_mib"]
        assert rows["fused", strategy]["max_diff"] <= 1e-4 and rows["logits", strategy]["max_diff"] == 0
    assert (tmp_path / "splade_head_bench.png").read_bytes()[:4] == b"\x89PNG"


def test_naflex_data_bench_quick_serves_every_mode(tmp_path: Path) -> None:
    """benchmarks/naflex_data_bench.py --quick: square crops at 224 and 256 and SigLIP 2's NaFlex patches, train
    and eval; each picture shape its own grid within 256 patches."""
    require("hf")
    from benchmarks import naflex_data_bench

    naflex_data_bench.main(["--quick", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "naflex_data_bench.json").read_text())
    rows = {(r["mode"], r["split"]) for r in saved["rows"]}
    assert rows == {(m, s) for m in ("square224", "square256", "naflex256") for s in ("train", "eval")}
    assert all(r["ms_per_image"] > 0 for r in saved["rows"])
    assert saved["naflex_grids"] == [[14, 18], [18, 14], [8, 32], [16, 16]]  # 480x640, 640x480, 256x1024, 512x512
    assert (tmp_path / "naflex_data_bench.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow  # ~30 s: seven trainer processes
def test_step_gpu_bench_runs_every_variant_on_cpu(tmp_path: Path) -> None:
    """benchmarks/step_gpu_bench.py end to end on CPU (what gpu_session.sh 9, 12 and 14 run on a GPU): each variant
    in its own process through Trainer.train_step, a global@N row past the one microbatch the trainer is
    built for, the trainer end to end with its data-wait share; JSON, CSV and PNG written."""
    cmd = [sys.executable, "-m", "benchmarks.step_gpu_bench", "--device", "cpu", "--flavor", "debug"]
    cmd += ["--image-size", "0", "--precision", "float32", "--batch", "32", "--chunk", "12", "--scale", "48"]
    cmd += ["--variants", "plain", "gradcache", "--e2e", "plain", "--e2e-steps", "4", "--log-freq", "2"]
    cmd += ["--num-workers", "0", "--warmup", "1", "--steps", "1", "--timeout", "120", "--profile"]
    out = subprocess.run([*cmd, "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = {r["variant"]: r for r in json.loads((tmp_path / "step_gpu_bench_cpu.json").read_text())["variants"]}
    for row in rows.values():  # --profile: the traced step's operator time by family, the GEMMs among them
        families = row["profile"]["families_ms"]
        assert sum(families.values()) == pytest.approx(row["profile"]["total_ms"]) and families["GEMM"] > 0
        assert row["profile"]["top"] and 0 < row["busy_share"]
        unnamed = row["profile"]["top_other"]  # what no family names, the largest first
        assert unnamed and sum(ms for _, ms, _ in unnamed) == pytest.approx(families["other"], rel=0.5)
        assert [ms for _, ms, _ in unnamed] == sorted((ms for _, ms, _ in unnamed), reverse=True)
    assert list(rows) == ["plain", "gradcache", "global@48"], rows
    assert [rows[v]["global_batch"] for v in rows] == [32, 32, 48]
    assert all(r["step_s"] > 0 and r["samples_per_s"] > 0 for r in rows.values())
    assert rows["plain"]["time_over_plain"] == 1.0 and rows["gradcache"]["time_over_plain"] > 0
    assert rows["plain"]["e2e_samples_per_s"] > 0 and 0 <= rows["plain"]["e2e_data_share"] < 1
    assert "e2e_samples_per_s" not in rows["gradcache"] and "e2e_samples_per_s" not in rows["global@48"]
    assert (tmp_path / "step_gpu_bench_cpu.png").read_bytes()[:4] == b"\x89PNG"
    assert len(list(csv.DictReader(open(tmp_path / "step_gpu_bench_cpu.csv")))) == 3


@pytest.mark.slow  # ~20 s in Triton's interpreter
def test_loss_memory_counts_six_copies_of_the_embeddings_on_the_fused_path(tmp_path: Path) -> None:
    """At its peak the fused loss holds the float32 dZx and dZy (2 + 2 units of N x d bf16) and one
    bf16 W panel (8192^2 = 2 units at N = 64K, d = 512): 384 MiB there. The count before
    2026-11-26's changes was 16 units, the 1,024 MiB an H100 measured."""
    from benchmarks import loss_memory

    loss_memory.main(["--shrink", "128", "--out", str(tmp_path)])
    row = json.loads((tmp_path / "loss_memory.json").read_text())["rows"][0]
    assert (row["n"], row["d"], row["panel"]) == (512, 4, 64)
    assert 6.0 <= row["target_units"] <= 6.1 and 384 <= row["target_mib"] <= 391, row["target_units"]
    assert (tmp_path / "loss_memory.png").stat().st_size > 10_000


def test_data_bench_times_every_piece_of_the_loader_path(tmp_path: Path) -> None:
    """data_bench's per-image pieces on 64 generated JPEGs (the dataset's own normalize and tokenizer), and
    its loader serving uint8 pixels (`--uint8`, a GPU run's workers; time_loader checks the dtype)."""
    from benchmarks import data_bench

    path = data_bench.make_data(tmp_path, 64)["csv"]
    pieces = data_bench.time_pieces(path)
    assert set(pieces) == {
        "read",
        "decode",
        "crop_resize_pillow",
        "crop_resize",
        "decode_crop",
        "normalize",
        "tokenize",
        "total",
    }
    assert all(v > 0 for v in pieces.values())
    loader_path = ("read", "decode_crop", "normalize", "tokenize")
    assert abs(pieces["total"] - sum(pieces[k] for k in loader_path)) < 1e-9
    for uint8 in (False, True):
        assert data_bench.time_loader("csv", path, 0, 1, 1, 5.0, uint8=uint8)["batches"] == 1


def test_attention_probe_checks_each_backend_against_float64(tmp_path: Path) -> None:
    """benchmarks/attention_probe.py (gpu_session.sh 18's attention rows) on CPU: both towers' shapes, each
    backend that runs here checked against float64 math (a small nonzero error: another computation) and
    timed; the CUDA-only ones recorded as unsupported; JSON, CSV and PNG written."""
    from benchmarks import attention_probe

    attention_probe.main(
        ["--device", "cpu", "--batch", "2", "--dtype", "float32", "--repeats", "1"] + ["--out", str(tmp_path)]
    )
    rows = json.loads((tmp_path / "attention_probe_cpu.json").read_text())["rows"]
    assert [(r["tower"], r["tokens"], r["heads"], r["causal"]) for r in rows[::5]] == [
        ("image", 50, 12, False),
        ("text", 77, 8, True),
    ]
    for row in rows:
        if row["backend"] in ("auto", "math"):
            assert row["status"] == "ok" and row["ms"] > 0 and row["step_ms"] == pytest.approx(12 * row["ms"])
            assert 0 < row["out_error"] < 1e-5 and 0 < row["grad_error"] < 1e-5, row
        if row["backend"] in ("efficient", "cudnn"):
            assert row["status"] == "unsupported" and "ms" not in row
    assert (tmp_path / "attention_probe_cpu.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow  # ~30 s: the default suite's time (CI runs the slow marker too)
def test_loss_profile_times_each_panel_size_and_checks_the_gradients(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """benchmarks/loss_profile.py through Triton's interpreter: both fused losses agree with the dense
    float64 loss, each panel size is its own row, and the panel size reaches the backward (N = 96 in
    panels of 40 is 3 x 3 panels, two GEMMs each; in panels of 100, one). `--baseline HEAD` runs the
    losses on the kernels of that revision, extracted outside the package (seen to run: the loaded
    module is wrapped to leave a mark), beside the package's; a revision git lacks stops the run."""
    import titan_contrastive
    from benchmarks import loss_profile

    with pytest.raises(SystemExit, match="2"):
        loss_profile.main(["--baseline", "no-such-revision", "--out", str(tmp_path)])
    assert "--baseline no-such-revision: git cannot read that revision" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing computed, nothing written
    calls, load = [], loss_profile.load_kernels

    def marked(package: Path):  # noqa: ANN202
        kernels = load(package)
        assert Path(kernels.__file__).is_relative_to(package) and package != Path(titan_contrastive.__file__).parent
        real = kernels.row_col_lse
        kernels.row_col_lse = lambda *a, **k: calls.append(1) or real(*a, **k)
        return kernels

    args = ["--n", "96", "--d", "32", "--panels", "40", "100", "--repeats", "1", "--check-n", "60"]
    with mock.patch.object(loss_profile, "load_kernels", marked):
        loss_profile.main([*args, "--baseline", "HEAD", "--out", str(tmp_path)])
    assert calls
    result = json.loads((tmp_path / "loss_profile_cpu.json").read_text())
    assert set(result["checks"]) == {"clip", "siglip", "clip baseline", "siglip baseline"}
    assert all(check["dzx"] < 1e-5 and check["dzy"] < 1e-5 for check in result["checks"].values()), result["checks"]
    rows = {(r["loss"], r["kernels"], r["panel"]): r for r in result["rows"]}
    want = {(loss, "this tree", panel) for loss in ("clip", "siglip") for panel in (40, 100)}
    assert set(rows) == want | {(loss, "baseline", 8192) for loss in ("clip", "siglip")}
    for (_, _, panel), row in rows.items():
        assert row["status"] == "ok" and sum(row["families_ms"].values()) == pytest.approx(row["total_ms"])
        assert row["families_launches"]["GEMM"] == (18 if panel == 40 else 2), row["top"]
    assert (tmp_path / "loss_profile_cpu.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow  # ~15 s: six compiles for sm_90a
def test_kernel_sass_counts_every_config_of_a_kernel(tmp_path: Path) -> None:
    """benchmarks/kernel_sass.py on the softmax W kernel: one row per autotune config that runs at
    d = 512 in bf16, the H100's pick marked, two MUFU.EX2 per logit in each, and the model's cycles
    consistent with the counts; JSON, CSV and figure written under the Triton version's name."""
    import triton

    from benchmarks import kernel_sass

    kernel_sass.main(["--kernels", "W (softmax)", "--out", str(tmp_path)])
    name = f"kernel_sass_triton{triton.__version__.rsplit('.', 1)[0]}"
    result = json.loads((tmp_path / f"{name}.json").read_text())
    rows = result["rows"]
    assert result["meta"]["triton"] == triton.__version__ and {r["kernel"] for r in rows} == {"W (softmax)"}
    assert len(rows) == 6 and sum(r["h100_pick"] for r in rows) == 1  # 5 streamed tiles, 1 resident that fits
    for r in rows:
        assert r["mufu_per_logit"] == 2.0 and r["total"] == sum(r[c] for c in [*kernel_sass.CLASSES, "other"])
        assert r["issue_cycles"] == round(r["total"] * int(r["config"].split(", ")[1].split()[0]) / 4)
    assert (tmp_path / f"{name}.png").read_bytes()[:4] == b"\x89PNG" and (tmp_path / f"{name}.csv").exists()


@pytest.mark.slow  # ~25 s in Triton's interpreter, three child processes
def test_tma_probe_checks_and_times_each_kernel_variant(tmp_path: Path) -> None:
    """benchmarks/tma_probe.py (gpu_session.sh 15's descriptor kernels) through the interpreter: the
    pointer, TMA and warp-specialized forwards give float64's LSEs and both W kernels its W, on problems
    with ragged row, column and d tails (the descriptors' zero padding and clipped stores); each variant
    is timed alone and in the whole loss, with the variant's own tiles (its config recorded)."""
    from benchmarks import tma_probe

    tma_probe.main(["--n", "152", "--d", "40", "--check-n", "90", "--repeats", "1", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "tma_probe_cpu.json").read_text())
    checks = result["checks"]
    assert set(checks) == {"forward:pointer", "forward:tma", "forward:tma_ws", "W:pointer", "W:tma"}
    assert all(max(c.values()) < 1e-5 for c in checks.values()), checks
    names = ["forward, pointer", "forward, tma", "forward, tma_ws", "W panel, pointer", "W panel, tma"]
    names += ["loss, forward pointer", "loss, forward tma", "loss, forward tma_ws", "loss, forward tma + W tma"]
    assert [r["variant"] for r in result["rows"] if r["status"] == "ok"] == names
    assert "WS: True" in result["configs"]["forward:tma_ws"] and "WS: False" in result["configs"]["forward:tma"]
    assert "BLOCK_M" in result["configs"]["W:tma"]


def test_token_pooling_bench_writes_a_row_per_size_and_factor(tmp_path: Path) -> None:
    """benchmarks/token_pooling_bench.py on small documents: a row per (tokens, factor), each keeping the protected
    token and floor(rest / factor) clusters of the rest."""
    pytest.importorskip("sentence_transformers")
    from benchmarks import token_pooling_bench

    argv = ["--tokens", "9", "17", "--factors", "2", "4", "--dim", "4", "--docs", "3", "--repeats", "1"]
    token_pooling_bench.main([*argv, "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "token_pooling_bench.json").read_text())["rows"]
    assert [(r["tokens"], r["factor"], r["kept_tokens"]) for r in rows] == [
        (9, 2, 5),
        (9, 4, 3),
        (17, 2, 9),
        (17, 4, 5),
    ]
    assert all(r["ms_per_doc"] > 0 for r in rows)
    assert (tmp_path / "token_pooling_bench.png").read_bytes()[:4] == b"\x89PNG"


def test_late_interaction_bench_counts_what_each_path_keeps(tmp_path: Path) -> None:
    """benchmarks/late_interaction_bench.py on a small problem: a row per objective and path, the tiled paths of
    InfoNCE (masked or not) and the sigmoid loss keeping for the backward only what is the size of the embeddings (a
    small fraction of the autograd path's bytes), the pairwise loss's its picked columns' products (less than its
    autograd path's), the streamed paths nothing; each equal to its autograd path within float32 rounding."""
    from benchmarks import late_interaction_bench

    argv = ["--queries", "6", "--query-tokens", "4", "--doc-tokens", "8", "--dim", "4", "--repeats", "1"]
    late_interaction_bench.main([*argv, "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "late_interaction_bench.json").read_text())["rows"]
    rows = {(r["objective"], r["path"]): r for r in rows}
    objectives = ("infonce", "masked", "sigmoid", "pairwise")
    streamed = {("infonce", "streamed"), ("sigmoid", "streamed")}
    assert set(rows) == {(o, p) for o in objectives for p in ("autograd", "tiled")} | streamed
    assert rows["infonce", "tiled"]["columns"] == 12
    for objective in ("infonce", "masked", "sigmoid"):
        assert rows[objective, "tiled"]["kept_mib"] * 4 < rows[objective, "autograd"]["kept_mib"]
    assert rows["pairwise", "tiled"]["kept_mib"] < rows["pairwise", "autograd"]["kept_mib"]
    assert all(rows[key]["kept_mib"] == 0 for key in streamed)
    for objective in objectives:
        assert rows[objective, "autograd"]["max_diff"] == 0
        assert rows[objective, "autograd"]["kept_mib"] == rows[objective, "autograd"]["saved_mib"]
    assert all(r["max_diff"] <= 1e-5 for r in rows.values())
    assert (tmp_path / "late_interaction_bench.png").read_bytes()[:4] == b"\x89PNG"


def test_teacher_inputs_bench_times_each_work(tmp_path: Path) -> None:
    """benchmarks/teacher_inputs_bench.py on a small batch: a row per work, each a positive time and rate."""
    require("hf")
    from benchmarks import teacher_inputs_bench

    teacher_inputs_bench.main(["--batch", "8", "--size", "16", "--repeats", "1", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "teacher_inputs_bench.json").read_text())["rows"]
    assert [r["work"] for r in rows] == ["encode", "retokenize", "renormalize"]
    assert all(r["ms_per_batch"] > 0 and r["samples_per_s_per_core"] > 0 and r["batch"] == 8 for r in rows)
    assert (tmp_path / "teacher_inputs_bench.png").read_bytes()[:4] == b"\x89PNG"


def test_table_memory_bench_measures_both_designs(tmp_path: Path) -> None:
    """benchmarks/table_memory_bench.py on a small file: a row per design, each index sized, each worker's pass
    timed; the arrays are smaller than the dict's objects."""
    require("data")
    from benchmarks import table_memory_bench

    table_memory_bench.main(["--images", "300", "--workers", "1", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "table_memory_bench.json").read_text())["rows"]
    assert [r["design"] for r in rows] == ["numpy arrays (TextIndex)", "Python dict (former)"]
    assert all(r["keys"] == 600 and r["us_per_key"] > 0 and r["worker_private_mib"] >= 0 for r in rows)
    assert rows[0]["index_mib"] < rows[1]["index_mib"]
    assert (tmp_path / "table_memory_bench.png").read_bytes()[:4] == b"\x89PNG"
