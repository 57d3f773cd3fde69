"""The local CPU engine: a continuous-batching transformers engine (engine.py, runner.py) behind SGLang's and
vLLM's HTTP APIs with their refusals (server.py, vllm_api.py, http_input.py), an OpenAI chat endpoint, in-place
weight loading by HF name (weights.py), its launcher (launch.py) and a scripted engine for exact tests."""
