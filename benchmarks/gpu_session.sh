#!/usr/bin/env bash
# Every GPU check and figure this project still owes, in stages that each fit one 10-minute call
# of the device tool (H100/H200, Python 3.12, torch 2.11, no internet; see .library/device).
#
#   here, once:   bash benchmarks/gpu_session.sh wheels     # the packages its image lacks, into .whl/
#   on the GPU:   run(command="bash benchmarks/gpu_session.sh 1", carry=[".whl"])   then 2, 3, 4
#   (the copy there may carry an older .git: prefix BENCH_COMMIT=<git rev-parse HEAD here>, which the results name)
#
#  Ordered by value; 16 goes first next time, then 17, then 18, then 19. Done: 9 (H200, 2026-11-26); 10's pieces, 11's rows and 6's
#  64K/256K/1M rows ran as 12 and 13 (H100, 2026-11-26, results/gpu_session_stage12.log); 14 and 15 (H100,
#  2026-11-27, results/gpu_session_stage14.log, stage15.log); all kept for reruns:
#   9  the trainer's own step side by side (step_gpu_bench: plain, GradCache, global negatives, accumulation at
#      1K; global negatives at 4K and 16K; MFU, memory, host syncs, end to end), pytest -m gpu, compiled rows
#  10  pytest -m gpu; ours vs open_clip at 32K in microbatches of 512; global negatives at 4K/16K/64K; the
#      trainer end to end with 4 and 14 workers
#  11  uint8 pixels normalized on the GPU against float32 from the workers (data.pixels_on_device), synthetic
#      JPEG data, 14 workers, plain and global negatives, bare and end to end
#  12  one 10-minute call: pytest -m gpu; the fused loss at N=64K, clip and siglip; ours vs open_clip at 32K
#      (microbatches of 512); global negatives at 4K/16K/64K; all in $OUT/stage12.tar
#  13  the same machine at once after 12: stage 11's plain rows; $OUT/stage13.tar
#  14  (issue 31) the fused loss per kernel and per backward panel size at 64K, and on the kernels of 60f25a4
#      (before base-2 exponentials and 128-row tiles) side by side (benchmarks/loss_profile.py --baseline); the
#      vit_b32 step's time by kernel family, plain and global negatives, eager and compiled (step_gpu_bench
#      --profile: where the MFU goes; the compiled global-negatives step's first GPU run); all in
#      $OUT/stage14.tar. (The device Triton's SASS needs no GPU: kernel_sass with that Triton on PYTHONPATH.)
#  15  (issue 31; the same machine after 14 if time is left) ours vs open_clip at 32 x 1,024 (the issue's
#      configuration); the shipped train_configs/clip_vit_b32_gpu.toml end to end (run_train.sh, 8 steps of 32K
#      pairs, its metrics.jsonl); the fused loss's kernels with TMA descriptor copies (the forward also
#      warp-specialized) against the pointer tiles (benchmarks/tma_probe.py); stage15.tar
#  16  (issue 31) what 14 and 15 led to: the plain step's kernel families again (eager, compiled) with the patch
#      embedding as one GEMM; the shipped clip_vit_b32_gpu.toml end to end, eager and compiled, with the loader
#      prefetching a whole step and one epoch for the run (15 measured 2,072 samples/s, data 45 %), the eager run's
#      last step traced by [profiling] (after its log line: a time limit in the export loses only the trace; the op
#      table in the tar, the trace gzipped beside it); stage16.tar
#  17  (issue 31; the same machine after 16) bf16 activations: the plain step's kernel families under autocast and
#      under FSDP2 on the one GPU (parallelism.fsdp_one_device), eager and compiled, side by side; the shipped
#      config end to end compiled with it (activation_traffic counts 36 % fewer bytes outside the GEMMs); stage17.tar
#  18  (issue 31) one layer's attention at vit_b32's shapes under each SDPA backend (attention_probe: the step's
#      14 ms of cuDNN flash for < 1 TFLOP); the data workers' rate on the host's 16 cores with uint8 pixels (what
#      a GPU run's workers make) at 256 and 768 px, 0, 1, 4 and 14 workers (data_bench --uint8); stage18.tar
#  19  (issue 31; after 18) the checkpoint's cost on the GPU: the pinned mode's CUDA test (a save right after a
#      queued optimizer step, its copy beside the next step); checkpoint_bench --device cuda (synchronous, async,
#      pinned with the copy beside the step and before returning, each followed by a vit_b32 step of 256 pairs);
#      the shipped config end to end with async_with_pinned_mem saves every 2 steps (metrics.jsonl; torch 2.11 there:
#      a fresh stager each save, pytorch/pytorch#183413); stage19.tar
#   1  pytest -m gpu and the Triton kernel tests                                        (issues 4, 8)
#   6  the loss benchmark's largest rows (bf16, N 64K..1M; 64K, 256K and 1M measured on 2026-11-26,
#      512K not): the fused kernel vs memeff and dense                                    (issues 8, 31)
#   2  the gpu sweep grids: run_train.sh on synthetic data at 1K..64K, microbatch vs global
#      negatives, then the planner's 8 GiB budget (gpu_planner)                         (issues 7, 31)
#   3  the pixel-loss benchmark through the sd decoder (issue 6); GradCache ratio + memory (issue 5)
#   4  the vit_b32 training-stack table (issue 3)
#   5  the loss benchmark for SigLIP's sigmoid loss (dense, streamed, fused kernel)      (issue 15)
#   7  a random-init Qwen3-0.6B-like decoder embedder with LoRA through the trainer, one
#      process (layout single): GradCache's largest batch and
#      samples/s against plain training's (bf16, seq 128+128, chunk 64)                 (issue 29)
#   8  a random-init Qwen2-VL-2B (qwen_vl family, LoRA, bf16) on emoji at 448-1,024 px, one
#      process: GradCache's largest batch with 4,096-token chunks against plain training's,
#      samples/s and peak CUDA memory per batch (flat in the batch is the claim)         (issue 30)
#  20  the same ViT-B/32 CLIP through the clip family's modules and transformers' CLIPModel (hf_clip), one
#      trainer step each, plain and GradCache, bf16 autocast, batch 1,024 (hf_clip_bench)
#  21  FLIP's patch dropout at 0, 0.5 and 0.75 through the trainer's plain step, bf16: vit_b16 at batch 512 and
#      vit_b32 at 1,024 (patch_dropout_bench: speed-up against the FLOPs ratio, peak memory)
#  22  SPLADE's head: autograd through the logits against the fused head and pooling, BERT-base's head, 32 texts of
#      256 tokens, bf16 (splade_head_bench: bytes kept for the backward, time, CUDA peak)
#  23  late interaction (ColBERT's MaxSim under InfoNCE): autograd through every token product against the tiled,
#      recomputed scores, 512 queries of 32 tokens and 1,024 documents of 180, bf16 (late_interaction_bench)
# A session has 15 device-minutes (2026-11-25), about one stage. 2026-11-24 (H100): stage 3 complete; 1 and 2 cut
# short by their time limits (results/gpu_session_stage*.log); 4, 5, 6 not run. 2026-11-26 (H200): stage 9 and
# the first form of 10 (results/gpu_session_stage9.log, stage10.log). 2026-11-26 (H100): 12, 13, the rest of 11
# and 6's large rows; stage 1's kernel tests stopped at 150 s (18 passed). 2, 4, 5, 7, 8 not run.
# Results go to $OUT (what the device tool brings back), else benchmarks/results.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/results}"
# a step's `timeout` stops run_train.sh with SIGTERM: the ranks finish their step (and save where checkpointing is
# on) within this, not the default 120 s, so a stage overruns its limit by at most this much
export TITAN_PREEMPT_GRACE_SECONDS=${TITAN_PREEMPT_GRACE_SECONDS:-30}
step() { echo "== $*"; timeout "$1" "${@:2}" 2>&1 | tee -a "$out/gpu_session.log" | tail -40; echo "== exit ${PIPESTATUS[0]}"; }
case "${1:-}" in
  wheels)
    mkdir -p .git/info && { grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude; }
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
      tyro docstring-parser typeguard shtab torchdata open-clip-torch ftfy wcwidth regex inf-cl==1.2.1 memeff==0.3.1 \
      webdataset wids braceexpand peft==0.21.2
    ls .whl; exit 0 ;;
  1|2|3|4|5|6|7|8|9|10|11|12|13|14|15|16|17|18|19|20|21|22|23)
    mkdir -p "$out"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
    python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name())" | tee "$out/device.txt" ;;
  *) echo "usage: bash benchmarks/gpu_session.sh wheels|1|2|3|4|5|6|7|8|9|10|11|12|13|14|15|16|17|18|19|20|21|22|23" >&2; exit 2 ;;
