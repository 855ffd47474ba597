#!/usr/bin/env bash
# dsnd on a Slurm cluster: sbatch launch/sbatch_train.sh [dsnd train arguments...]
#   sbatch --nodes=4 --time=48:00:00 launch/sbatch_train.sh --config run.yaml \
#       --set checkpoint.dir=/shared/ckpt/run1
# Options given to sbatch override the #SBATCH lines below.
#
# - srun starts one `dsnd train` task per slot; each reads its rank, local rank and world size
#   from Slurm's variables, the rendezvous host (the first node) from SLURM_STEP_NODELIST and the
#   port from the job id (MASTER_ADDR / MASTER_PORT in the environment win).
# - checkpoint.dir must be on a filesystem every node sees.
# - Time limit: Slurm sends this script SIGUSR1 5 minutes before it (--signal); the script sends
#   SIGTERM to every task, they finish one same step, save it and exit 0, and the job requeues
#   itself: the next attempt (same job id) resumes that checkpoint.
# - A failed step (a rank crashed, a node died) requeues the job, up to MAX_RESTARTS times
#   (default 3; counted in dsnd-JOBID.failures in the submit directory, so time-limit requeues
#   do not use them up); every attempt resumes the job's own newest committed checkpoint. A bad
#   input (exit 2) or a diverged run (exit 3) is not requeued.
# - `scancel --signal=TERM JOBID` stops the job the same way without requeueing it; a new
#   sbatch continues from its checkpoint (checkpoint.resume: auto, the default).
# Environment: DSND_PYTHON (default: python), MAX_RESTARTS (default: 3).
#
#SBATCH --job-name=dsnd
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
# one task per GPU: add --gpus-per-node=8 (or your site's --gres=gpu:8) where Slurm manages GPUs
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=dsnd-%j.out
set -uo pipefail

python=${DSND_PYTHON:-python}
max_restarts=${MAX_RESTARTS:-3}
attempt=${SLURM_RESTART_COUNT:-0}
failures_file="${SLURM_SUBMIT_DIR:-.}/dsnd-${SLURM_JOB_ID}.failures"
failures=$(cat "$failures_file" 2>/dev/null || echo 0)
stopping=0

stop_before_the_limit() {
  stopping=1
  echo "dsnd: job ${SLURM_JOB_ID}: time limit near; stopping every task after its current step"
  scancel --signal=TERM "${SLURM_JOB_ID}"  # the job's steps only, not this script
}
trap stop_before_the_limit USR1

echo "dsnd: job ${SLURM_JOB_ID} attempt $((attempt + 1)) on ${SLURM_JOB_NODELIST}"
srun --kill-on-bad-exit=1 --distribution=block "$python" -u -m dsnd train "$@" &
step=$!
# a trapped signal ends `wait` early: wait again until srun itself has exited
while true; do
  wait "$step"
  rc=$?
  kill -0 "$step" 2>/dev/null || break
done

if [ "$stopping" = 1 ] && [ "$rc" = 0 ]; then
  echo "dsnd: job ${SLURM_JOB_ID}: saved before the time limit; requeued to continue"
  scontrol requeue "${SLURM_JOB_ID}"
elif [ "$rc" != 0 ] && [ "$rc" != 2 ] && [ "$rc" != 3 ] && [ "$failures" -lt "$max_restarts" ]; then
  echo "$((failures + 1))" >"$failures_file"
  echo "dsnd: job ${SLURM_JOB_ID}: step failed with code $rc; requeued" \
    "(restart $((failures + 1)) of $max_restarts)"
  scontrol requeue "${SLURM_JOB_ID}"
fi
exit "$rc"
