#!/usr/bin/env bash
# The device runs behind bench/results/, in two commands of under ten minutes each (see bench/README in the
# module docstrings for what each script measures). Run from the repository root on the device machine with
# the wheels of ../shared/tools/device-wheels.sh in .whl/ (add accelerate==1.15.0, as the Makefile pins it: the fsdp
# modes were measured with it, docs/fsdp.md):
#   LONGSTRAW_REV=<git rev> bash bench/run_device.sh engine     # GPU tests, then (c): the 128K..2M sweep
#   LONGSTRAW_REV=<git rev> bash bench/run_device.sh compare    # CP gradient check (gloo), then (a)+(b)
#   LONGSTRAW_REV=<git rev> bash bench/run_device.sh final      # the 2M point of (c); stock 128K/256K, 1 seq
#   LONGSTRAW_REV=<git rev> bash bench/run_device.sh cp8-2m     # on nvidia-h200-x8 (then cp8-4m)
#   LONGSTRAW_REV=<git rev> bash bench/run_device.sh full [args] # whole 64-layer 27B + LoRA (full_model.py)
#   LONGSTRAW_REV=<git rev> bash bench/run_device.sh grad         # issue 14: full gradient, reverse block replay
#   LONGSTRAW_REV=<git rev> bash bench/run_device.sh glm         # GLM-5 slice: 1M GPU/host state, then 2M
#   LONGSTRAW_REV=<git rev> bash bench/run_device.sh glm-2m      # GLM-5 slice: 2M, GPU then host state
#   LONGSTRAW_REV=<git rev> bash bench/run_device.sh v3          # GPU tests of the fused kernels, whole 27B at 512K
#   LONGSTRAW_REV=<git rev> bash bench/run_device.sh full-1m     # the whole 27B's GRPO step at 1M, R = 1024
#   LONGSTRAW_REV=<git rev> bash bench/run_device.sh v4          # every fast path's GPU test (-v), 512K with chunk times
#   LONGSTRAW_REV=<git rev> bash bench/run_device.sh glm-host    # GLM-5 slice: 1M host state, a capture profile
#   LONGSTRAW_REV=<git rev> bash bench/run_device.sh glm-2m-gpu  # then glm-2m-host: glm-2m's cases one a command
#   LONGSTRAW_REV=<git rev> bash bench/run_device.sh sa-probe    # GLM-5's fused selected-keys attention: tests, timing
#   LONGSTRAW_REV=<git rev> bash bench/run_device.sh glm-v2      # sa-probe, then the GLM-5 slice at 1M after it
#   LONGSTRAW_REV=<git rev> bash bench/run_device.sh glm-v3      # GLM-5 GPU tests, negative controls, slice at 1M
#   LONGSTRAW_REV=<git rev> bash bench/run_device.sh glm-2m-v3   # the GLM-5 slice at 2M
#   LONGSTRAW_REV=<git rev> bash bench/run_device.sh glm-v4      # offload GPU tests, the GLM-5 slice at 1M
#   LONGSTRAW_REV=<git rev> bash bench/run_device.sh gather-probe # the host gather's tiles and row orders
#   LONGSTRAW_REV=<git rev> bash bench/run_device.sh gpu-tests tests/x.py  # the GPU tests of these files
#   LONGSTRAW_REV=<git rev> bash bench/run_device.sh host-adds   # the offloaded full gradient's async adds + control
#   LONGSTRAW_REV=<git rev> bash bench/run_device.sh layers      # every GPU test (session 10's reorganisation)
#   LONGSTRAW_REV=<git rev> bash bench/run_device.sh cold-start   # a fresh process's first step, cold and disk-cached
#   LONGSTRAW_REV=<git rev> bash bench/run_device.sh cold-pins    # this GPU's autotune pins, then a pinned cold 512K step
#   LONGSTRAW_REV=<git rev> bash bench/run_device.sh grad-profile --prompt 65536  # the full-mode prompt backward's kernels
#   LONGSTRAW_REV=<git rev> bash bench/run_device.sh segment-bwd --prompts 262144 ...  # cuDNN backward, full mode
#   LONGSTRAW_REV=<git rev> bash bench/run_device.sh gdn-bwd     # issue 25: GDN backward via fla + our dqkwg
#   LONGSTRAW_REV=<git rev> bash bench/run_device.sh prefix-tree # prefix sharing: 8 decision points of a 512K trajectory
#   LONGSTRAW_REV=<git rev> bash bench/run_device.sh full-262k   # issue 25: response-only and full at 262K
#   LONGSTRAW_REV=<git rev> bash bench/run_device.sh pb-ckpt-128k # issue 25: prompt backward with / without checkpointing
#   LONGSTRAW_REV=<git rev> bash bench/run_device.sh pb-ab       # issue 25: prompt backward, HF's forwards vs fused kernels
#   LONGSTRAW_REV=<git rev> bash bench/run_device.sh fsdp1-plain # issue 28: the 27B LoRA step at 512K, plain (then fsdp1)
#   LONGSTRAW_REV=<git rev> bash bench/run_device.sh fsdp1       # the same step under FSDP2 at world size 1; vs plain
#   LONGSTRAW_REV=<git rev> bash bench/run_device.sh cp2         # on nvidia-h200-x2: the same step, CP2 (cp2.yaml)
#   LONGSTRAW_REV=<git rev> bash bench/run_device.sh fsdp2-cp2   # on nvidia-h200-x2: FSDP2 x CP2 (fsdp2.yaml, 2 ranks)
#   LONGSTRAW_REV=<git rev> bash bench/run_device.sh fsdp2-cp8   # on nvidia-h200-x8: the 27B fully fine-tuned at 2M, FSDP2 x CP8
#   LONGSTRAW_REV=<git rev> bash bench/run_device.sh glm-train   # issue 28: a GLM-5 slice's train() step on one GPU, 512K
#   LONGSTRAW_REV=<git rev> bash bench/run_device.sh glm-ep8-cp8 # on nvidia-h200-x8: the same at 2M, EP8 x CP8 (glm-ep2-cp2: x2)
# LONGSTRAW_REV must be set from this machine's checkout: the device copy's .git can be stale (session 7).
# Run them back to back: a machine left idle (30 s) is given back, and a new one may not be lent.
# fla is installed beside the rest but only put on the path for the engine sweep and the GPU tests: with
# fla importable, the stock HF Qwen3.5 layers train through fla's backward, which refuses on Triton < 3.7.1
# (docs/design.md, "Device figures the code relies on"), so both sides of the stock comparison run without it (torch GDN rule).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
fla=$(ls .whl/*.whl | grep -E 'fla_core|flash_linear')
rest=$(ls .whl/*.whl | grep -v -E 'fla_core|flash_linear')
# a warm machine keeps /tmp and the checkout's ignored files between calls: install once per machine and keep
# Triton's compiled kernels (and fla's autotune choices) in the checkout, so the next command does not compile again
if [[ ! -f /tmp/site/.longstraw_wheels ]] || ! cmp -s <(ls .whl) /tmp/site/.longstraw_wheels; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $rest || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/fla $fla || exit 1
  ls .whl > /tmp/site/.longstraw_wheels
fi
export TRITON_CACHE_DIR=$PWD/.triton_cache
# v3 writes here which fast paths failed their GPU tests on this machine; its later commands keep them off
switches=$TRITON_CACHE_DIR/switches.env
FUSED_FLAG=""
if [[ -f $switches ]]; then source "$switches"; cat "$switches"; fi
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null || exit 1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$OUT/gpu.txt"
# A fast path whose GPU tests failed in the pytest log $1 (the -rfE summary, or -v's per-test lines when a timeout
# cut the summary) is switched off for the rest of the command and the machine's later commands (switches.env)
switch_off_failed() {
  local log=$1
  mkdir -p "$TRITON_CACHE_DIR"; : > "$switches"
  failed() { grep -q -E "^(FAILED|ERROR) tests/$1|^tests/$1[^ ]* (FAILED|ERROR)" "$log"; }
  failed test_kernels_elementwise && echo 'FUSED_FLAG=--no-fused-kernels' >> "$switches"
  failed test_kernels_gdn_decode && echo 'export LONGSTRAW_GDN_DECODE=0' >> "$switches"
  failed test_kernels_gdn.py::test_gpu_fla_conv && echo 'export LONGSTRAW_FLA_CONV=0' >> "$switches"
  failed test_kernels_attention.py::test_prompt_dq && echo 'export LONGSTRAW_PROMPT_DQ=0' >> "$switches"
  failed test_kernels_indexer && echo 'export LONGSTRAW_INDEXER_KERNEL=0' >> "$switches"
  failed 'test_kernels_attention.py::test_page_grads_on_cuda_match_math\[cudnn' \
    && echo 'export LONGSTRAW_CUDNN_BACKWARD=0' >> "$switches"
  echo "switched off: $(tr '\n' ' ' < "$switches")"; source "$switches"
}
# GPU tests into $OUT/pytest_gpu_$1.log with timeout $2 s (without fla, unless GPU_TESTS_PATH puts it on the path):
# the exit status, how many passed, the failures
gpu_tests() {
  local log="$OUT/pytest_gpu_$1.log" limit=$2; shift 2
  PYTHONPATH=${GPU_TESTS_PATH:-/tmp/site} timeout "$limit" python3 -m pytest -v -rfE -m gpu "$@" > "$log" 2>&1
  echo "pytest -m gpu $*: rc=$?, $(grep -c PASSED "$log") passed"
  grep -E " (FAILED|ERROR)|^FAILED|^ERROR" "$log" | tail -8
}
case "$1" in
segment-bwd)  # issue 25: the full mode's prompt segments: the attention GPU tests (cuDNN's backward on the merged
              # out/LSE, the page dK/dV), flash against cuDNN's backward at the segment's shapes, then the whole 27B
              # in both modes (full_model.py, args after the mode; --profile-segment: one segment's kernels)
  shift
  gpu_tests attention 150 tests/test_kernels_attention.py -k "flash_path or page_grads or softcap"
  switch_off_failed "$OUT/pytest_gpu_attention.log"
  (cd bench && PYTHONPATH=/tmp/site timeout 90 python3 -u attention_backward_probe.py 2>&1 | grep -v -i warn \
    | tee "$OUT/attention_backward_probe.log" | tail -7)
  cd bench && PYTHONPATH=/tmp/site:/tmp/fla timeout 560 python3 -u full_model.py --skip-stock "$@" 2>&1 \
    | grep -v -i warn | tee "$OUT/full.log" | tail -6
  ;;
gdn-bwd)  # issue 25: the GDN backward through fla with our torch chunk_bwd_dqkwg (LONGSTRAW_GDN_BACKWARD): its GPU
          # tests, the GDN kernels' and the engine's full gradient on CUDA (their backward takes it now), then the
          # probe at the capture chunk (16K) and at 64K
  PYTHONPATH=/tmp/site:/tmp/fla timeout 300 python3 -m pytest -v -rfE -m gpu --durations 10 \
    tests/test_kernels_gdn_backward.py tests/test_kernels_gdn.py tests/test_full_gradient.py::test_full_gradient_on_cuda_bf16 \
    > "$OUT/pytest_gpu_gdn_bwd.log" 2>&1
  echo "pytest -m gpu: rc=$?, $(grep -c PASSED "$OUT/pytest_gpu_gdn_bwd.log") passed"
  grep -E " (FAILED|ERROR)|^FAILED|^ERROR|passed|failed" "$OUT/pytest_gpu_gdn_bwd.log" | tail -12
  cd bench && PYTHONPATH=/tmp/site:/tmp/fla timeout 240 python3 -u gdn_backward_probe.py --tokens 16384 65536 2>&1 \
    | grep -v -i warn | tee "$OUT/gdn_backward_probe.log" | tail -6
  ;;
full-memory)  # issue 25: where gradient_mode='full' runs out of memory on the whole 27B (train() OOMed at P = 16K,
              # R = 32, where response-only peaked at 58.7 GiB): the engine's phases one by one; args to the script
  shift
  cd bench && PYTHONPATH=/tmp/site timeout 400 python3 -u full_mode_memory.py "$@" 2>&1 | grep -v -i warn \
    | tee "$OUT/full_memory.log" | tail -30
  ;;
cold-start)  # issue 29: the whole 27B's train() step in fresh processes: an empty Triton cache, then the same cache
            # from disk (bench/cold_start.py); run it first on a fresh machine
  shift
  cd bench && PYTHONPATH=/tmp/site:/tmp/fla timeout 560 python3 -u cold_start.py "$@" 2>&1 | grep -v -i warn \
    | tee "$OUT/cold_start.log" | tail -12
  ;;
cold-pins)  # issue 29: measure this GPU's autotune pins (a 32K step), then a fresh process on an empty cache with the
           # pins: two whole-27B steps at --prompt (default 512K), the cold one against the warm one
  shift
  cd bench && PYTHONPATH=/tmp/site:/tmp/fla timeout 580 python3 -u cold_start.py --pins --prompt 524288 --budget-s 420 \
    "$@" 2>&1 | grep -v -i warn | tee "$OUT/cold_pins.log" | tail -12
  ;;
grad-profile)  # issue 25: where the full-mode prompt backward's time goes (whole 27B at 64K: 145 s, floor 12 s),
              # 4-layer slice, fla on the path as in a whole-model run; top kernels of the first prompt backward
  shift
  cd bench && PYTHONPATH=/tmp/site:/tmp/fla timeout 400 python3 -u full_gradient.py --check 0 --modes full \
    --groups 2 --response 256 --chunk 16384 --page 16384 --profile 25 "$@" 2>&1 | grep -v -i warn \
    | tee "$OUT/grad_profile.log" | tail -45
  ;;
gpu-tests)  # the GPU tests of the files (and pytest options) given, fla on the path as in a whole-model run
  shift
  GPU_TESTS_PATH=/tmp/site:/tmp/fla gpu_tests "tests${LOG_TAG:-}" "${TESTS_TIMEOUT:-400}" --durations 10 "$@"
  tail -1 "$OUT/pytest_gpu_tests${LOG_TAG:-}.log"  # pytest's summary line
  ;;
host-adds)  # issue 25 (session 17): the offloaded full gradient's asynchronous dK/dV adds (state.HostAdds), their GPU
            # test, then its negative control: the same test on the old synchronous `bk += dk.to(host)` must fail
  test=tests/test_full_gradient_plan.py::test_offloaded_page_gradients_are_added_without_waiting_for_the_device
  PYTHONPATH=/tmp/site timeout 120 python3 -m pytest -q -m gpu "$test" > "$OUT/pytest_host_adds.log" 2>&1
  echo "host adds: rc=$? $(tail -1 "$OUT/pytest_host_adds.log")"
  cp longstraw_trl/state.py /tmp/state.py.kept
  python3 - <<'PY'
p = "longstraw_trl/state.py"
s = open(p).read()
for x in "kv":
    s = s.replace(f"HOST_ADDS.add(b{x}[:, s:e], d{x})", f"b{x}[:, s:e] += d{x}.to(b{x}.device, torch.float32)")
open(p, "w").write(s)
PY
  PYTHONPATH=/tmp/site timeout 120 python3 -m pytest -q -m gpu "$test" > "$OUT/pytest_host_adds_control.log" 2>&1
  echo "negative control (synchronous adds; must fail): rc=$? $(tail -1 "$OUT/pytest_host_adds_control.log")"
  cp /tmp/state.py.kept longstraw_trl/state.py
  ;;
layers)  # session 10: every GPU test after the runtime-layer reorganisation (context / hooks / Mode, the decode
         # buffers and GDN running state now written through ReplayContext), fla on the path as in v4
  PYTHONPATH=/tmp/site:/tmp/fla timeout 560 python3 -m pytest -v -rfE -m gpu --durations 15 tests/ \
    > "$OUT/pytest_gpu_layers.log" 2>&1
  echo "pytest -m gpu: rc=$?, $(grep -c PASSED "$OUT/pytest_gpu_layers.log") passed"
  grep -E " (FAILED|ERROR)|^FAILED|^ERROR|passed|failed" "$OUT/pytest_gpu_layers.log" | tail -12
  ;;
profile)  # where a replay + backward spends its time (whole model, LoRA, HF checkpointing); args to the script
  shift
  cd bench && PYTHONPATH=/tmp/site:/tmp/fla timeout 400 python3 -u profile_replay.py "$@" 2>&1 | grep -v -i warn \
    | tee "$OUT/profile.log" | tail -45
  ;;
gpu-profile)  # the GPU tests, then a replay + backward and a capture of the whole model profiled (args to the script)
  shift
  PYTHONPATH=/tmp/site:/tmp/fla timeout 230 python3 -m pytest -q -s -m gpu tests/ > "$OUT/pytest_gpu.log" 2>&1
  echo "pytest -m gpu: rc=$?"; grep -E "passed|failed|Error|error" "$OUT/pytest_gpu.log" | tail -8
  cd bench && PYTHONPATH=/tmp/site:/tmp/fla timeout 330 python3 -u profile_replay.py "$@" 2>&1 | grep -v -i warn \
    | tee "$OUT/profile.log" | grep -E "^first|^profiled|^\{"
  ;;
v4)  # next: every GPU test of the fast paths, named as it runs (-v), the slow flash/math comparison last; then the
      # whole 27B at 512K again, each capture chunk's seconds recorded (the 1.49x of v3 was not attributable).
      # A fast path whose tests fail is switched off for the 512K step and the machine's later commands
  PYTHONPATH=/tmp/site:/tmp/fla timeout 170 python3 -m pytest -v -rfE -m gpu tests/test_kernels_elementwise.py \
    tests/test_kernels_sparse_attention.py tests/test_kernels_indexer.py tests/test_kernels_gdn_decode.py \
    tests/test_kernels_gdn.py::test_gpu_fla_conv_equals_torch_conv \
    tests/test_kernels_attention.py::test_prompt_dq_kernel_is_the_softmax_gradient tests/test_generation.py \
    tests/test_engine_gqa.py > "$OUT/pytest_gpu.log" 2>&1
  rc=$?; echo "pytest -m gpu: rc=$rc, $(grep -c PASSED "$OUT/pytest_gpu.log") passed"
  PYTHONPATH=/tmp/site:/tmp/fla timeout 45 python3 -m pytest -v -rfE -m gpu tests/test_kernels_attention.py \
    -k "not prompt_dq" > "$OUT/pytest_gpu_attention.log" 2>&1
  echo "pytest -m gpu attention: rc=$?, $(grep -c PASSED "$OUT/pytest_gpu_attention.log") passed"
  grep -h -E " (FAILED|ERROR)" "$OUT/pytest_gpu.log" "$OUT/pytest_gpu_attention.log" | tail -12
  switch_off_failed "$OUT/pytest_gpu.log"
  cd bench && PYTHONPATH=/tmp/site:/tmp/fla timeout 340 python3 -u full_model.py --skip-stock --prompts 524288 \
    --response 256 --warmup-response 256 --budget-s 330 --tag _P512K_v4 $FUSED_FLAG 2>&1 | grep -v -i warn \
    | tee "$OUT/full.log" | tail -4
  ;;
v4-rest)  # the GPU tests v4's timeout did not reach (the masked own-keys indexer case last: it ran past the timeout),
          # each test's seconds shown; then where a 64K capture of the GLM-5 slice goes (256K passed 150 s profiled)
  PYTHONPATH=/tmp/site:/tmp/fla timeout 240 python3 -m pytest -v -rfE -m gpu --durations 12 \
    tests/test_kernels_gdn_decode.py tests/test_kernels_gdn.py::test_gpu_fla_conv_equals_torch_conv \
    tests/test_kernels_attention.py::test_prompt_dq_kernel_is_the_softmax_gradient tests/test_generation.py \
    tests/test_engine_gqa.py tests/test_kernels_indexer.py::test_glm_on_cuda_kernel_torch_path_offload_and_cuda_graph_decode \
    tests/test_kernels_sparse_attention.py "tests/test_kernels_indexer.py::test_indexer_topk_kernel_equals_torch_path[own-keys-masked]" \
    > "$OUT/pytest_gpu_rest.log" 2>&1
  echo "pytest -m gpu: rc=$?, $(grep -c PASSED "$OUT/pytest_gpu_rest.log") passed"
  grep -E " (FAILED|ERROR)|^FAILED|^ERROR" "$OUT/pytest_gpu_rest.log" | tail -12
  cd bench && timeout 200 python3 -u profile_replay.py --glm-slice --prompt 65536 --phase capture --top 25 2>&1 \
    | grep -v -i warn | tee "$OUT/glm_profile.log" | grep -E "^first|^profiled|Error"
  ;;
sa-probe)  # the fused selected-keys attention (GLM-5): its GPU tests, the GLM-5 GPU test through it, then it
           # against the torch path at a capture chunk's and a replay batch's shapes
  gpu_tests sa 90 tests/test_kernels_selected_keys_attention.py \
    tests/test_kernels_indexer.py::test_glm_on_cuda_kernel_torch_path_offload_and_cuda_graph_decode \
    tests/test_kernels_sparse_attention.py
  cd bench && timeout 120 python3 -u selected_attention_probe.py --keys 1048576 --tiles 2>&1 | grep -v -i warn \
    | tee "$OUT/sa_probe.log" | grep -v "^  tile"
  ;;
decode-profile)  # where the offloaded GLM-5 decode step's extra time goes: the slice at 1M, GPU then host state,
                 # each decode profiled (kernels of the replayed CUDA graphs included)
  cd bench
  for flag in "" --offload; do
    timeout 200 python3 -u profile_replay.py --glm-slice --prompt 1048576 --phase decode $flag --top 14 2>&1 \
      | grep -v -i warn > "$OUT/decode_profile${flag/--/_}.log"
    grep -E "^decode:|^profiled|^first" "$OUT/decode_profile${flag/--/_}.log"
    sed -n '/Name/,/Self CPU time total/p' "$OUT/decode_profile${flag/--/_}.log" | cut -c1-62,100-175 | head -20
  done
  ;;
gather-probe)  # the offloaded decode's gather of chosen rows from host memory: every tile, row order, the torch
               # path and a bulk copy; then the host gather's GPU tests (every tile)
  PYTHONPATH=/tmp/site timeout 60 python3 -m pytest -q -rfE -m gpu tests/test_kernels_host_gather.py \
    > "$OUT/pytest_gpu_gather.log" 2>&1
  echo "pytest -m gpu: rc=$?"; tail -n 2 "$OUT/pytest_gpu_gather.log"
  cd bench && timeout 120 python3 -u host_gather_probe.py 2>&1 | grep -v -i warn | tee "$OUT/host_gather_probe.log"
  ;;
glm-v4)  # session 9, after glm-v3: offloaded segments registered at their exact size (pinned_empty). GPU tests of
         # every offload path (GQA streaming, GLM-5, the full gradient with offload, not run in session 8), then
         # GLM-5 at 1M, GPU and host state, after a warm-up case per storage
  gpu_tests glm_v4 200 tests/test_kernels_host_gather.py tests/test_engine_gqa.py tests/test_full_gradient.py \
    tests/test_kernels_indexer.py::test_glm_on_cuda_kernel_torch_path_offload_and_cuda_graph_decode
  cd bench && timeout 300 python3 -u glm_slice.py --prompt 1048576 --gen-tokens 256 --budget-s 290 --tag _P1M_v4 \
    2>&1 | grep -v -i warn | tee "$OUT/glm_1m_v4.log" | tail -5
  ;;
glm-v3)  # session 9: GPU tests of the host gather, the selected-keys kernel (compiled once for every width) and
         # GLM-5 (offloaded decode as one CUDA graph); two negative controls that must fail; then GLM-5 at 1M, GPU
         # and host state in one process, after a warm-up case per storage
  gpu_tests glm_v3 150 tests/test_kernels_host_gather.py tests/test_kernels_selected_keys_attention.py \
    tests/test_kernels_sparse_attention.py \
    tests/test_kernels_indexer.py::test_glm_on_cuda_kernel_torch_path_offload_and_cuda_graph_decode
  cp kernels/selected_keys_attention.py /tmp/ska.py  # (the device's copy of the checkout: restored below)
  sed -i 's/ if os.environ.get("TRITON_INTERPRET") == "1" else 0,/,/' kernels/selected_keys_attention.py
  PYTHONPATH=/tmp/site timeout 60 python3 -m pytest -q -m gpu \
    tests/test_kernels_selected_keys_attention.py::test_kernel_compiles_once_for_every_width_and_length \
    > "$OUT/negative_compile_once.log" 2>&1
  echo "negative control, the row bound a compile-time constant again: rc=$? (1: the test failed, as it must)"
  cp /tmp/ska.py kernels/selected_keys_attention.py
  LONGSTRAW_HOST_GATHER_KERNEL=0 PYTHONPATH=/tmp/site timeout 60 python3 -m pytest -q -m gpu \
    tests/test_kernels_indexer.py::test_glm_on_cuda_kernel_torch_path_offload_and_cuda_graph_decode \
    > "$OUT/negative_gather_off.log" 2>&1
  echo "negative control, the host gather kernel off: rc=$? (1: the test failed, as it must)"
  cd bench && timeout 330 python3 -u glm_slice.py --prompt 1048576 --gen-tokens 256 --budget-s 320 --tag _P1M_v3 \
    2>&1 | grep -v -i warn | tee "$OUT/glm_1m_v3.log" | tail -5
  ;;
glm-2m-v3)  # then GLM-5 at 2M, GPU and host state in one process, after a warm-up case per storage
  cd bench && timeout 560 python3 -u glm_slice.py --prompt 2097152 --gen-tokens 256 --budget-s 550 --tag _P2M_v3 \
    2>&1 | grep -v -i warn | tee "$OUT/glm_2m_v3.log" | tail -5
  ;;
glm-v2)  # next: sa-probe (every tile), then the GLM-5 slice at 1M with GPU and host state in one process, as
         # glm_slice_3L_P1M.json (rev 7c18596) ran it: the fused attention in capture and replay, and the host
         # decode that syncs once a full layer, gathers into pinned memory and keeps the indexer keys on the device
  bash bench/run_device.sh sa-probe
  cd bench && timeout 300 python3 -u glm_slice.py --prompt 1048576 --gen-tokens 256 --budget-s 290 --tag _P1M_v2 \
    2>&1 | grep -v -i warn | tee "$OUT/glm_1m_v2.log" | tail -4
  ;;
glm-host)  # issue 13's remaining cases, first: 1M with host state (copies hidden: against session 7's 1M GPU case),
           # then where a 256K capture of the slice goes
  cd bench
  timeout 230 python3 -u glm_slice.py --prompt 1048576 --storage cpu --budget-s 220 --tag _P1M_host \
    --gpu-reference results/glm_slice_3L_P1M_gpu.json 2>&1 | grep -v -i warn | tee "$OUT/glm_1m_host.log" | tail -4
  timeout 150 python3 -u profile_replay.py --glm-slice --prompt 262144 --phase capture --top 25 2>&1 \
    | grep -v -i warn | tee "$OUT/glm_profile.log" | grep -E "^first|^profiled|Error"
  ;;
v3)  # issue 11: GPU tests of the fast paths (norms, GDN decode step, fla conv, dQ, indexer), then the whole 27B at
      # 512K. A fast path whose tests fail is switched off for this and the machine's later commands (switches.env)
  PYTHONPATH=/tmp/site:/tmp/fla timeout 170 python3 -m pytest -q -s -rfE -m gpu tests/test_kernels_elementwise.py \
    tests/test_kernels_gdn_decode.py tests/test_kernels_gdn.py::test_gpu_fla_conv_equals_torch_conv \
    tests/test_kernels_attention.py tests/test_kernels_indexer.py tests/test_generation.py tests/test_engine_gqa.py \
    > "$OUT/pytest_gpu.log" 2>&1
  rc=$?; echo "pytest -m gpu: rc=$rc"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest_gpu.log" | tail -12
  switch_off_failed "$OUT/pytest_gpu.log"
  cd bench && PYTHONPATH=/tmp/site:/tmp/fla timeout 375 python3 -u full_model.py --skip-stock --prompts 524288 \
    --response 256 --warmup-response 256 --budget-s 360 --tag _P512K_v3 $FUSED_FLAG 2>&1 | grep -v -i warn \
    | tee "$OUT/full.log" | tail -8
  ;;
last)  # session 7's last slot: GPU tests v3's timeout cut or that failed (norms at the capture shape, selected-keys
       # attention and a negative control of its fp32 gradient sum, prompt dQ), then GLM-5 at 1M, GPU state
  PYTHONPATH=/tmp/site timeout 50 python3 -m pytest -v -rfE -m gpu tests/test_kernels_sparse_attention.py \
    tests/test_kernels_elementwise.py::test_rms_norm_bf16_on_cuda tests/test_kernels_elementwise.py::test_gated_rms_norm_bf16_on_cuda \
    tests/test_kernels_attention.py::test_prompt_dq_kernel_is_the_softmax_gradient \
    > "$OUT/pytest_gpu.log" 2>&1
  echo "pytest -m gpu: rc=$?"; grep -E "(PASSED|FAILED|ERROR)" "$OUT/pytest_gpu.log" | grep -v "^tests.*PASSED" | tail -12
  grep -c "PASSED" "$OUT/pytest_gpu.log"
  cp kernels/sparse_attention.py /tmp/sa.py; sed -i 's/        table = table.float()/        pass/' kernels/sparse_attention.py
  PYTHONPATH=/tmp/site timeout 25 python3 -m pytest -q -m gpu tests/test_kernels_sparse_attention.py 2>&1 | tail -1 \
    | sed 's/^/negative control (bf16 gradient sum), must fail: /'; cp /tmp/sa.py kernels/sparse_attention.py
  cd bench && timeout 150 python3 -u glm_slice.py --prompt 1048576 --storage gpu --gen-tokens 128 --budget-s 140 \
    --tag _P1M_gpu 2>&1 | grep -v -i warn | tee "$OUT/glm.log" | tail -4
  ;;
diag)  # where replay, decode and capture spend their time (16-layer slice, 512K), a GLM-5 smoke, the GPU tests
  cd bench
  PYTHONPATH=/tmp/site:/tmp/fla timeout 240 python3 -u profile_replay.py --layers 16 --prompt 524288 \
    --phase replay decode capture --batches 8 --top 40 2>&1 | grep -v -i warn | tee "$OUT/profile.log" \
    | grep -E "^first|^profiled|^replay|^decode|Error"
  timeout 110 python3 -u glm_slice.py --prompt 65536 --response 256 --gen-tokens 64 --offload-gen-tokens 32 \
    --budget-s 100 --tag _smoke 2>&1 | grep -v -i warn | tee "$OUT/glm_smoke.log" | tail -8
  cd ..
  PYTHONPATH=/tmp/site:/tmp/fla timeout 200 python3 -m pytest -q -s -m gpu tests/ > "$OUT/pytest_gpu.log" 2>&1
  echo "pytest -m gpu: rc=$?"; grep -E "passed|failed|Error|error" "$OUT/pytest_gpu.log" | tail -12
  ;;
probe)  # what a new key length costs cuDNN; replay + backward of 1, 4, 8 responses together (args to profile_replay)
  shift
  cd bench && PYTHONPATH=/tmp/site:/tmp/fla timeout 60 python3 -u cudnn_shape_probe.py 2>&1 | grep -v -i warn \
    | tee "$OUT/cudnn_probe.log" | grep -E "^keys"
  PYTHONPATH=/tmp/site:/tmp/fla timeout 300 python3 -u profile_replay.py "$@" 2>&1 | grep -v -i warn \
    | tee "$OUT/profile.log" | grep -E "^first|^profiled|^replay"
  ;;
dq)  # the replay's dQ kernel: its GPU test, then against the flash backward at replay shapes
  PYTHONPATH=/tmp/site:/tmp/fla timeout 120 python3 -m pytest -q -s -m gpu tests/test_kernels_attention.py \
    > "$OUT/pytest_dq.log" 2>&1; echo "pytest kernels: rc=$?"; grep -E "prompt_dq|passed|failed" "$OUT/pytest_dq.log" | tail -8
  cd bench && timeout 150 python3 -u prompt_dq_probe.py --keys 131072 524288 --responses 1 8 2>&1 \
    | grep -v -i warn | tee "$OUT/dq_probe.log" | grep -E "^keys|Error"
  ;;
v2smoke)  # engine v2 on a 4-layer slice: GPU tests (CUDA-graph decode, cuDNN/flash paths), then 128K/512K
  PYTHONPATH=/tmp/site:/tmp/fla timeout 200 python3 -m pytest -q -s -m gpu tests/ > "$OUT/pytest_gpu.log" 2>&1
  echo "pytest -m gpu: rc=$?"; grep -E "passed|failed|Error|error" "$OUT/pytest_gpu.log" | tail -8
  cd bench && PYTHONPATH=/tmp/site:/tmp/fla timeout 300 python3 engine_slice.py --preset qwen3.6-27b \
    --prompt 131072 524288 --groups 8 --tag _v2smoke 2>&1 | grep -v -i warn | tee "$OUT/engine.log" | tail -14
  ;;
engine)
  PYTHONPATH=/tmp/site:/tmp/fla timeout 110 python3 -m pytest -q -s -m gpu tests/ > "$OUT/pytest_gpu.log" 2>&1
  echo "pytest -m gpu: rc=$?"; tail -3 "$OUT/pytest_gpu.log"
  cd bench && PYTHONPATH=/tmp/site:/tmp/fla timeout 450 python3 engine_slice.py --preset qwen3.6-27b \
    --prompt 131072 524288 1048576 2097152 --groups 8 2>&1 | grep -v -i warn | tee "$OUT/engine.log" | tail -12
  ;;
compare)
  cd bench
  timeout 100 python3 -m torch.distributed.run --nproc_per_node 2 cp_slice.py --check-only --backend gloo \
    > "$OUT/cpcheck.log" 2>&1; echo "cp check rc=$?"; grep -E "check at|wrote" "$OUT/cpcheck.log"
  timeout 230 python3 compare_stock.py --preset qwen3-8b --prompts 32768 131072 524288 1048576 --budget-s 190 \
    2>&1 | grep -v -i warn | tee "$OUT/compare_8b.log" | tail -8
  timeout 230 python3 compare_stock.py --preset qwen3.6-27b --prompts 32768 131072 262144 --budget-s 190 \
    2>&1 | grep -v -i warn | tee "$OUT/compare_27b.log" | tail -8
  ;;
final)  # what the first two left: the 2M point of (c), and stock at 128K/256K beside LongStraw on the 27B slice
  cd bench
  timeout 340 python3 engine_slice.py --preset qwen3.6-27b --prompt 2097152 --groups 8 --tag _2M 2>&1 \
    | grep -v -i warn | tee "$OUT/engine_2M.log" | tail -4
  timeout 220 python3 compare_stock.py --preset qwen3.6-27b --prompts 131072 262144 --stock-sequences 1 \
    --budget-s 200 --tag _stock1seq 2>&1 | grep -v -i warn | tee "$OUT/compare_27b_1seq.log" | tail -6
  ;;
cp8-2m)  # issue 7 on nvidia-h200-x8 (not run yet): P = 2M, CP8, G = 8, with generation
  cd bench
  timeout 560 python3 -m torch.distributed.run --nproc_per_node 8 cp_slice.py --preset qwen3.6-27b \
    --prompt 2097152 2>&1 | grep -v -i warn | tee "$OUT/cp8_2m.log" | tail -16
  ;;
cp8-4m)  # issue 7: P = 4,456,448, eight G = 8 replay cycles on the same prefix (reuse)
  cd bench
  timeout 560 python3 -m torch.distributed.run --nproc_per_node 8 cp_slice.py --preset qwen3.6-27b \
    --prompt 4456448 --cycles 8 2>&1 | grep -v -i warn | tee "$OUT/cp8_4m.log" | tail -16
  ;;
grad)  # issue 14 on the 27B slice, most important first: the bf16 full-gradient check against stock (without fla:
      # the stock layers would train through fla's backward), then P = 512K (full and response-only, G = 8,
      # R = 2048), one R = 65,536 response (reverse block replay vs whole replay), P = 1M; a short table last
  cd bench
  timeout 60 python3 -u full_gradient.py --prompt --check 4096 --tag _check 2>&1 | grep -v -i warn \
    | tee "$OUT/grad_check.log" | tail -2
  PYTHONPATH=/tmp/site:/tmp/fla timeout 170 python3 -u full_gradient.py --prompt 524288 --check 0 --tag _512K 2>&1 \
    | grep -v -i warn | tee "$OUT/grad_512k.log" | tail -6
  PYTHONPATH=/tmp/site:/tmp/fla timeout 120 python3 -u full_gradient.py --prompt --check 0 --long-response 65536 \
    --block 4096 --tag _R64K 2>&1 | grep -v -i warn | tee "$OUT/grad_r64k.log" | tail -5
  PYTHONPATH=/tmp/site:/tmp/fla timeout 200 python3 -u full_gradient.py --prompt 1048576 --check 0 --tag _1M 2>&1 \
    | grep -v -i warn | tee "$OUT/grad_1m.log" | tail -5
  python3 - "$OUT" <<'PY'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("full_gradient_*.json")):
    d = json.loads(f.read_text())
    if "check_bf16" in d: print("check", d["check_bf16"])
    for s in d["steps"]:
        print(f"P={s['prompt_tokens']} {s['mode']}: step {s['step_s']:.1f}s (capture {s['capture_s']:.1f}, replays "
              f"{s['replay_s_total']:.1f}, prompt bwd {s['prompt_backward_s']:.1f}); peak replay "
              f"{s['replay_peak_gib']:.1f} / prompt bwd {s.get('prompt_backward_peak_gib', 0):.1f} GiB")
    for r in d["long_response"]:
        print(f"R={r['response_tokens']} {r['replay']}: ok={r['ok']} peak {r['peak_gib']:.1f} GiB "
              f"{r.get('seconds', float('nan')):.1f}s")
PY
  ;;
prefix-tree)  # issue 27 item 1: 8 decision points of one 512K trajectory (not prefixes of each other) on the Qwen3.6-27B
              # slice: the batch trie's trunk captured once, each point branching off the last (steps), against whole
              # captures of 2 points (~9 s each); args to the script
  shift
  cd bench && PYTHONPATH=/tmp/site:/tmp/fla timeout 470 python3 -u prefix_tree.py "$@" 2>&1 | grep -v -i warn \
    | tee "$OUT/prefix_tree.log" | tail -30
  ;;
agents)  # issue 12: P = 512K, G = 8, three tool turns per rollout on the Qwen3.6-27B slice; args to the script
  shift
  cd bench && PYTHONPATH=/tmp/site:/tmp/fla timeout 500 python3 -u agent_turns.py "$@" 2>&1 | grep -v -i warn \
    | tee "$OUT/agents.log" | tail -12
  ;;
glm)  # issue 13: where a GLM-5 slice's replay spends its time (P = 64K; it was 175x its floor), then the slice
       # (1 dense + 2 MoE, indexer full/shared/shared), G = 8, R = 2048, in order 1M GPU state, 1M host state,
       # 2M GPU, 2M host; one estimated past the budget is skipped (listed in the JSON and the table).
       # The indexer kernel's GPU tests run in v3 (switches.env)
  cd bench
  timeout 110 python3 -u profile_replay.py --glm-slice --prompt 65536 --phase replay --top 25 2>&1 \
    | grep -v -i warn | tee "$OUT/glm_profile.log" | grep -E "^first|^profiled|^replay|Error"
  timeout 440 python3 -u glm_slice.py --prompt 1048576 2097152 --gen-tokens 512 --budget-s 420 2>&1 \
    | grep -v -i warn | tee "$OUT/glm.log" | tail -8
  ;;
glm-2m-gpu)  # the 2M cases one a command (if glm-2m's budget skips the host case): GPU state; its JSON stays on
             # the warm machine (.triton_cache/) for glm-2m-host's copy overlap
  cd bench && timeout 420 python3 -u glm_slice.py --prompt 2097152 --storage gpu --gen-tokens 256 --budget-s 410 \
    --tag _P2M_gpu 2>&1 | grep -v -i warn | tee "$OUT/glm_2m_gpu.log" | tail -3
  cp "$OUT/glm_slice_3L_P2M_gpu.json" "$TRITON_CACHE_DIR/" 2>/dev/null
  ;;
glm-2m-host)
  cd bench && timeout 480 python3 -u glm_slice.py --prompt 2097152 --storage cpu --budget-s 470 --tag _P2M_host \
    --gpu-reference "$TRITON_CACHE_DIR/glm_slice_3L_P2M_gpu.json" 2>&1 | grep -v -i warn | tee "$OUT/glm_2m_host.log" \
    | tail -4
  ;;
glm-2m)  # issue 13's 2M cases, GPU then host state in one process (the copy overlap pairs them)
  cd bench && timeout 590 python3 -u glm_slice.py --prompt 2097152 --gen-tokens 256 --budget-s 570 --tag _P2M 2>&1 \
    | grep -v -i warn | tee "$OUT/glm_2m.log" | tail -10
  ;;
full-1m)  # issue 11's whole GRPO step at P = 1M, G = 8, R = 1024 in one command: no warm-up step (the first step
          # is timed cold, compilation included), the responses replayed 4 at a time (plan 123.8 GiB against 129.1 for 8)
  cd bench && PYTHONPATH=/tmp/site:/tmp/fla timeout 592 python3 -u full_model.py --skip-stock --prompts 1048576 \
    --response 1024 --warmup-prompt 0 --replay-batch-tokens 4100 --budget-s 580 --tag _P1M $FUSED_FLAG 2>&1 | grep -v -i warn \
    | tee "$OUT/full.log" | tail -8
  ;;
full)  # the whole Qwen3.6-27B with LoRA r=64: LongStraw steps vs floors, then stock TRL until OOM. Extra
       # arguments go to full_model.py: `full --skip-stock` (with fla: no stock layer trains through it) and
       # `full --skip-longstraw --tag _stock` (without fla) each fit one command; both sides at once may not
  shift
  path=/tmp/site
  if [[ " $* " == *" --skip-stock "* ]]; then path=/tmp/site:/tmp/fla; fi
  cd bench
  PYTHONPATH=$path timeout 590 python3 -u full_model.py "$@" 2>&1 | grep -v -i warn | tee "$OUT/full.log" \
    | tail -16
  ;;
full-262k)  # issue 25: the whole 27B's GRPO step at 262K, response-only then full (TRL's checkpointing, 16K chunks),
           # each phase beside its floor; last measured in session 12 (prompt backward 3.1x its floor), before the kept
           # page parts (session 16) and the cuDNN backward (session 13)
  shift
  cd bench && PYTHONPATH=/tmp/site:/tmp/fla timeout 590 python3 -u full_model.py --skip-stock --prompts 262144 \
    --response 256 --gradient-modes response_only full --warmup-prompt 16384 --warmup-response 8 --budget-s 560 \
    --tag _full_P256K_v2 "$@" 2>&1 | grep -v -i warn | tee "$OUT/full_262k.log" | tail -8
  ;;
pb-ab)  # issue 25 (session 20): the full step's prompt backward at 64K (whole 27B, state on the host, 8K chunks, R = 32)
       # with HF's norm / MLP forwards and their autograd backward, then with the fused kernels and their Triton
       # backward (autograd_fused_kernels), two processes back to back, the middle segment of each profiled; the
       # fused kernels' GPU tests first (a failure switches nothing off: the second process then shows it)
  shift
  GPU_TESTS_PATH=/tmp/site:/tmp/fla gpu_tests elementwise 150 tests/test_kernels_elementwise.py
  tail -1 "$OUT/pytest_gpu_elementwise.log"
  cd bench
  for fused in --no-autograd-fused-kernels --autograd-fused-kernels; do
    PYTHONPATH=/tmp/site:/tmp/fla timeout "${AB_TIMEOUT:-250}" python3 -u full_model.py --skip-stock \
      --prompts "${AB_PROMPT:-65536}" --response 32 --gradient-modes full --offload cpu --chunk 8192 \
      --warmup-prompt 16384 --warmup-response 8 --profile-segment 40 --budget-s "$(( ${AB_TIMEOUT:-250} - 15 ))" "$fused" \
      --tag "_pb_ab_${fused#--}${AB_TAG:-}" "$@" 2>&1 | grep -v -i warn > "$OUT/pb_ab_${fused#--}.log"
    tail -3 "$OUT/pb_ab_${fused#--}.log"
  done
  python3 pb_summary.py "$OUT/full_model_*_pb_ab_*.json" | grep -v "^    [0-9]" | tee "$OUT/pb_ab_summary.txt"
  ;;
pb-ckpt-128k)  # issue 25 (session 17): the full step at 128K with 1K chunks, the prompt backward checkpointed (as TRL's
               # default) and then not (prompt_backward_checkpoint_layers=False, planned 134 GiB): two processes
  shift
  cd bench
  for pb in --prompt-backward-checkpointing --no-prompt-backward-checkpointing; do
    PYTHONPATH=/tmp/site:/tmp/fla timeout 290 python3 -u full_model.py --skip-stock --prompts 131072 --response 256 \
      --gradient-modes full --chunk 1024 --warmup-prompt 4096 --warmup-response 8 --budget-s 270 "$pb" \
      --tag "_full_P128K_chunk1K${pb#--}" "$@" 2>&1 | grep -v -i warn | tee "$OUT/pb_ckpt${pb#--}.log" | tail -4
  done
  ;;
glm-train|glm-ep2-cp2|glm-ep8-cp8)
  # issue 28: a GLM-5 slice through LongStrawGRPOTrainer.train() (full_model.py --preset glm-5: GLM_LAYERS layers,
  # default 4: layer 0 dense, 3 MoE layers of 256 experts top-8; LoRA r=64 on every linear layer but the MLP
  # projections, whose names PEFT also maps onto the split experts), G = 8, R = 256, after a 64K warm-up step
  # (128K under CP8: a 16K page a rank). glm-train: one GPU, no EP (the same path, measurable on the lent card); glm-ep2-cp2 on
  # nvidia-h200-x2 (cp2.yaml) and glm-ep8-cp8 on nvidia-h200-x8 (cp8.yaml): the experts split over the CP group
  # (ep_size = cp_size, transformers' EP, all_reduce), the prompt pages over its ranks. Per rank: peak against the
  # plan, state bytes, experts held (the JSON's by_rank and expert_parallel). Phases without floors (glm_slice.py
  # has GLM-5's on one GPU). GLM_PROMPT: another P (default 512K, 1M, 2M); GLM_TIMEOUT: seconds (default 590).
  # Later arguments go to full_model.py (e.g. --gradient-modes response_only full).
  mode=$1
  shift
  case $mode in
    glm-train) P=524288 size=1 config="" warm=65536 ;;
    glm-ep2-cp2) P=1048576 size=2 config=cp2.yaml warm=65536 ;;
    glm-ep8-cp8) P=2097152 size=8 config=cp8.yaml warm=131072 ;;
  esac
  P=${GLM_PROMPT:-$P}
  limit=${GLM_TIMEOUT:-590}
  args=(--preset glm-5 --layers "${GLM_LAYERS:-4}" --skip-stock --prompts "$P" --response 256 --warmup-prompt "$warm"
        --warmup-response 16 --budget-s $((limit - 30)) --tag "_${mode}_$P" "$@")
  cd bench
  if [[ -z $config ]]; then
    cmd=(python3 -u full_model.py "${args[@]}")
  else
    cmd=(python3 -u -m accelerate.commands.launch --mixed_precision bf16 --config_file "../examples/accelerate/$config"
         full_model.py "${args[@]}" --cp-size "$size" --ep-size "$size")
  fi
  PYTHONPATH=/tmp/site:/tmp/fla timeout "$limit" "${cmd[@]}" 2>&1 | grep -v -i warn | tee "$OUT/$mode.log" | tail -12
  ;;
fsdp1-plain|fsdp1|cp2|fsdp2-cp2|fsdp2-cp8)
  # issue 28 (docs/fsdp.md): one LongStrawGRPOTrainer step of the whole Qwen3.6-27B, LoRA r=64, P = 512K, R = 256,
  # after full_model.py's warm-up step. fsdp1 wraps the policy with FSDP2 at world size 1 (examples/accelerate/
  # fsdp2.yaml on 1 process: every FSDP2 hook runs, every collective is trivial): its step must take at most 5% more
  # than fsdp1-plain's, run first on the same machine (its Triton cache then serves both). cp2 and fsdp2-cp2 run on
  # a 2-GPU machine (nvidia-h200-x2): CP2 under DDP, then FSDP2 x CP2 on the same 2 ranks.
  # fsdp2-cp8 (nvidia-h200-x8, not run yet) is the README's planned target: the whole 27B *fully fine-tuned*
  # (--lora-rank 0) at P = 2M, G = 8, R = 2048, FSDP2 x CP8 on 8 ranks (fsdp2_cp8.yaml; planned 116.56 GiB a rank in
  # the replays without Accelerate's fp32 masters, docs/fsdp.md): the step, its peak a rank against that plan.
  # Its warm-up prompt, 131072, gives each of the 8 ranks one 16K page.
  # FSDP1_PROMPT: another P (e.g. 262144 where 512K does not fit the lent GPU); the JSON names carry it.
  # FSDP1_TIMEOUT: seconds for this mode's step (default 590), e.g. 290 to run fsdp1-plain and fsdp1 in one call
  # Later arguments go to full_model.py and win over these (e.g. fsdp1 --offload cpu --response 32 on an 80 GB card).
  mode=$1
  shift
  P=${FSDP1_PROMPT:-$([[ $mode == fsdp2-cp8 ]] && echo 2097152 || echo 524288)}
  tagp=$([[ $P == 524288 ]] && echo 512k || echo "$P")
  limit=${FSDP1_TIMEOUT:-590}
  R=$([[ $mode == fsdp2-cp8 ]] && echo 2048 || echo 256)
  common=(--skip-stock --prompts "$P" --response "$R" --budget-s $((limit - 30)) "$@")
  launch=(python3 -u -m accelerate.commands.launch --mixed_precision bf16)
  cd bench
  case $mode in
    fsdp1-plain) cmd=(python3 -u full_model.py "${common[@]}" --tag "_plain$tagp") ;;
    fsdp1) cmd=("${launch[@]}" --config_file ../examples/accelerate/fsdp2.yaml --num_processes 1 full_model.py
                "${common[@]}" --tag "_fsdp1$([[ $tagp == 512k ]] || echo "_$tagp")") ;;
    cp2) cmd=("${launch[@]}" --config_file ../examples/accelerate/cp2.yaml full_model.py "${common[@]}"
              --cp-size 2 --tag _cp2) ;;
    fsdp2-cp2) cmd=("${launch[@]}" --config_file ../examples/accelerate/fsdp2.yaml --num_processes 2 full_model.py
                    "${common[@]}" --cp-size 2 --tag _fsdp2_cp2) ;;
    fsdp2-cp8) cmd=("${launch[@]}" --config_file ../examples/accelerate/fsdp2_cp8.yaml full_model.py
                    --lora-rank 0 --warmup-prompt 131072 --warmup-response 32 "${common[@]}" --cp-size 8
                    --tag "_fsdp2_cp8_full_finetune_$tagp") ;;
  esac
  PYTHONPATH=/tmp/site:/tmp/fla timeout "$limit" "${cmd[@]}" 2>&1 | grep -v -i warn | tee "$OUT/$mode.log" | tail -16
  # the plain step's JSON waits in /tmp (kept on a warm machine) for fsdp1's comparison
  if [[ $mode == fsdp1-plain ]]; then cp "$OUT/full_model_qwen3.6-27b_plain$tagp.json" /tmp/ 2>/dev/null; fi
  fsdp_json="$OUT/full_model_qwen3.6-27b_fsdp1$([[ $tagp == 512k ]] || echo "_$tagp").json"
  if [[ $mode == fsdp1 && -f /tmp/full_model_qwen3.6-27b_plain$tagp.json ]]; then
    python3 - "$fsdp_json" "/tmp/full_model_qwen3.6-27b_plain$tagp.json" <<'PY' | tee "$OUT/fsdp1_vs_plain.txt"
import json, sys
fsdp, plain = (json.load(open(p))["longstraw"][-1] for p in sys.argv[1:])
if "train_s" not in fsdp or "train_s" not in plain:  # a failed, OOM or cut step: say which, no ratio
    sys.exit(f"no comparison: FSDP2 step {fsdp.get('status') or fsdp.get('error') or fsdp.get('oom')}, "
             f"plain step {plain.get('status') or plain.get('error') or plain.get('oom')}")
ratio = fsdp["train_s"] / plain["train_s"]
print(f"FSDP2 world 1: {fsdp['train_s']:.1f} s, plain {plain['train_s']:.1f} s: x{ratio:.3f} "
      f"({'within' if ratio <= 1.05 else 'OVER'} the 5% budget); peak {fsdp['peak_gib']:.1f} vs {plain['peak_gib']:.1f} GiB")
for phase in fsdp["phases"]:
    print(f"  {phase}: {fsdp['phases'][phase]['seconds']:.1f} s vs {plain['phases'][phase]['seconds']:.1f} s")
PY
  fi
  ;;
esac
