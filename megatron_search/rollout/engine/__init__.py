"""The engine interface every rollout engine implements (base.py: `Engine`, its errors, routed-experts codec), the
request and rollout records (types.py), failure classes and engine health, the API key rules (auth.py), server
subprocesses (process.py) and the local server's tensor payload (tensor_payload.py)."""
