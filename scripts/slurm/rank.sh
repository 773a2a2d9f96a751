#!/usr/bin/env bash
# One srun task of scripts/slurm/pretrain_gpt.sbatch: `rank.sh srun|torchrun COMMAND...`.
#
# srun form: the task is one rank; RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE come from
# SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID and SLURM_NTASKS_PER_NODE (MASTER_ADDR/MASTER_PORT are
# exported by the batch script). torchrun form: the task is one node's torchrun, which sets them.
#
# SLURM signals every process of the step, so this shell gets the ranks' SIGTERM too: task 0 (on
# the batch script's node) writes it to $STOP_MARK, from which the batch script knows the ranks
# stopped on a signal and requeues the job. The command runs in the foreground, so its exit code
# is the task's.
set -uo pipefail
if [ "$1" = srun ]; then
    export RANK="$SLURM_PROCID" WORLD_SIZE="$SLURM_NTASKS" LOCAL_RANK="$SLURM_LOCALID"
    if [ -n "${SLURM_NTASKS_PER_NODE:-}" ]; then
        export LOCAL_WORLD_SIZE="$SLURM_NTASKS_PER_NODE"
    fi
fi
shift
stopped=""
trap 'stopped=TERM' TERM
"$@"
rc=$?
if [ -n "$stopped" ] && [ "$SLURM_PROCID" = 0 ] && [ -n "${STOP_MARK:-}" ]; then
    echo "$stopped" >"$STOP_MARK"
fi
exit "$rc"