esac
res=/tmp/stage_results && mkdir -p "$res"
pack() { tar -C "$res" -cf "$out/stage$1.tar" . ; }  # after every step: a time limit loses only the step in flight
# [profiling]'s Chrome traces leave the tar (a 32K step's may be large): gzipped beside it when under 15 MiB; the op
# tables (rank0_ops.txt) stay in it
keep_traces() { for t in "$res"/*/profile_traces/*/*_trace.json; do [ -f "$t" ] || continue; gzip -9 "$t"
  [ "$(stat -c %s "$t.gz")" -lt 15728640 ] && mv "$t.gz" "$out/stage$1_$(basename "$(dirname "$t")")_trace.json.gz"
  rm -f "$t.gz"; done; rm -f "$res"/*/profile_traces/*/.*.tmp-*; }  # .NAME.tmp-*: an export a time limit cut short
case "$1" in
  9) step 280 python3 -m benchmarks.step_gpu_bench --e2e-steps 20 --timeout 100 --time-budget 260 --out "$res"; pack 9
     step 100 python3 -m pytest -q -m gpu -p no:cacheprovider --junitxml="$res/pytest_gpu.xml"; pack 9
     step 170 python3 -m benchmarks.step_gpu_bench --variants --scale --compile plain gradcache --timeout 90 \
       --time-budget 160 --tag compile --out "$res"; pack 9 ;;
  10) step 80 python3 -m pytest -q -m gpu -p no:cacheprovider --junitxml="$res/pytest_gpu.xml"; pack 10
      step 150 python3 -m benchmarks.openclip_compare --global-batch 32768 --micro 512 --steps 2 --out "$res"; pack 10
      step 140 python3 -m benchmarks.step_gpu_bench --variants --chunk 512 --scale 4096 16384 65536 --timeout 80 \
        --time-budget 135 --tag scale --out "$res"; pack 10
      for w in 4 14; do step 60 python3 -m benchmarks.step_gpu_bench --variants plain --scale --e2e-steps 30 \
        --num-workers $w --timeout 55 --tag workers$w --out "$res"; pack 10; done ;;
  11) for px in true false; do for v in plain global; do step 140 python3 -m benchmarks.step_gpu_bench --variants $v \
        --scale --chunk 512 --e2e-steps 20 --num-workers 14 --timeout 130 --override=--data.dataset=synthetic \
        --override=--data.pixels_on_device=$px --tag pixels_${px}_$v --out "$res"; pack 11; done; done ;;
  12) step 80 python3 -m pytest -q -m gpu -p no:cacheprovider --junitxml="$res/pytest_gpu.xml"; pack 12
      step 150 python3 -m benchmarks.loss_bench --losses clip siglip --n 65536 --dtypes bfloat16 \
        --impls dense streaming_triton memeff --repeats 5 --out "$res"; pack 12
      step 150 python3 -m benchmarks.openclip_compare --global-batch 32768 --micro 512 --steps 2 --out "$res"; pack 12
      step 140 python3 -m benchmarks.step_gpu_bench --variants --chunk 512 --scale 4096 16384 65536 --timeout 80 \
        --time-budget 135 --tag scale --out "$res"; pack 12 ;;
  13) for px in true false; do step 95 python3 -m benchmarks.step_gpu_bench --variants plain --scale --chunk 512 \
        --e2e-steps 20 --num-workers 14 --timeout 90 --override=--data.dataset=synthetic \
        --override=--data.pixels_on_device=$px --tag pixels_${px}_plain --out "$res"; pack 13; done ;;
  14) base=60f25a4  # the kernels before base-2 exponentials and 128-row tiles, if this copy's .git has them
      git cat-file -e "$base^{commit}" 2>/dev/null || base=
      step 180 python3 -m benchmarks.loss_profile ${base:+--baseline $base} --out "$res"; pack 14
      step 230 python3 -m benchmarks.step_gpu_bench --variants plain global --compile plain global --chunk 512 \
        --scale --profile --num-workers 14 --override=--data.dataset=synthetic --timeout 100 --time-budget 220 \
        --tag profile --out "$res"; pack 14 ;;
  15) step 150 python3 -m benchmarks.openclip_compare --global-batch 32768 --micro 1024 --steps 2 --tag micro1024 \
        --out "$res"; pack 15
      export CONFIG_FILE=train_configs/clip_vit_b32_gpu.toml PYTHON=python3
      step 150 ./run_train.sh --training.steps=8 --metrics.log_freq=2 --job.dump_folder="$res/gpu_config"; pack 15
      step 200 python3 -m benchmarks.tma_probe --out "$res"; pack 15 ;;
  16) step 120 python3 -m benchmarks.step_gpu_bench --variants plain --compile plain --chunk 512 --scale --profile \
        --num-workers 14 --override=--data.dataset=synthetic --timeout 80 --time-budget 110 --tag profile16 \
        --out "$res"; pack 16
      export CONFIG_FILE=train_configs/clip_vit_b32_gpu.toml PYTHON=python3
      for c in false true; do prof=(); [ $c = true ] || prof=(--profiling.enable=true --profiling.start_step=10)
        step 200 ./run_train.sh --training.steps=10 --metrics.log_freq=2 --compile.enable=$c "${prof[@]}" \
        --job.dump_folder="$res/gpu_config_compile_$c"; keep_traces 16; pack 16; done ;;
  17) for f in false true; do step 150 python3 -m benchmarks.step_gpu_bench --variants plain --compile plain \
        --chunk 512 --scale --profile --num-workers 14 --override=--data.dataset=synthetic \
        --override=--parallelism.fsdp_one_device=$f --timeout 70 --time-budget 140 --tag fsdp1_$f --out "$res"; pack 17
      done
      export CONFIG_FILE=train_configs/clip_vit_b32_gpu.toml PYTHON=python3
      step 200 ./run_train.sh --training.steps=10 --metrics.log_freq=2 --compile.enable=true \
        --parallelism.fsdp_one_device=true --job.dump_folder="$res/gpu_config_fsdp1"; pack 17 ;;
  18) step 90 python3 -m benchmarks.attention_probe --out "$res"; pack 18
      for px in 256 768; do step 240 python3 -m benchmarks.data_bench --uint8 --workers 0 1 4 14 --n 2048 \
        --repeats 2 --jpeg-size $px --out "$res"; pack 18; done ;;
  19) step 60 python3 -m pytest -q -m gpu -p no:cacheprovider -k "pinned or rng" --junitxml="$res/pytest_gpu19.xml"
      pack 19
      step 200 python3 -m benchmarks.checkpoint_bench --device cuda --batch 256 --repeats 5 --out "$res"; pack 19
      export CONFIG_FILE=train_configs/clip_vit_b32_gpu.toml PYTHON=python3
      step 200 ./run_train.sh --training.steps=6 --metrics.log_freq=1 --checkpoint.enable=true \
        --checkpoint.interval=2 --checkpoint.async_mode=async_with_pinned_mem --job.dump_folder="$res/gpu_config_pinned"
      rm -rf "$res"/gpu_config_pinned/checkpoint; pack 19 ;;  # its log and metrics.jsonl, not 3.4 GB of checkpoints
  1) step 150 python3 -m pytest -q -m gpu -p no:cacheprovider
     step 420 python3 -m pytest -q tests/test_triton_kernels.py -p no:cacheprovider ;;  # compiled, bf16 dot included (>120 s)
  6) step 560 python3 -m benchmarks.loss_bench --losses clip --n 65536 262144 524288 1048576 --dtypes bfloat16 \
       --impls dense streaming_triton memeff --repeats 3 --out "$out" ;;  # the PyTorch stream: ~95 s per call at 1M
  2) step 420 python3 -m benchmarks.sweep --grid gpu --out "$out" --timeout 150
     step 150 python3 -m benchmarks.sweep --grid gpu_planner --out "$out" --timeout 70 ;;
  3) step 300 python3 -m benchmarks.pixel_loss_bench --out "$out"
     step 270 python3 -m benchmarks.gradcache_bench --out "$out" ;;
  4) step 540 python3 -m benchmarks.train_bench --out "$out" ;;
  5) step 540 python3 -m benchmarks.loss_bench --losses siglip --out "$out" ;;
  7) export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True  # the image's transformers, tokenizers; peft from .whl
     step 560 python3 -m benchmarks.decoder_lora_bench --size 0.6b --time-budget 500 --repeats 2 --out "$out" ;;
  8) export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True  # transformers 5.17 from the image (Qwen2-VL's PIL processor); peft from .whl
     step 560 python3 -m benchmarks.qwen_vl_chunks --gpu --size 2b --chunk-tokens 4096 --time-budget 480 --repeats 2 --out "$out" ;;
  20) step 300 python3 -m benchmarks.hf_clip_bench --batch 1024 --chunk 256 --repeats 5 --out "$out" ;;
  21) step 240 python3 -m benchmarks.patch_dropout_bench --flavor vit_b16 --batch 512 --repeats 5 --out "$out"
      step 200 python3 -m benchmarks.patch_dropout_bench --flavor vit_b32 --batch 1024 --repeats 5 --out "$out" ;;
  22) step 120 python3 -m benchmarks.splade_head_bench --batch 32 --dtype bfloat16 --out "$out" ;;
  23) step 120 python3 -m benchmarks.late_interaction_bench --queries 512 --dtype bfloat16 --out "$out" ;;
esac
