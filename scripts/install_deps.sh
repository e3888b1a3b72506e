#!/usr/bin/env bash
# Installs the Debian packages shardmuon builds and tests with, if any are missing.
# Idempotent: does nothing (and needs no network) when everything is there.
set -euo pipefail

packages=(cmake ninja-build g++ libopenmpi-dev openmpi-bin libopenblas-dev libgtest-dev
          nlohmann-json3-dev zlib1g-dev
          python3 python3-torch python3-numpy python3-pytest python3-matplotlib
          python3-pyflakes python3-pycodestyle fortunes
          clang libclang-rt-14-dev clang-format)
missing=()
for package in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" ||
    missing+=("$package")
done
if ((${#missing[@]} == 0)); then
  exit 0
fi
echo "shardmuon: installing ${missing[*]}"
sudo_cmd=()
if [[ $(id -u) -ne 0 ]]; then sudo_cmd=(sudo); fi
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -qq
"${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
