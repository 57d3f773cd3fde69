"""SGLang: the HTTP client and launcher (client.py), the key-hiding launch wrapper (serve.py) and SGLang's
weight-update process group (weight_group.py), checked against sglang's own code (docs/ROLLOUT.md)."""
