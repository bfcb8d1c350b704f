#!/usr/bin/env bash
# Multi-node GRPO under SLURM: one process per node, each calling jax.distributed.initialize()
# (which reads SLURM's variables for the coordinator, process count and process id; with one task per
# node, fastrl_jax.rl.distributed keeps every GPU of the node visible to it).
#
#   sbatch --nodes=4 scripts/launch_slurm.sh configs/qwen2.5_32b_multinode.yaml [key=value ...]
#
# --exclusive alone grants no GPUs where SLURM constrains devices: the GPUs are asked for here
# (override with sbatch --gpus-per-node=N).
#SBATCH --job-name=fastrl-grpo
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --output=%x-%j.out
# SIGUSR1 to every task 10 minutes before the time limit: the run ends its step, checkpoints it and stops
# (as on SIGTERM, a preemption); resubmit with --resume to continue.
#SBATCH --signal=USR1@600
set -euo pipefail

CONFIG=${1:?usage: launch_slurm.sh CONFIG [key=value ...] [--resume]}
shift
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
if [ -f .venv/bin/activate ]; then . .venv/bin/activate; fi

# One task per node: every GPU of the node belongs to that process.
srun --ntasks-per-node=1 --kill-on-bad-exit=1 \
  python -m fastrl_jax.cli train --config "$CONFIG" --distributed "$@"
