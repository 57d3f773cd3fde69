"""Rollouts: engines (SGLang client/launcher, local CPU engine with the same HTTP API), the chat /
tool-call format, tokenizers, and the multi-turn search agent loop.

Entry points: `engine.Engine` (interface), `sglang.SGLangClient` / `sglang.launch_local_server`,
`local.LocalEngine`, `agent.SearchAgent` + `agent.AgentTask` -> `types.Rollout`.
Modules are imported on demand (torch/transformers are heavy).
"""
