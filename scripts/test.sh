#!/usr/bin/env bash
# Installs what is missing, builds, and runs every test that this machine can run: the
# distributed tests on 1-4 CPU ranks over MPI, in the full build and in a build without
# CUDA (which checks the "not built" errors). GPU tests: scripts/gpu_check.sh.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
"$root/scripts/install_deps.sh"

export OPENBLAS_NUM_THREADS=1
status=0
summary=()
run_suite() {  # name, build dir, extra cmake args...
  local name="$1" dir="$2"
  shift 2
  SHARDMUON_BUILD_DIR="$dir" "$root/scripts/build.sh" "$@"
  echo "== $name"
  local log="$dir/ctest.log"
  if (cd "$dir" && ctest --output-on-failure 2>&1 | tee "$log"); then :; else status=1; fi
  # ctest counts launches (one per world size); the gtest cases inside them are summed here.
  local cases
  cases=$(sed 's/\x1b\[[0-9;]*m//g' "$dir/Testing/Temporary/LastTest.log" | awk '
    /^\[  PASSED  \] [0-9]+ test/ {passed += $4}
    /^\[  SKIPPED \] [0-9]+ test/ {skipped += $4}
    /^\[  FAILED  \] [0-9]+ test/ {failed += $4}
    END {printf "%d cases passed, %d failed, %d skipped (they need more ranks or a GPU)", passed, failed, skipped}')
  summary+=("$name: $(grep -E 'tests passed|tests failed' "$log" | tail -1); $cases")
}

run_suite "full build" "$root/build"
run_suite "build without CUDA" "$root/build-nocuda" -DSHARDMUON_WITH_CUDA=OFF
run_suite "build without CUDA and MPI" "$root/build-minimal" -DSHARDMUON_WITH_CUDA=OFF \
  -DSHARDMUON_WITH_MPI=OFF

# The PyTorch front end (Debian's CPU PyTorch), on the full build's library.
echo "== python tests"
if SHARDMUON_LIBRARY="$root/build/libshardmuon.so" /usr/bin/python3 -m pytest -q -p no:cacheprovider \
    "$root/python/tests" 2>&1 | tee "$root/build/pytest.log"; then :; else status=1; fi
summary+=("python tests: $(grep -E '[0-9]+ (passed|failed)' "$root/build/pytest.log" | tail -1)")

# AddressSanitizer + UndefinedBehaviorSanitizer over the CPU suites. LeakSanitizer runs on the
# single-process binary (with the 10,000-step soak test); under MPI it is off, since Open MPI's
# unloaded components leave reports no suppression can name (docs/RELIABILITY.md).
{
  echo "== sanitizers"
  asan="$root/build-asan"
  SHARDMUON_BUILD_DIR="$asan" "$root/scripts/build.sh" -DSHARDMUON_WITH_CUDA=OFF \
    -DSHARDMUON_SANITIZE=address,undefined -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
  export UBSAN_OPTIONS=print_stacktrace=1
  sanitizer_status=0
  ASAN_OPTIONS=detect_leaks=1 "$asan/tests/shardmuon_single_tests" --gtest_brief=1 \
    >"$asan/single.log" 2>&1 || sanitizer_status=1
  as_root=()
  if [[ $(id -u) -eq 0 ]]; then as_root=(--allow-run-as-root); fi
  for run in "2 native" "4 native" "3 callbacks"; do
    read -r ranks comm <<<"$run"
    ASAN_OPTIONS=detect_leaks=0 mpirun --oversubscribe "${as_root[@]}" \
      -np $ranks -x ASAN_OPTIONS -x UBSAN_OPTIONS -x OPENBLAS_NUM_THREADS \
      "$asan/tests/shardmuon_tests" --comm=$comm --gtest_brief=1 >"$asan/ranks${ranks}_$comm.log" 2>&1 ||
      sanitizer_status=1
  done
  if grep -hE "ERROR: (Address|Leak)Sanitizer|runtime error" "$asan"/*.log; then sanitizer_status=1; fi
  if ((sanitizer_status)); then status=1; fi
  summary+=("sanitizers (ASan+UBSan, LSan single-process): $( ((sanitizer_status)) && echo FAILED || echo clean); $(sed 's/\x1b\[[0-9;]*m//g' "$asan"/*.log | grep -E '^\[  PASSED  \]' | awk '{n += $4} END {print n}') cases passed")
}

# libFuzzer (clang): the C API's argument validation and the checkpoint reader, each for
# $SHARDMUON_FUZZ_SECONDS (default 60) from the corpus in tests/fuzz/corpus.
if command -v clang++ >/dev/null 2>&1; then
  echo "== fuzzers"
  fuzz="$root/build-fuzz"
  mkdir -p "$fuzz"
  CC=clang CXX=clang++ cmake -S "$root" -B "$fuzz" -G Ninja -DSHARDMUON_WITH_CUDA=OFF \
    -DSHARDMUON_WITH_MPI=OFF -DSHARDMUON_BUILD_FUZZERS=ON -DSHARDMUON_BUILD_EXAMPLES=OFF \
    -DSHARDMUON_SANITIZE=address,undefined,fuzzer-no-link -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DSHARDMUON_WARNINGS_AS_ERRORS=ON >"$fuzz/configure.log" 2>&1 &&
    cmake --build "$fuzz" >"$fuzz/build.log" 2>&1 || {
    # A build that fails (clang is stricter than GCC here) is reported, not a silent exit.
    grep -E "error" -A3 "$fuzz/build.log" 2>/dev/null | head -20 || true
    summary+=("fuzzers: build FAILED (see $fuzz/build.log)")
    status=1
  }
  for target in api checkpoint; do
    [[ -x "$fuzz/tests/fuzz/fuzz_$target" ]] || continue
    work="$fuzz/corpus-$target"
    mkdir -p "$work"
    if (cd "$fuzz" && "./tests/fuzz/fuzz_$target" -max_total_time="${SHARDMUON_FUZZ_SECONDS:-60}" \
          "$work" "$root/tests/fuzz/corpus/$target" >"$fuzz/$target.log" 2>&1); then
      summary+=("fuzz_$target: $(grep -oE 'Done [0-9]+ runs in [0-9]+ second' "$fuzz/$target.log"), no crash")
    else
      tail -30 "$fuzz/$target.log"
      summary+=("fuzz_$target: FAILED (see $fuzz/$target.log and the crash-* input there)")
      status=1
    fi
  done
fi

# A formatted tree (the checked-in .clang-format; install_deps.sh installs clang-format).
if ! command -v clang-format >/dev/null 2>&1; then
  summary+=("formatting: FAILED (clang-format is not installed; scripts/install_deps.sh installs it)")
  status=1
elif (cd "$root" && git ls-files '*.h' '*.hpp' '*.cpp' '*.cu' '*.cuh' |
      xargs clang-format --dry-run --Werror 2>"$root/build/format.log"); then
  summary+=("formatting: clean")
else
  head -20 "$root/build/format.log"
  summary+=("formatting: FAILED (run clang-format -i on the files above)")
  status=1
fi

# The Python files: pyflakes (unused names, undefined ones) and pycodestyle's layout rules at
# 120 columns.
if (cd "$root" && git ls-files '*.py' | xargs /usr/bin/python3 -m pyflakes &&
    git ls-files '*.py' | xargs /usr/bin/python3 -m pycodestyle --max-line-length=120) \
    >"$root/build/python_lint.log" 2>&1; then
  summary+=("python lint (pyflakes, pycodestyle): clean")
else
  head -20 "$root/build/python_lint.log"
  summary+=("python lint (pyflakes, pycodestyle): FAILED (see build/python_lint.log)")
  status=1
fi

echo
echo "shardmuon test summary"
for line in "${summary[@]}"; do echo "  $line"; done
exit $status
