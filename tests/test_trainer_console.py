"""The console line of GRPO (and SFT's log): step k/N, elapsed and ETA from this run's own pace."""
from megatron_search.trainer.metrics import format_line, format_progress


def test_progress_counts_this_runs_pace_only():
    # 3 of 10 steps in 90 s, from a fresh start: 30 s a step, 7 to go: 210 s
    assert format_progress(3, 10, 90.0, 3) == "step 3/10 | 0:01:30 elapsed, ETA 0:03:30"
    # resumed at step 6: 2 steps in 100 s this run, 2 to go
    assert format_progress(8, 10, 100.0, 2) == "step 8/10 | 0:01:40 elapsed, ETA 0:01:40"
    assert format_progress(400, 400, 7265.4, 400) == "step 400/400 | 2:01:05 elapsed, ETA 0:00:00"
    assert format_progress(1, 5, 0.0, 0).endswith("ETA ?")


def test_the_line_keeps_the_keys_present_in_order():
    values = {"reward/mean": 0.51234, "train/entropy": 1.25, "perf/rollout_tokens_per_s": 1234.5}
    keys = ["reward/mean", "train/loss", "train/entropy", "perf/rollout_tokens_per_s"]
    assert format_line(2, values, keys) == "step 2 | mean 0.5123 | entropy 1.25 | rollout_tokens_per_s 1234"
    assert format_line(2, values, keys[:1], head="step 3/10 | x").startswith("step 3/10 | x | mean 0.5123")
