#!/usr/bin/env bash
# The GPU checks, for the lent H200 machines (CI has no GPU): builds with CUDA and NCCL, runs
# the distributed tests with --backend=cuda on 1 and 2 ranks (one GPU each, or two sharing the
# one GPU; every case against the float64 CPU oracle), then times the example. Logs go to
# $OUT (or ./gpu-logs).
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root" || exit 1
out="${OUT:-$root/gpu-logs}"
mkdir -p "$out"
# Never use NVLink multicast on the shared machines (shared/DEVICE.md).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PATH="/opt/torch/.venv/bin:$PATH:/usr/local/cuda/bin" OPENBLAS_NUM_THREADS=1
export SHARDMUON_TEST_REPORT_ERRORS=1  # the tests print each case's error and tolerance
mpi=(mpirun --allow-run-as-root --oversubscribe -x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST
     -x NVSHMEM_DISABLE_NVLS -x OPENBLAS_NUM_THREADS -x SHARDMUON_TEST_REPORT_ERRORS)
what="${1:-all}"  # all | tests | callbacks | torch | final | timeout | speed | step | sanitize | targets
gpus=$(nvidia-smi -L | wc -l)
nvidia-smi -L
echo "gpus: $gpus"
# Where one GPU is lent, the 2-rank runs share it over NCCL (scripts/rank_host_id.sh: a host
# id of its own per rank, so that NCCL connects them over loopback sockets): every NCCL path
# runs, though not over NVLink, and its timings mean nothing.
shared=() torchrun_shared=()
if [[ $gpus -lt 2 ]]; then
  shared=("$root/scripts/rank_host_id.sh")
  torchrun_shared=(--no-python "$root/scripts/rank_host_id.sh" python3)
fi
# The sanitize mode's suite shards, one process each, and the range of them it runs
# (SANITIZE_SUITE_SHARDS=first-last, all by default): racecheck over the whole suite outlasted
# a 470 s call (forty-fifth session), so it can be split across calls. Checked here, before
# the build, so that a mistyped range costs no device time.
sanitize_shards=$(( $(nproc) > 3 ? $(nproc) - 2 : 1 ))
sanitize_range=${SANITIZE_SUITE_SHARDS:-0-$((sanitize_shards - 1))}
if ! [[ $sanitize_range =~ ^([0-9]+)-([0-9]+)$ ]] ||
  (( BASH_REMATCH[1] > BASH_REMATCH[2] || BASH_REMATCH[2] >= sanitize_shards )); then
  echo "SANITIZE_SUITE_SHARDS must be first-last within 0-$((sanitize_shards - 1)), got '$sanitize_range'" >&2
  exit 2
fi
sanitize_first=${BASH_REMATCH[1]} sanitize_last=${BASH_REMATCH[2]}

build="build-gpu"
# Header-only dependencies the GPU image may lack can be carried in .deps/include.
deps=()
if [[ -d "$root/.deps/include" ]]; then deps=(-DSHARDMUON_DEPS_DIR="$root/.deps"); fi
# The image's default g++ (/opt/gcc/bin/g++) is a wrapper that links every shared library
# with -Bsymbolic, appended after any flag of ours. The library then binds to its own copies
# of libstdc++'s template statics (locale facet ids) and crashes in the first ostringstream
# inside a process that also uses libstdc++, such as PyTorch. The distribution's g++ links
# normally.
if [[ -x /usr/bin/g++ ]]; then
  deps+=(-DCMAKE_CXX_COMPILER=/usr/bin/g++ -DCMAKE_CUDA_HOST_COMPILER=/usr/bin/g++)
fi
cmake -S . -B $build -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DSHARDMUON_WARNINGS_AS_ERRORS=ON "${deps[@]}" >"$out/configure.log" 2>&1 ||
  { tail -30 "$out/configure.log"; exit 1; }
grep -E "zlib|ZLIB|nlohmann" "$out/configure.log" | head -3
start=$(date +%s)
cmake --build $build --parallel "$(nproc)" -- -k 0 >"$out/build.log" 2>&1 || { grep -E "error" -A5 "$out/build.log" | head -60; exit 1; }
echo "build: $(( $(date +%s) - start )) s"

results=()
# A run cut off by `timeout` (SIGTERM) still prints what it finished, and stops the runs in
# flight: the logs past the tool's file limit do not come back, so these lines are all a
# cut-off call would report. Bash runs a trap only once the command in the foreground has
# returned, so every long command runs through `bounded` (its own time limit, in the
# background, waited for): a foreground test under racecheck had held the trap past the
# machine's limit, and the call came back with nothing (twenty-eighth session). The trap
# writes to the script's own output, fd 3: it runs inside the interrupted command's
# redirections, which had sent its lines into that command's log.
exec 3>&1
trap '{ echo "== cut off (SIGTERM); results so far:"; printf "%s\n" "${results[@]}"; } >&3 2>&1
  kill $(jobs -p) 2>/dev/null; exit 124' TERM
