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

# A formatted tree (the checked-in .clang-format), where clang-format is installed.
if command -v clang-format >/dev/null 2>&1; then
  if (cd "$root" && git ls-files '*.h' '*.hpp' '*.cpp' '*.cu' '*.cuh' |
      xargs clang-format --dry-run --Werror 2>"$root/build/format.log"); then
    summary+=("formatting: clean")
  else
    head -20 "$root/build/format.log"
    summary+=("formatting: FAILED (run clang-format -i on the files above)")
    status=1
  fi
fi

echo
echo "shardmuon test summary"
for line in "${summary[@]}"; do echo "  $line"; done
exit $status
