"""Stand-in for the sglang package inside tests/slurm/engine_probe.sh's job only (see launch_server)."""