# A command still running 15 s after its time limit's SIGTERM is killed (`timeout -k`):
# compute-sanitizer's initcheck, deep in millions of reports, outlived a plain `timeout 200`
# until the machine's limit cut the whole call off (thirty-first session).
kill_after=15
bounded() {  # seconds, command...: `timeout seconds command...`, its status
  timeout -k $kill_after "$@" &
  wait $!
}
# The front end's CPU tests that Debian's PyTorch 1.13 cannot run (DTensor, on gloo processes),
# with the lent machine's PyTorch 2.x, beside the single-process ones. Its venv may lack
# pytest: then Debian's (pure Python) can be carried in .deps/pytest_pkgs.
front_end_pytest() {
  local pythonpath=${PYTHONPATH:-}
  if ! python3 -c "import pytest" 2>/dev/null && [[ -d "$root/.deps/pytest_pkgs" ]]; then
    pythonpath="$root/.deps/pytest_pkgs"
  fi
  SHARDMUON_LIBRARY="$root/$build/libshardmuon.so" PYTHONPATH="$pythonpath" bounded 420 \
    python3 -m pytest -q -p no:cacheprovider python/tests/test_dtensor.py python/tests/test_muon.py \
    python/tests/test_dtensor_placements.py >"$out/pytest_torch2.log" 2>&1
  results+=("front end on this PyTorch: $(tail -1 "$out/pytest_torch2.log")")
}
# The PyTorch checks on the GPU (python/tests/gpu/check_torch_gpu.py): 2 ranks against the
# whole-matrix reference (one GPU each, or sharing the one), then 1 rank against
# torch.optim.Muon; logs torch_gpu_2.log and torch_gpu_1.log.
torch_gpu_checks() {
  export SHARDMUON_LIBRARY="$root/$build/libshardmuon.so"
  bounded 200 torchrun --nproc_per_node=2 "${torchrun_shared[@]}" python/tests/gpu/check_torch_gpu.py \
    >"$out/torch_gpu_2.log" 2>&1
  results+=("torch checks on 2 ranks: rc=$? $(grep -h 'torch GPU checks' "$out/torch_gpu_2.log")")
  bounded 120 python3 python/tests/gpu/check_torch_gpu.py >"$out/torch_gpu_1.log" 2>&1
  results+=("torch checks on 1 rank: rc=$? $(grep -h 'torch GPU checks' "$out/torch_gpu_1.log")")
  grep -hE "FAIL|Error|torch.optim.Muon" "$out"/torch_gpu_*.log | head -20
}
# The CUDA tests on 1 and 2 ranks over NCCL, one rank per GPU (two sharing one where one GPU is
# lent), with a gtest filter; logs <name>_npN.log.
cuda_tests() {
  local name=$1 filter=$2 ranks log rc wrap
  for ranks in 1 2; do
    log="$out/${name}_np$ranks.log"
    wrap=()
    [[ $ranks -gt $gpus ]] && wrap=("${shared[@]}")
    # The multi-block case computes float64 oracles of side 2085 on the CPU, through OpenBLAS
    # with the rank's share of the cores (10 s each on one core of the 2-core CI machine).
    OPENBLAS_NUM_THREADS=$(( $(nproc) / ranks )) bounded 400 "${mpi[@]}" -np $ranks "${wrap[@]}" \
      $build/tests/shardmuon_tests --backend=cuda --gtest_brief=1 --gtest_filter="$filter" >"$log" 2>&1
    rc=$?
    grep -E "^\[rank|Failure|FAILED" "$log" | head -20
    results+=("$name on $ranks rank(s), $gpus GPU(s), NCCL: rc=$rc $(grep -E 'PASSED|FAILED  \]|SKIPPED \]' "$log" | sed 's/\x1b\[[0-9;]*m//g' | tr '\n' ' ')")
    if grep -q 'ratio=' "$log"; then
      results+=("  largest error/tolerance: $(grep -o 'ratio=[0-9.]*' "$log" | sort -t= -k2 -g | tail -1) over $(grep -c 'ratio=' "$log") checked cases")
    fi
  done
}
# The CUDA tests on 2 and 3 ranks over --comm=callbacks (tests/common/mpi_callbacks.h): the
# ranks share the GPUs there are, so every distributed path runs against the single-rank
# result without NCCL, with uneven shards over three ranks. The data moves through host
# memory, which NCCL's Gram sums in bf16 never do: those are checked over NCCL (cuda_tests).
callback_tests() {
  callback_run 2 '-*MultiBlock*' callbacks_np2
  callback_run 3 '-*MultiBlock*' callbacks_np3
  callback_run 2 '*MultiBlock*' callbacks_np2_multiblock  # its groups are of 1 and 2
}
callback_run() {  # ranks, gtest filter, log name
  local ranks=$1 filter=$2 log="$out/$3.log" rc
  OPENBLAS_NUM_THREADS=$(( $(nproc) / ranks )) bounded 300 "${mpi[@]}" -np "$ranks" \
    $build/tests/shardmuon_tests --backend=cuda --comm=callbacks --gtest_brief=1 \
    --gtest_filter="$filter" >"$log" 2>&1
  rc=$?
  grep -E "^\[rank|Failure|FAILED" "$log" | head -20
  results+=("callbacks, $ranks ranks on $gpus GPU(s), $filter: rc=$rc $(grep -E 'PASSED|FAILED  \]|SKIPPED \]' "$log" | sed 's/\x1b\[[0-9;]*m//g' | tr '\n' ' ') largest $(grep -o 'ratio=[0-9.]*' "$log" | sort -t= -k2 -g | tail -1) over $(grep -c 'ratio=' "$log")")
}
# The CUDA backend's symmetric passes against the CPU backend's (one GPU): the unpacking that
# multi-rank Grams use is checked here even where only one GPU is lent.
gpu_unit() {
  local log="$out/gpu_unit.log"
  bounded 120 $build/tests/shardmuon_gpu_unit_tests --gtest_brief=1 >"$log" 2>&1
  local rc=$?
  grep -E "Failure" -A3 "$log" | head -20
  results+=("GPU unit tests: rc=$rc $(grep -E 'PASSED|FAILED  \]|SKIPPED \]' "$log" | sed 's/\x1b\[[0-9;]*m//g' | tr '\n' ' ')")
}
# The Newton-Schulz and step tests on 1 GPU with narrow symmetric blocks (96 and 32 columns
# instead of the default 512): the test matrices then split into several block columns whose
# starts are not multiples of the unpacking kernel's 64-wide tiles, which the default width
# never gives them.
narrow_blocks() {
  local block log rc
  for block in 96 32; do
    log="$out/narrow_blocks_$block.log"
    bounded 200 "${mpi[@]}" -x SHARDMUON_SYMMETRIC_BLOCK=$block -np 1 $build/tests/shardmuon_tests \
      --backend=cuda --gtest_brief=1 --gtest_filter='*NewtonSchulz*:*gramns*:*MuonStep*:-*MultiBlock*' \
      >"$log" 2>&1
    rc=$?
    grep -E "Failure|FAILED" "$log" | head -10
    results+=("tests with $block-column blocks (1 GPU): rc=$rc $(grep -E 'PASSED|FAILED  \]' "$log" | sed 's/\x1b\[[0-9;]*m//g' | tr '\n' ' ') largest $(grep -o 'ratio=[0-9.]*' "$log" | sort -t= -k2 -g | tail -1)")
  done
}
# The injected fault on its own (one rank never calls; NCCL), with progress lines from the
# test; if it is still running after 40 s, the stacks of both ranks (gdb) go to the log.
timeout_injection() {
  local log="$out/timeout.log"
  SHARDMUON_TEST_PROGRESS=1 "${mpi[@]}" -x SHARDMUON_TEST_PROGRESS -np 2 "${shared[@]}" \
    $build/tests/shardmuon_tests --backend=cuda --gtest_brief=1 \
    --gtest_filter='Reliability.ARankThatNeverCalls*' >"$log" 2>&1 &
  local job=$! waited=0
  while kill -0 $job 2>/dev/null && [[ $waited -lt 40 ]]; do sleep 1; waited=$((waited + 1)); done
  if kill -0 $job 2>/dev/null; then
    for pid in $(pgrep -x shardmuon_tests); do
      echo "== stacks of $pid" >>"$log"
      if command -v gdb >/dev/null; then
        timeout 30 gdb -p "$pid" -batch -ex 'thread apply all bt 12' >>"$log" 2>&1
      else
        cat /proc/"$pid"/task/*/wchan >>"$log" 2>&1
      fi
    done
    kill $job 2>/dev/null; pkill -x shardmuon_tests; sleep 1
  fi
  wait $job
  local rc=$?
  grep -E "^\[rank|Failure" "$log" | head -20
  results+=("NCCL timeout injection (2 ranks, $gpus GPU(s)): rc=$rc after ${waited}s $(grep -E 'PASSED|FAILED  \]' "$log" | sed 's/\x1b\[[0-9;]*m//g' | tr '\n' ' ')")
}
# compute-sanitizer on one GPU: memcheck, synccheck and racecheck over the CUDA suite; all four
# tools over the GPU unit tests (the symmetric passes, whose tiles go through shared memory).
# The suite runs in concurrent gtest shards, one process each: under racecheck one process
# outlasts 300 s, and 14 shards took 342 s on a 16-core H200 machine. The slowed kernels also
# shake out ordering between streams: that run found a buffer zeroed after it was written
# (docs/GPU_RUNS.md, twelfth session).
# --report-api-errors no: NCCL's initialization asks cudaFuncGetAttributes about kernels
# built for other GPUs, and memcheck would count each cudaErrorNoKernelImageForDevice.
# Left out: initcheck over the suite, which cannot see what Hopper's bf16 cuBLASLt kernels
# write (the TMA stores) and so reports later reads of fresh GEMM outputs; a bf16
# torch.matmul into torch.empty memory, then .float(), draws the same reports
# (docs/GPU_RUNS.md, eleventh session).
# Runs a command that reads GTEST_TOTAL_SHARDS and GTEST_SHARD_INDEX as `count` concurrent
# gtest shards (logs sanitize_<name>_<i>.log), prints what failed (the logs may not come back)
# and adds a result line. Only shards `first` to `last` of the `count` run (0 and count - 1:
# all of them), so that a run too long for one call can be split across calls.
sanitized_shards() {  # count, time limit, name, description, first, last, command...
  local count=$1 limit=$2 name=$3 description=$4 first=$5 last=$6 i failed=0
  shift 6
  rm -f "$out"/sanitize_"${name}"_*.log
  for ((i = first; i <= last; i++)); do
    GTEST_TOTAL_SHARDS=$count GTEST_SHARD_INDEX=$i timeout -k $kill_after "$limit" "$@" \
      >"$out/sanitize_${name}_$i.log" 2>&1 &
  done
  for ((i = first; i <= last; i++)); do wait -n || failed=$((failed + 1)); done
  grep -hE -A6 "Failure$|^\[  FAILED  \] [A-Z]|^========= (Error|Warning|Invalid|Program hit)" \
    "$out"/sanitize_${name}_*.log | cut -c1-300 | head -60
  # One line a shard: the logs of a cut-off call may not come back, this output does.
  for ((i = first; i <= last; i++)); do
    echo "  $name shard $i: $(sed 's/\x1b\[[0-9;]*m//g' "$out/sanitize_${name}_$i.log" |
      grep -E 'PASSED  \]|FAILED  \]|(ERROR|RACECHECK) SUMMARY' | tr '\n' ' ')"
  done
  results+=("compute-sanitizer $description (shards $first-$last of $count): $failed shard(s) failed; $(
    cat "$out"/sanitize_${name}_*.log | sed 's/\x1b\[[0-9;]*m//g' |
      awk '/PASSED  \]/ {n += $4} END {print n + 0}') tests passed; errors and hazards: $(
    cat "$out"/sanitize_${name}_*.log | awk '/(ERROR|RACECHECK) SUMMARY:/ {n += $4} END {print n + 0}')")
  # The race reports, and of them those inside cuBLASLt's own kernels (nvjet_*): the rest are
  # in ours. The control run (cublaslt_control) shows what cuBLASLt's kernels draw alone.
  local races
  races=$(sed 's/\x1b\[[0-9;]*m//g' "$out"/sanitize_${name}_*.log | grep -E '^========= (Error|Warning): Race reported')
  if [[ -n $races ]]; then
    results+=("  race reports: $(wc -l <<<"$races"), of them inside cuBLASLt's kernels (nvjet_*): $(
      grep -c ' at nvjet_' <<<"$races")")
  fi
}
# cuBLASLt's GEMMs alone under racecheck (tests/gpu/racecheck_cublaslt_control.cpp): with
# cuBLASLt 13.1.0.3 on an H100 they drew the reports in nvjet_* kernels that the suite's
# replicated bf16 Gram runs drew (forty-ninth session, docs/GPU_RUNS.md).
cublaslt_control() {  # compute-sanitizer
  local log="$out/sanitize_cublaslt_control.log" rc
  bounded 120 "$1" --tool racecheck $build/tests/racecheck_cublaslt_control >"$log" 2>&1
  rc=$?
  results+=("compute-sanitizer racecheck, cuBLASLt alone: rc=$rc $(sed 's/\x1b\[[0-9;]*m//g' "$log" |
    grep -E 'RACECHECK SUMMARY' | tr '\n' ' ')kernels reported: $(grep -oE 'nvjet_[A-Za-z0-9_]+' "$log" |
    sort -u | tr '\n' ' ')")
}
sanitize() {
  local cs tool log rc shards=$sanitize_shards
  local pairs=$(( shards > 1 ? shards / 2 : 1 ))  # 2-rank runs, two processes each
  cs=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  # SANITIZE_SUITE_TOOLS, SANITIZE_CALLBACK_TOOLS and SANITIZE_UNIT_TOOLS pick the tools run
  # over the one-GPU suite, the 2-rank callback runs and the GPU unit tests (empty: none), so
  # that the mode can be split across calls of a time-limited machine: racecheck over the suite
  # alone takes about 6 minutes, and memcheck over it with the callback runs' three tools did
  # not finish in 580 s (twenty-seventh session).
  cublaslt_control "$cs"
  for tool in ${SANITIZE_SUITE_TOOLS-memcheck synccheck racecheck}; do
    sanitized_shards $shards 500 "suite_$tool" "$tool, CUDA suite (1 GPU)" "$sanitize_first" "$sanitize_last" \
      "$cs" --tool $tool --report-api-errors no --error-exitcode 9 $build/tests/shardmuon_tests \
      --backend=cuda --gtest_brief=1 --gtest_filter='-*MultiBlock*'
  done
  # memcheck and synccheck over the suite on 2 ranks sharing the GPUs over --comm=callbacks
  # (the distributed paths; about a minute each on one H200 in 7 shards); racecheck over a
  # cross-section there, two sharded layouts under every algorithm, shard pattern and dtype,
  # and the non-finite checks (46 tests, 170-210 s per shard on one H200; the batched steps'
  # tests are too slow under it: one of them alone had not finished in 240 s).
  local callbacks_filter='-*MultiBlock*' scope='CUDA suite'
  for tool in ${SANITIZE_CALLBACK_TOOLS-memcheck synccheck racecheck}; do
    if [[ $tool == racecheck ]]; then
      callbacks_filter='*Layouts*67x131_dim1_P2*:*Layouts*257x64_dim0_P2*:NonFinite.*'
      scope='cross-section of the CUDA suite'
    fi
    sanitized_shards $pairs 300 "callbacks_$tool" "$tool, $scope on 2 ranks over callbacks" 0 $((pairs - 1)) \
      "${mpi[@]}" -x GTEST_TOTAL_SHARDS -x GTEST_SHARD_INDEX -np 2 "$cs" --tool $tool \
      --report-api-errors no --error-exitcode 9 $build/tests/shardmuon_tests --backend=cuda \
      --comm=callbacks --gtest_brief=1 --gtest_filter="$callbacks_filter"
  done
  # initcheck leaves out the copy of a 2 GiB row: under it that one test had not finished in
  # 150 s (twenty-ninth session), and the whole run outlasted its 240 s. racecheck leaves out
  # the tests that run cuBLASLt products as well (whole recorded calls, product tiles): it
  # reports hazards inside cuBLASLt's own kernels there (nvjet_sm90_*, 100 reports, none in
  # ours) and did not finish in 300 s; without them 17 tests passed with 0 hazards in 53 s
  # (thirty-seventh session). --target-processes application-only: the death test's child
  # (CpuBackendPointers.CheckingCreatesNoCudaContext, gtest's threadsafe style re-runs the
  # binary) hung under the tool that followed it into the child, until each tool's limit
  # (fiftieth session); the child runs no kernel. initcheck leaves out the recorded calls too:
  # their bf16 Newton-Schulz reads cuBLASLt's fresh bf16 products, which initcheck does not see
  # written (the suite's reports, eleventh session), 100 reports in mirror_lower_kernel<bf16> and
  # not finished in 240 s (fifty-second session).
  local unit_filter
  for tool in ${SANITIZE_UNIT_TOOLS-memcheck racecheck synccheck initcheck}; do
    log="$out/sanitize_unit_$tool.log"
    unit_filter='*'
    [[ $tool == initcheck ]] && unit_filter='-CudaCopies.OneRowOfMoreThanTwoGibibytes:RecordedCalls.*'
    [[ $tool == racecheck ]] &&
      unit_filter='-CudaCopies.OneRowOfMoreThanTwoGibibytes:RecordedCalls.*:*ProductTiles*'
    bounded 240 "$cs" --tool $tool --target-processes application-only --error-exitcode 9 \
      $build/tests/shardmuon_gpu_unit_tests --gtest_brief=1 \
      --gtest_filter="$unit_filter" >"$log" 2>&1
    rc=$?
    results+=("compute-sanitizer $tool, GPU unit tests: rc=$rc $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED  \]' "$log" | sed 's/\x1b\[[0-9;]*m//g' | tr '\n' ' ')")
  done
}
if [[ "$what" == "callbacks" ]]; then
  callback_tests
  printf '%s\n' "${results[@]}"
  exit 0
fi
if [[ "$what" == "sanitize" ]]; then
  sanitize
  printf '%s\n' "${results[@]}"
  exit 0
fi
if [[ "$what" == "speed" ]]; then
  # The CUDA tests on 1 and 2 GPUs, the fault injection, then the Newton-Schulz benchmark
  # (bench/bench_newton_schulz.py; its table goes to $out).
  gpu_unit
  cuda_tests tests '-Reliability.ARankThatNeverCalls*'
  narrow_blocks
  timeout_injection
  callback_tests
  export SHARDMUON_LIBRARY="$root/$build/libshardmuon.so"
  timeout "${BENCH_TIMEOUT:-300}" torchrun --nproc_per_node="$gpus" bench/bench_newton_schulz.py --out "$out" \
    ${BENCH_ARGS:-} >"$out/bench.log" 2>&1
  results+=("benchmark: rc=$? $(grep -c '^| [0-9]' "$out/bench.log") rows; $(grep accuracy "$out/bench.log")")
  tail -5 "$out/bench.log"
  # Optional tuning sweeps on a few shapes: BENCH_SWEEP="SHARDMUON_COMM_SMS=16 ..." runs the
  # benchmark once per setting (an environment assignment the library reads).
  for setting in ${BENCH_SWEEP:-}; do
    bounded 120 env "$setting" torchrun --nproc_per_node="$gpus" bench/bench_newton_schulz.py \
      --out "$out" --tag "_${setting//=/_}" --shapes "${SWEEP_SHAPES:-4096x14336,8192x8192,8192x28672}" \
      --dtypes bf16 --schedules quintic:5 --repeats 7 >"$out/sweep.log" 2>&1
  done
  printf '%s\n' "${results[@]}"
  exit 0
fi
if [[ "$what" == "targets" ]]; then
  # Issue #5's two-GPU targets, in one call of a few minutes: the CUDA suite on 1 and 2 GPUs
  # over NCCL (the fault injection and the multi-block case apart), the PyTorch checks on
  # every GPU, then the benchmark's rows the targets name (8192 x 28672 either way round,
  # bf16, quintic 5) against the Gram all-reduce and all-gather baselines of the same run.
  cuda_tests tests '-*MultiBlock*:Reliability.ARankThatNeverCalls*'
  export SHARDMUON_LIBRARY="$root/$build/libshardmuon.so"
  bounded 200 torchrun --nproc_per_node="$gpus" python/tests/gpu/check_torch_gpu.py >"$out/torch_gpu.log" 2>&1
  results+=("torch checks on $gpus GPU(s): rc=$? $(grep -h 'torch GPU checks' "$out/torch_gpu.log")")
  grep -E "^FAIL" "$out/torch_gpu.log" | head -10
  bounded 300 torchrun --nproc_per_node="$gpus" bench/bench_newton_schulz.py --out "$out" \
    --shapes 8192x28672,28672x8192 --dtypes bf16 --schedules quintic:5 >"$out/bench.log" 2>&1
  results+=("benchmark: rc=$? $(grep -c '^| [0-9]' "$out/bench.log") rows; $(grep accuracy "$out/bench.log")")
  grep -E "^\|" "$out/bench.log"
  printf '%s\n' "${results[@]}"
  mv "$out/configure.log" "$out/build.log" "$build/" 2>/dev/null
  exit 0
fi
if [[ "$what" == "step" ]]; then
  # The whole optimizer step: the step's CUDA tests (owner per matrix, stacked matrices, Gram
  # Newton-Schulz) on 1 and 2 GPUs, then bench/bench_step.py against the PyTorch loops,
  # bench/bench_experts.py, bench/bench_small_model.py and bench/bench_nonfinite_check.py
  # (with and without --loss-scaler).
  cuda_tests step_tests 'MuonStep*:CppMuon*:NonFinite*:*gramns*:*MultiBlock*'
  export SHARDMUON_LIBRARY="$root/$build/libshardmuon.so"
  timeout "${BENCH_TIMEOUT:-300}" torchrun --nproc_per_node="$gpus" bench/bench_step.py --out "$out" \
    ${BENCH_ARGS:-} >"$out/bench_step.log" 2>&1
  results+=("step benchmark: rc=$?")
  grep -E "^\||GEMM|whole-step" "$out/bench_step.log"
  # Mixture-of-experts layers on one GPU: the experts as strided batches.
  bounded 200 python3 bench/bench_experts.py --out "$out" >"$out/bench_experts.log" 2>&1
  results+=("experts benchmark (1 GPU): rc=$?")
  grep -E "^\||GEMM" "$out/bench_experts.log"
  # A small model on one GPU: GPT-2's 48 matrices, batched by shape, against torch.optim.Muon.
  bounded 200 python3 bench/bench_small_model.py --out "$out" >"$out/bench_small_model.log" 2>&1
  results+=("small-model benchmark (1 GPU): rc=$?")
  grep -E "^\||GEMM" "$out/bench_small_model.log"
  # The same with QKV as three stacked d x d blocks, which share batches with other layers'.
  bounded 200 python3 bench/bench_small_model.py --split-qkv --out "$out" >"$out/bench_small_model_split.log" 2>&1
  results+=("small-model benchmark, QKV split (1 GPU): rc=$?")
  grep -E "^\||GEMM" "$out/bench_small_model_split.log"
  # What MuonWithAdamW's non-finite check costs a training loop (skip against proceed).
  bounded 150 python3 bench/bench_nonfinite_check.py >"$out/bench_nonfinite_check.log" 2>&1
  results+=("non-finite check benchmark (1 GPU): rc=$?")
  tail -4 "$out/bench_nonfinite_check.log"
  # The same under float16 and a GradScaler: its protocol against its ordinary path.
  bounded 150 python3 bench/bench_nonfinite_check.py --loss-scaler >"$out/bench_loss_scaler.log" 2>&1
  results+=("loss scaler benchmark (1 GPU): rc=$?")
  tail -5 "$out/bench_loss_scaler.log"
  printf '%s\n' "${results[@]}"
  exit 0
fi
if [[ "$what" == "timeout" ]]; then
  timeout_injection
  printf '%s\n' "${results[@]}"
  exit 0
fi
if [[ "$what" == "final" ]]; then
  # The CUDA tests on 1 and 2 GPUs; compute-sanitizer memcheck, racecheck and synccheck over a
  # cross-section; the PyTorch front end's checks.
  gpu_unit
  cuda_tests tests '-Reliability.ARankThatNeverCalls*'
  narrow_blocks
  timeout_injection
  callback_tests
  # racecheck over the filter's 41 tests took 243 s on one H100 (fifty-sixth session: 194 s of
  # it in the batched steps' 21), where memcheck and synccheck finish within 150 s; its old
  # 150 s limit had been set for the 20 tests of the first sessions.
  filter='*Layouts*67x131*dim1*P1*:*Schedules*quintic5*P1:NonFinite.*:MuonStepB*:Checkpoint.LoadsOn*'
  for tool in memcheck racecheck synccheck; do
    log="$out/$tool.log"
    limit=150
    [[ $tool == racecheck ]] && limit=330
    bounded $limit "${mpi[@]}" -np 1 compute-sanitizer --tool $tool --report-api-errors no --error-exitcode 3 \
      $build/tests/shardmuon_tests --backend=cuda --gtest_brief=1 --gtest_filter="$filter" >"$log" 2>&1
    rc=$?
    results+=("$tool (1 GPU): rc=$rc $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -1) $(grep -E 'PASSED|FAILED  \]' "$log" | sed 's/\x1b\[[0-9;]*m//g' | tr '\n' ' ')")
  done
  torch_gpu_checks
  front_end_pytest
  printf '%s\n' "${results[@]}"
  mv "$out/configure.log" "$out/build.log" "$build/" 2>/dev/null
  exit 0
fi
if [[ "$what" == "torch" ]]; then
  # The PyTorch front end with this machine's PyTorch (2.x): the main job at TP 1 and 2, then
  # torchrun on 2 GPUs against the whole-matrix reference, 1 GPU against torch.optim.Muon, and
  # the front end's DTensor tests last. On one H100 (fifty-fourth session) the parts outlast one
  # call: the pytest run took 317 s and TP 2 on the shared GPU 176 s, and a 500 s limit cut the
  # old order off in TP 2. So the main job goes first and each part is bounded: a cut-off call
  # still reports what finished.
  export SHARDMUON_LIBRARY="$root/$build/libshardmuon.so"
  # At most 8 files come back: the build's logs stay in the build folder, and the loss plots
  # (drawn from the CSVs that do come back) are dropped.
  mv "$out/configure.log" "$out/build.log" "$build/" 2>/dev/null
  # The main job reads the fortune corpus; the lent machines have no fortune package, so a
  # copy travels in .deps/fortunes (carry it: `cp -r /usr/share/games/fortunes .deps/`).
  corpus=/usr/share/games/fortunes
  [[ -d "$root/.deps/fortunes" ]] && corpus="$root/.deps/fortunes"
  if [[ -d $corpus ]]; then
    bounded 150 python3 examples/train_lm.py --tp 1 --data "$corpus" --out "$out" --log-every 50 \
      >"$out/train_tp1.log" 2>&1
    results+=("main job TP 1: rc=$? $(grep -h '^final' "$out/train_tp1.log")")
    # TP 2: one GPU a rank, or both ranks on the one GPU over NCCL (rank_host_id.sh).
    bounded 240 torchrun --nproc_per_node=2 "${torchrun_shared[@]}" examples/train_lm.py --tp 2 \
      --data "$corpus" --out "$out" --log-every 50 >"$out/train_tp2.log" 2>&1
    results+=("main job TP 2: rc=$? $(grep -h '^final' "$out/train_tp2.log")")
    rm -f "$out"/loss_tp*.png
  else
    results+=("main job not run: no corpus at $corpus (carry a copy in .deps/fortunes)")
  fi
  torch_gpu_checks
  front_end_pytest
  printf '%s\n' "${results[@]}"
  exit 0
fi
for ranks in 1 2; do
  log="$out/gpu_tests_np$ranks.log"
  wrap=()
  [[ $ranks -gt $gpus ]] && wrap=("${shared[@]}")
  OPENBLAS_NUM_THREADS=$(( $(nproc) / ranks )) bounded 400 "${mpi[@]}" -np $ranks "${wrap[@]}" \
    $build/tests/shardmuon_tests --backend=cuda --gtest_brief=1 >"$log" 2>&1
  rc=$?
  grep -E "^\[rank|Failure|FAILED" "$log" | head -40
  results+=("cuda tests on $ranks rank(s), $gpus GPU(s), NCCL: rc=$rc $(grep -E 'PASSED|FAILED  \]|SKIPPED \]' "$log" | sed 's/\x1b\[[0-9;]*m//g' | tr '\n' ' ')")
  results+=("  largest error/tolerance: $(grep -o 'ratio=[0-9.]*' "$log" | sort -t= -k2 -g | tail -1) over $(grep -c 'ratio=' "$log") checked cases")
done
gpu_unit
callback_tests
# compute-sanitizer memcheck over a cross-section of the cases, on one GPU.
if command -v compute-sanitizer >/dev/null 2>&1; then
  log="$out/memcheck.log"
  bounded 300 "${mpi[@]}" -np 1 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 3 \
    $build/tests/shardmuon_tests --backend=cuda --gtest_brief=1 \
    --gtest_filter='*Layouts*67x131*:*Layouts*1x37*:*Layouts*20x3*:*Schedules*_P1:BadInput.*:*Invariants.*:*MuonStepModes*P1*:MuonStepB*:Checkpoint.*:CppMuon.*' \
    >"$log" 2>&1
  rc=$?
  results+=("memcheck (1 GPU, subset): rc=$rc $(grep -E 'ERROR SUMMARY' "$log" | tail -1) $(grep -E 'PASSED|FAILED  \]' "$log" | sed 's/\x1b\[[0-9;]*m//g' | tr '\n' ' ')")
fi
front_end_pytest
if [[ "$what" == "tests" ]]; then
  printf '%s\n' "${results[@]}"
  exit 0
fi

# The fused elementwise passes against the copy bandwidth (one GPU).
$build/bench/bench_elementwise 2>&1 | tee "$out/bench_elementwise.log"

# The example: error against the float64 reference at a checkable size, then timings.
example=$build/examples/orthogonalize_sharded
for ranks in 1 $([[ $gpus -ge 2 ]] && echo 2); do
  for dtype in f32 bf16; do
    "${mpi[@]}" -np $ranks $example --rows 1024 --cols 3000 --dtype $dtype --dim 1 2>&1 | tee -a "$out/example.log" | grep -E "error|time"
  done
done
for shape in "8192 28672" "4096 14336" "14336 4096" "8192 8192"; do
  set -- $shape
  for ranks in 1 $([[ $gpus -ge 2 ]] && echo 2); do
    for dim in 0 1; do
      [[ $ranks -eq 1 && $dim -eq 0 ]] && continue
      line=$("${mpi[@]}" -np $ranks $example --rows $1 --cols $2 --dtype bf16 --dim $dim --check 0 --repeats 10 2>&1 | tee -a "$out/example.log")
      results+=("example ${1}x${2} bf16 dim$dim on $ranks GPU(s): $(echo "$line" | grep -E "time|algorithm" | sed 's/^ *//' | tr '\n' ' ')")
    done
  done
done

echo
echo "== summary"
for line in "${results[@]}"; do echo "$line"; done
