#!/usr/bin/env bash
# NoLoCo across two machines with torchrun: 2 machines x 2 workers = 4 replicas.
#
#   on machine A:  examples/two_machines.sh 0 A_ADDRESS [more noloco train flags]
#   on machine B:  examples/two_machines.sh 1 A_ADDRESS [the same flags]
#
# A_ADDRESS is machine A's address as machine B reaches it (A hosts the rendezvous store on
# port 29500). Set GLOO_SOCKET_IFNAME to the interface that address belongs to when a machine
# has several, and LOCAL_ADDR to this machine's own address where its hostname does not
# resolve to it (torchrun advertises that address to the other machine's workers). Rank 0 (on A) writes the run directory; every worker writes its checkpoints
# under --out on its own machine. tests/test_examples.py runs this script in two network
# namespaces joined by a bridge.
set -euo pipefail
NODE_RANK=${1:?node rank: 0 on the first machine, 1 on the second}
MASTER=${2:?the address of the first machine}
shift 2
# The first machine hosts the rendezvous store: say so rather than let torchrun guess it from
# the hostname (which fails where the hostname resolves to 127.0.0.1).
IS_HOST=$([ "$NODE_RANK" = 0 ] && echo 1 || echo 0)
exec torchrun --nnodes 2 --nproc-per-node 2 --node-rank "$NODE_RANK" \
    --rdzv-backend c10d --rdzv-endpoint "$MASTER:29500" --rdzv-id noloco-two-machines \
    --rdzv-conf "is_host=$IS_HOST" ${LOCAL_ADDR:+--local-addr "$LOCAL_ADDR"} \
    -m noloco train --method noloco --replicas 4 --sync-every 50 --out runs/two-machines "$@"
