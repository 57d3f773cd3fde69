"""The chat format (Qwen3 / Qwen3.5 templates with tool calls: render, parse) and the tokenizers (HF and the demo's
BPE): what the rollout agent, SFT, the reward model and evaluation share."""
