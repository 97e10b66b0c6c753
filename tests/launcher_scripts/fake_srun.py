#!/usr/bin/env python3
"""A stand-in for Slurm's srun on a machine without Slurm: drops srun's options and runs the command here as task 0
of a one-task step (what hydra's slurm launcher needs to find its proxy id). Leaves a line in $FAKE_SRUN_LOG so the
test can see srun was really used."""
import os
import sys

args = sys.argv[1:]
with_value = {"--nodelist", "-w", "-N", "--nodes", "-n", "--ntasks", "--input"}
while args and args[0].startswith("-"):
    args = args[2:] if args[0] in with_value else args[1:]
with open(os.environ["FAKE_SRUN_LOG"], "a") as log:
    log.write(" ".join(sys.argv[1:]) + "\n")
os.environ.update(SLURM_PROCID="0", SLURM_NODEID="0", SLURM_LOCALID="0", SLURM_STEP_ID="0",
                  SLURM_STEP_NUM_TASKS="1")
os.execvp(args[0], args)
