"""End-to-end launches through run_train.sh (torchrun, gloo on CPU): the path users run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def launch(tmp_path: Path, nproc: int, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "NGPU": str(nproc), "PYTHON": sys.executable, "LOG_RANK": "0", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(
        ["./run_train.sh", f"--job.dump_folder={tmp_path}", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_two_process_cpu_smoke_run(tmp_path: Path) -> None:
    out = launch(
        tmp_path,
        2,
        "--training.steps=4",
        "--training.local_batch_size=16",
        "--training.global_batch_size=64",
        "--metrics.log_freq=2",
        "--lr_scheduler.warmup_steps=1",
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    log = out.stdout
    assert "training done" in log and "run_train.sh:" not in out.stderr  # the launcher's lines are for failures
    assert "local 16  x  grad-accum steps 2  x  dp degree 2  =  global 64" in log
    assert "final eval step 4 on 10000 fashion_mnist test samples" in log
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in train] == [2, 4]
    for key in ("loss", "lr", "grad_norm", "samples_per_s", "peak_memory_gib", "data_share"):
        assert key in train[-1]
    assert evals and evals[-1]["num_samples"] == 10000 and 0 <= evals[-1]["zero_shot_top1"] <= 1
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


@pytest.mark.slow
def test_default_config_reaches_the_zero_shot_target(tmp_path: Path) -> None:
    """The README's claim: `./run_train.sh` with the defaults reaches zero-shot top-1 >= 0.75."""
    out = launch(tmp_path, 1)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "final eval step 600" in out.stdout
    evals = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if '"eval"' in line]
    assert evals[-1]["zero_shot_top1"] >= 0.75


@pytest.mark.slow  # slow: ~10 s of torchrun launches, the default suite's time (CI runs the slow marker too)
def test_two_node_launch_over_c10d_rendezvous(tmp_path: Path) -> None:
    """run_train.sh's multi-node path: two 'nodes' (one process each) on this machine."""
    from tests.dist_utils import free_port

    env = {
        **os.environ,
        "NGPU": "1",
        "NNODES": "2",
        "RDZV_ENDPOINT": f"127.0.0.1:{free_port()}",
        "RDZV_ID": "test",
        "PYTHON": sys.executable,
        "CUDA_VISIBLE_DEVICES": "",
    }
    args = [
        "./run_train.sh",
        f"--job.dump_folder={tmp_path}",
        "--training.steps=2",
        "--training.local_batch_size=8",
        "--eval.enable=false",
        "--parallelism.data_parallel_replicate_degree=2",
        "--parallelism.data_parallel_shard_degree=1",
    ]
    nodes = [
        subprocess.Popen(
            args,
            cwd=REPO,
            env={**env, "NODE_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    outputs = [n.communicate(timeout=300)[0] for n in nodes]
    assert all(n.returncode == 0 for n in nodes), outputs
    assert any("parallelism: ddp (replicate 2 x shard 1)" in out and "dp degree 2" in out for out in outputs), outputs


@pytest.mark.slow
@pytest.mark.parametrize(
    "config, key, target",
    [
        ("train_configs/vae_debug.toml", "psnr_db", 20.0),  # README: 21.76 dB
        ("train_configs/emoji_vlm.toml", "image_to_text_r@5", 0.12),  # README: 0.175 (chance 0.025)
        ("train_configs/siglip_debug.toml", "zero_shot_top1", 0.75),  # README: 0.81
        ("train_configs/static_wordnet.toml", "beir/ndcg@10", 0.38),  # README: 0.436
    ],
)
def test_family_configs_reach_their_readme_results(tmp_path: Path, config: str, key: str, target: float) -> None:
    """The vae, vlm, siglip and static configs as the README runs them (CONFIG_FILE=... ./run_train.sh), with margin."""
    env = {
        **os.environ,
        "NGPU": "1",
        "PYTHON": sys.executable,
        "LOG_RANK": "0",
        "CUDA_VISIBLE_DEVICES": "",
        "CONFIG_FILE": config,
    }
    out = subprocess.run(
        ["./run_train.sh", f"--job.dump_folder={tmp_path}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    evals = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if '"eval"' in line]
    assert evals[-1][key] >= target, evals[-1]


@pytest.mark.slow
def test_own_data_walkthrough_reaches_its_readme_result(tmp_path: Path) -> None:
    """README 'Your own data': export the emoji as files, shard them, train own_data_clip.toml."""
    run = dict(cwd=tmp_path, capture_output=True, text=True, timeout=900)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "export_emoji_files.py"), "--out", "mydata"], env=env, **run
    )
    assert out.returncode == 0, out.stderr
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "titan_contrastive.datasets.make_shards",
            "mydata/train.csv",
            "--out",
            "mydata/shards",
            "--samples-per-shard",
            "500",
        ],
        env=env,
        **run,
    )
    assert out.returncode == 0, out.stderr
    env.update(
        NGPU="1",
        PYTHON=sys.executable,
        LOG_RANK="0",
        CUDA_VISIBLE_DEVICES="",
        CONFIG_FILE=str(REPO / "train_configs" / "own_data_clip.toml"),
    )
    out = subprocess.run([str(REPO / "run_train.sh"), "--job.dump_folder=outputs"], env=env, **run)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    evals = [
        json.loads(line)
        for line in (tmp_path / "outputs" / "metrics.jsonl").read_text().splitlines()
        if '"eval"' in line
    ]
    # README: 0.195
    assert evals[-1]["image_to_text_r@1"] >= 0.12 and evals[-1]["zero_shot/num_samples"] == 200, evals[-1]
