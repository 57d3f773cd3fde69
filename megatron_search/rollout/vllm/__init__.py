"""vLLM 0.33.0 as the second engine: client, command line and launcher (client.py; docs/ROLLOUT.md "vLLM")."""
