"""Cluster launch planning: split a Slurm allocation into training and rollout nodes and build the
commands the sbatch scripts run (the shell side is slurm/lib.sh)."""
