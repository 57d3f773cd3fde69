"""The multi-turn search agent loop over any engine (loop.py) and the dispatcher that spreads tasks over engines,
retrying lost rollouts (dispatch.py)."""
