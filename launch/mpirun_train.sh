#!/usr/bin/env bash
# Train with Open MPI on this machine: launch/mpirun_train.sh NPROCS [dsnd train args...]
#   launch/mpirun_train.sh 4 --set ds.zero_optimization.stage=3
# Rendezvous on loopback (never an address from `hostname -I`); one thread per rank.
# Across hosts use `dsnd launch --hostfile FILE --launcher openmpi`.
set -euo pipefail
nprocs=${1:?usage: $0 NPROCS [dsnd train args...]}; shift
root_flag=(); [ "$(id -u)" = 0 ] && root_flag=(--allow-run-as-root)
exec mpirun -np "$nprocs" --oversubscribe "${root_flag[@]}" \
  -x MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}" -x MASTER_PORT="${MASTER_PORT:-29500}" \
  -x OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" \
  python -m dsnd train "$@"
