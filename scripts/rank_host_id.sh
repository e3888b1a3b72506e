#!/usr/bin/env bash
# Runs a command as one of several ranks that share a GPU over NCCL: NCCL refuses two ranks on
# one GPU of one host, but ranks with different NCCL_HOSTIDs are on different hosts to it and
# connect over its network transport (here sockets on the loopback interface). Every NCCL
# path of the library then runs on a machine with one GPU; its timings mean nothing (the
# ranks take turns on the GPU, their data goes through host sockets).
#   mpirun -np 2 scripts/rank_host_id.sh build-gpu/tests/shardmuon_tests --backend=cuda
#   torchrun --nproc_per_node=2 --no-python scripts/rank_host_id.sh python3 script.py
rank="${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-${RANK:-}}}"
if [[ -z "$rank" ]]; then
  echo "rank_host_id.sh: no rank in OMPI_COMM_WORLD_RANK, PMI_RANK or RANK" >&2
  exit 2
fi
export NCCL_HOSTID="shardmuon-rank-$rank"
export NCCL_NET="${NCCL_NET:-Socket}" NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-lo}"
export NCCL_IB_DISABLE="${NCCL_IB_DISABLE:-1}"
exec "$@"
