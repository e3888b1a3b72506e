#!/usr/bin/env bash
# The main job: installs what is missing, builds, and orthogonalizes a random matrix sharded
# over 2 ranks (GPUs when there are, else CPU ranks), printing the time and the error
# against a float64 reference. Arguments go to the example (see its --help in the source).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
"$root/scripts/install_deps.sh"
"$root/scripts/build.sh" >/dev/null
export OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-1}"
mpi_flags=(--oversubscribe)
if [[ $(id -u) -eq 0 ]]; then mpi_flags+=(--allow-run-as-root); fi
exec mpirun "${mpi_flags[@]}" -np "${SHARDMUON_RANKS:-2}" "$root/build/examples/orthogonalize_sharded" "$@"
