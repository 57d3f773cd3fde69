"""Preference reward model (RECIPE 5.1): Megatron backbone + value head, BT training, scoring, GRPO service.

Modules: model (RewardModel), scorer (texts, batching, pointwise / pairwise P_bar), train (RMTrainer,
train_rm), service (PreferenceService, ReferenceCache), data (pair JSONL, converters, noise filter),
synthetic (cite-rule demo set), sbs (held-out metrics, side-by-side score), build (from the config).
Importing this package does not import Megatron; model/scorer/train/build do.
"""
