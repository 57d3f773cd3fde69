"""Rollouts: the engine interface and its records (engine/), SGLang (sglang/), vLLM (vllm/), the local CPU engine
with the same HTTP APIs (local/), the multi-turn search agent loop (agent/), and `launch.start_engines`, which
starts or attaches the engines a config names. The chat format and tokenizers live in megatron_search.chat.

Entry points: `engine.base.Engine`, `sglang.client.SGLangClient`, `local.engine.LocalEngine`,
`local.launch.launch_local_server`, `agent.loop.SearchAgent` + `AgentTask` -> `engine.types.Rollout`.
Sub-packages import nothing on their own (torch and transformers are heavy).
"""
