"""RL and SFT data (RECIPE sections 2 and 4): the embedded synthetic world, synthetic multi-hop QA by
sequential expansion, rubric data with pass@4 calibration, public QA converters, the 90/10 prompt mix
and SFT trajectories."""
