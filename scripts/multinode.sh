#!/bin/bash
# muonrun on several nodes without SLURM: run this once on EVERY node, with the same settings except
# NODE_RANK. Node 0 hosts the rendezvous at HEAD:PORT; the others connect to it.
#
#   node 0:  NODE_RANK=0 HEAD=10.0.0.1 NNODES=2 scripts/multinode.sh configs/my.yaml train.max_steps=1000
#   node 1:  NODE_RANK=1 HEAD=10.0.0.1 NNODES=2 scripts/multinode.sh configs/my.yaml train.max_steps=1000
#
# output_dir must be on a filesystem every node sees (checkpoints, metrics.jsonl). Rerunning the same
# commands resumes from the latest checkpoint. Lines marked ADAPT are the ones to edit (or set the
# variables in the environment).
set -euo pipefail

: "${NODE_RANK:?set NODE_RANK: 0 on the head node, 1 .. NNODES-1 on the others}"
: "${HEAD:?set HEAD: an address of node 0 that every node can reach (IP or host name)}"
NNODES=${NNODES:-2}                   # ADAPT: number of nodes
PORT=${PORT:-29500}                   # ADAPT: a free TCP port on the head node, open between the nodes
RDZV_ID=${RDZV_ID:-muonrun}           # ADAPT: a name shared by the nodes of ONE job (change it per job)
NPROC_PER_NODE=${NPROC_PER_NODE:-}    # ADAPT: workers per node; empty = every GPU of the node
MAX_RESTARTS=${MAX_RESTARTS:-}        # ADAPT: restart the workers this many times after a failure (empty: the config's)
LOCAL_ADDR=${LOCAL_ADDR:-}            # ADAPT: this node's address as the others reach it (empty: its host name)
MUONRUN=${MUONRUN:-muonrun}           # ADAPT if muonrun is not on PATH

CONFIG=${1:?usage: NODE_RANK=.. HEAD=.. scripts/multinode.sh CONFIG [key=value ...]}
shift

# ADAPT: the network (docs/clusters.md explains each).
# export NCCL_SOCKET_IFNAME=eth0      # interface for NCCL's bootstrap/socket traffic
# export GLOO_SOCKET_IFNAME=eth0      # the same for gloo
# export NCCL_IB_HCA=mlx5_0           # InfiniBand adapters
# export NCCL_DEBUG=WARN

exec "$MUONRUN" pretrain "$CONFIG" "$@" ${LOCAL_ADDR:+"launch.local_addr=$LOCAL_ADDR"} \
    --nnodes "$NNODES" --node-rank "$NODE_RANK" --rdzv-endpoint "$HEAD:$PORT" --rdzv-id "$RDZV_ID" \
    ${MAX_RESTARTS:+--max-restarts "$MAX_RESTARTS"} ${NPROC_PER_NODE:+--nproc-per-node "$NPROC_PER_NODE"}
