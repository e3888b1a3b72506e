#!/usr/bin/env bash
# The main job: installs what is missing, builds the library, and trains a small
# character-level transformer on Debian's fortune cookies with shardmuon's Muon (+ AdamW for
# embeddings, norms and the head) against AdamW alone, printing progress and writing the loss
# curves to out/train_lm/ (CSV and PNG). On CPU by default (a few minutes); arguments go to
# examples/train_lm.py, e.g. --tp 2 for tensor parallelism over two processes (two GPUs when
# the machine has them), --steps N.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
"$root/scripts/install_deps.sh"
"$root/scripts/build.sh" >/dev/null
python="${PYTHON:-/usr/bin/python3}"
export SHARDMUON_LIBRARY="$root/build/libshardmuon.so"
exec "$python" "$root/examples/train_lm.py" --out "$root/out/train_lm" "$@"
