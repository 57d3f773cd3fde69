"""The one typed config schema for every stage, with the cross-field checks.

Each component owns a small section (`model`, `parallel`, `grpo`, ...); the root `Config`
composes them and runs the checks that span sections. Every problem is reported on its own
line naming the field, so one failed load shows everything that needs fixing.
"""
from __future__ import annotations

import json

from typing import Optional

from pydantic import Field, ValidationInfo, model_validator

from .base import Section
from .cluster import ClusterConfig
from .data import DataConfig
from .demo import DemoConfig
from .eval import EvalConfig
from .hf import HFConfigError
from .model import ModelConfig, ParallelConfig, resolve_repo_path, weights_format
from .reward import RewardConfig
from .rl import GRPOConfig
from .rm import RMConfig
from .rollout import RolloutConfig, SearchConfig
from .training import CheckpointConfig, LoggingConfig, OptimConfig, RunConfig, SFTConfig


class Config(Section):
    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    rm: RMConfig = Field(default_factory=RMConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    search: SearchConfig = Field(default_factory=SearchConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    demo: DemoConfig = Field(default_factory=DemoConfig)

    @model_validator(mode="after")
    def _cross_checks(self, info: ValidationInfo) -> "Config":
        """Checks spanning sections; with a stage in the validation context (load_config(..., stage=)),
        also the checks of that job (stage_problems)."""
        problems = layout_problems(self, self.parallel.world_size)
        stage = (info.context or {}).get("stage")
        if stage is not None:
            problems += stage_problems(self, stage, self.parallel.world_size)
        if problems:
            raise ValueError("\n".join(problems))
        return self

    def initial_weights_source(self) -> Optional[str]:
        """The path a fresh training run starts from (checkpoint.load, else model.path unless model.init=random),
        or None for a random init."""
        if self.checkpoint.load:
            return self.checkpoint.load
        return self.model.path if self.model.init == "pretrained" else None

    def approx_params(self) -> int:
        """Rough language-model parameter count (embeddings, routed and shared experts, attention-sized
        projections per layer): enough to tell a tiny model from one a rank-0 CPU engine cannot hold."""
        a = self.model.architecture
        per_layer = a.num_experts * 3 * a.hidden_size * a.moe_ffn_hidden_size
        per_layer += 3 * a.hidden_size * a.shared_expert_intermediate_size + 4 * a.hidden_size * a.hidden_size
        return 2 * a.vocab_size * a.hidden_size + a.num_layers * per_layer

    def reference_source(self) -> str:
        """Where GRPO's reference answers come from: urls, in_process or rollout_engines (grpo.reference_source)."""
        g = self.grpo
        if g.reference_urls:
            return "urls"
        if g.reference_source != "auto":
            return g.reference_source
        return "in_process" if self.approx_params() <= IN_PROCESS_REFERENCE_MAX_PARAMS else "rollout_engines"

    def largest_weight_bytes(self) -> int:
        """The embedding / output layer [V, H] in params_dtype: one HF tensor, which a bucket must hold whole."""
        a = self.model.architecture
        return a.vocab_size * a.hidden_size * (4 if self.model.params_dtype == "float32" else 2)

    def weight_bucket_bytes(self) -> int:
        """rollout.weight_bucket_mb in bytes; unset: 512 MiB, or the largest tensor rounded up to MiB."""
        if self.rollout.weight_bucket_mb is not None:
            return self.rollout.weight_bucket_mb << 20
        return max(512 << 20, -(-self.largest_weight_bytes() // (1 << 20)) << 20)

    def data_parallel_size(self, world_size: int) -> int:
        p = self.parallel
        return world_size // (p.tp * p.pp * p.cp)


STAGES: tuple[str, ...] = ("sft", "rm", "grpo")
IN_PROCESS_REFERENCE_MAX_PARAMS = 2_000_000_000  # a transformers model on rank 0 beyond this is not a reference engine


def layout_problems(cfg: Config, world_size: int | None) -> list[str]:
    """Every violated parallelism rule, one message each (empty when the layout is valid).

    Also called at launch with the real world size, so torchrun/Slurm mismatches fail the same way.
    """
    p = cfg.parallel
    out: list[str] = []
    try:
        arch = cfg.model.architecture
    except HFConfigError as e:
        return [f"model.hf_config: {e}"]
    model_ranks = p.tp * p.pp * p.cp
    if world_size is not None:
        if world_size % model_ranks:
            out.append(
                f"parallel.world_size: {world_size} is not TP x PP x CP x DP for TP={p.tp} PP={p.pp} "
                f"CP={p.cp} (needs a multiple of {model_ranks})"
            )
        else:
            dp = world_size // model_ranks
            if (p.tp * p.cp * dp) % (p.ep * p.etp):
                out.append(
                    f"parallel.ep: EP x ETP = {p.ep * p.etp} must divide TP x CP x DP = {p.tp * p.cp * dp} "
                    f"(the ranks of one pipeline stage)"
                )
    if arch.num_experts % p.ep:
        out.append(f"parallel.ep: {arch.num_experts} experts are not divisible by EP={p.ep}")
    if arch.num_attention_heads % p.tp:
        out.append(f"parallel.tp: {arch.num_attention_heads} attention heads are not divisible by TP={p.tp}")
    kv = arch.num_key_value_heads
    if kv % p.tp and p.tp % kv:
        # Megatron-Core replicates KV heads when TP is a multiple of the query groups.
        out.append(f"parallel.tp: {kv} key/value heads (query groups) must be a multiple or divisor of TP={p.tp}")
    if arch.is_hybrid:
        if arch.linear_num_key_heads % p.tp:
            out.append(f"parallel.tp: {arch.linear_num_key_heads} GDN key heads are not divisible by TP={p.tp}")
        if arch.linear_num_value_heads % p.tp:
            out.append(f"parallel.tp: {arch.linear_num_value_heads} GDN value heads are not divisible by TP={p.tp}")
    if arch.num_experts > 0 and p.tp > 1 and not p.sequence_parallel:
        out.append("parallel.sequence_parallel: MoE with TP>1 needs sequence_parallel=true (Megatron-Core requirement)")
    if arch.num_experts > 0 and p.ep == 1 and p.etp != p.tp:
        # With EP=1 Megatron puts expert weights in the dense grad buffer (reduced over the dense DP
        # group), but each rank's experts only see its own ETP x EP token share: with ETP != TP the
        # expert gradients would silently miss the other TP ranks' tokens (seen on CPU, issue 2).
        out.append(
            f"parallel.etp: with EP=1, expert tensor parallel must equal TP (got ETP={p.etp}, TP={p.tp}); "
            f"set parallel.etp={p.tp} or use EP>1"
        )
    if cfg.model.mtp:
        if arch.mtp_num_layers == 0:
            out.append(f"model.mtp: {cfg.model.hf_config} has no multi-token-prediction layers "
                       f"(mtp_num_hidden_layers=0); set model.mtp=false")
        elif arch.mtp_num_layers != 1:
            out.append(f"model.mtp: mtp_num_hidden_layers={arch.mtp_num_layers} in {cfg.model.hf_config}; Qwen3.5 "
                       f"checkpoints hold one fc / pre-fc norm / norm set for their MTP module, which maps onto "
                       f"exactly one Megatron MTP layer")
    if cfg.sft.skill_check.path and (p.tp, p.pp, p.cp) != (1, 1, 1):
        out.append(f"sft.skill_check: the greedy check decodes on each rank's whole model; it needs TP = PP = CP = 1, "
                   f"got TP={p.tp} PP={p.pp} CP={p.cp} (unset sft.skill_check.path)")
    if cfg.sft.seq_length % p.sequence_multiple:
        out.append(f"sft.seq_length: {cfg.sft.seq_length} is not a multiple of TP={p.tp} (sequence parallelism "
                   f"splits the sequence over the TP ranks)")
    if cfg.grpo.reference_source == "in_process" and not cfg.grpo.reference_urls \
            and cfg.approx_params() > IN_PROCESS_REFERENCE_MAX_PARAMS:
        out.append(f"grpo.reference_source: in_process would load a ~{cfg.approx_params() / 1e9:.0f}B-parameter "
                   f"transformers model on rank 0; use grpo.reference_source=rollout_engines (every reference "
                   f"answer generated up front on the rollout engines) or grpo.reference_urls")
    r = cfg.rollout
    largest = cfg.largest_weight_bytes()
    if r.weight_bucket_mb is not None and largest > r.weight_bucket_mb << 20:
        out.append(f"rollout.weight_bucket_mb: {r.weight_bucket_mb} MiB is smaller than the embedding "
                   f"[{arch.vocab_size}, {arch.hidden_size}] ({largest / 2**20:.0f} MiB), which travels whole; "
                   f"raise it to at least {-(-largest // 2**20)}")
    sync = r.resolved_weight_sync()
    if r.mode == "colocated" and sync == "distributed":
        out.append("rollout.weight_sync: 'distributed' broadcasts to engines on other nodes; colocated engines take "
                   "'tensor' (or 'disk') from their own node's ranks")
    if r.engine == "sglang" and r.mode == "colocated" and not r.sglang.enable_memory_saver:
        out.append("rollout.sglang.enable_memory_saver: colocated engines release their memory while the policy "
                   "trains (release_memory_occupation), which SGLang supports only with the memory saver on")
    if r.engine == "sglang" and r.mode == "disaggregated" and sync == "tensor":
        out.append("rollout.weight_sync: SGLang's /update_weights_from_tensor carries CUDA IPC handles, which open only "
                   "on the sender's node; disaggregated engines need 'distributed' or 'disk'")
    if r.engine == "vllm":
        out += vllm_problems(cfg, sync)
    stages = p.pp * (p.vpp or 1)
    if p.vpp is not None and p.pp == 1:
        out.append("parallel.vpp: virtual pipeline stages need PP > 1")
    if arch.num_layers % stages:
        out.append(f"parallel.pp: {arch.num_layers} layers are not divisible by PP x VPP = {stages}")
    return out


def vllm_problems(cfg: Config, sync: str) -> list[str]:
    """What vLLM 0.33.0 cannot do for this config (rollout/vllm/client.py, docs/ROLLOUT.md "vLLM")."""
    r, out = cfg.rollout, []
    if sync in ("tensor", "distributed"):
        out.append(f"rollout.weight_sync: '{sync}' into vLLM is not supported yet: vLLM 0.33.0's weight-transfer "
                   "backends need the trainer on vLLM's own rendezvous (NCCL: StatelessProcessGroup + PyNccl) or CUDA "
                   "IPC handles keyed by each receiving GPU, which the owner-parallel sender does not produce; use "
                   "'disk' (the default with rollout.engine=vllm: /collective_rpc reload_weights)")
    if r.top_p < 1.0 and not r.return_original_logprob:
        out.append(f"rollout.top_p: {r.top_p} with vLLM: its processed_logprobs renormalise over the top-p nucleus, "
                   "while the trainer (and SGLang) use logprobs over the whole vocabulary at the temperature; use "
                   "top_p=1 or rollout.return_original_logprob=true")
    if r.mode == "colocated" and r.vllm.server == "vllm" and not r.vllm.enable_sleep_mode:
        out.append("rollout.vllm.enable_sleep_mode: colocated engines free their memory while the policy trains "
                   "(/sleep, /wake_up), which vLLM serves only with --enable-sleep-mode")
    return out


def stage_problems(cfg: Config, stage: Optional[str], world_size: int | None, inputs: bool = True) -> list[str]:
    """What one job (sft, rm or grpo training) needs of the config beyond a valid layout, one message each.

    Run when a config is loaded for a stage (the stage's own command, `megatron-search config --stage`,
    `launch-plan` in the allocation), by `plan`, and again by the job at start-up with the real world size
    (init_distributed(stage=)), so a config that cannot run fails before it is submitted. Batch divisibility
    needs the data-parallel size: checked when `world_size` is known and the layout divides it. `inputs=False`
    leaves out the run's input paths (rm.load, data.*_path), which the shipped configs leave to the launch
    command line: the planner checks the settings alone."""
    if stage is None:
        return []
    if stage not in STAGES:
        return [f"stage {stage!r}: not one of {', '.join(STAGES)}"]
    p, out = cfg.parallel, training_problems(cfg)
    model_ranks = p.tp * p.pp * p.cp
    dp = world_size // model_ranks if world_size and world_size % model_ranks == 0 else None
    if stage == "sft" and dp is not None:
        s = cfg.sft
        if s.global_batch_size % (dp * s.micro_batch_size):
            out.append(f"sft.global_batch_size: {s.global_batch_size} is not a multiple of data-parallel size {dp} x "
                       f"sft.micro_batch_size={s.micro_batch_size} (world size {world_size})")
    if stage == "rm" and dp is not None:
        rm = cfg.rm
        if rm.global_batch_pairs % (dp * rm.micro_batch_pairs):
            out.append(f"rm.global_batch_pairs: {rm.global_batch_pairs} is not a multiple of data-parallel size {dp} "
                       f"x rm.micro_batch_pairs={rm.micro_batch_pairs} (world size {world_size})")
    if stage == "grpo":
        out += _grpo_problems(cfg, inputs)
    if stage in ("sft", "grpo") and inputs:
        out += initial_weights_problems(cfg, stage)
    if inputs and not any(p.startswith("model.path:") for p in out):  # model.path would fix both: say it once
        out += tokenizer_problems(cfg)
    if stage == "grpo" and inputs and not any(p.startswith("model.path:") for p in out):
        out += engine_dir_problems(cfg)
    return out


# What AutoProcessor reads: SGLang builds a multimodal model's processor even with --skip-tokenizer-init
# (managers/tokenizer_manager.py, 0.5.23), and vLLM builds it to size its multimodal inputs.
PROCESSOR_FILES = ("preprocessor_config.json",)
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model")


def engine_dir_problems(cfg: Config) -> list[str]:
    """SGLang and vLLM start from a complete HF directory: for a multimodal architecture (Qwen3.5's
    *ForConditionalGeneration) that means its processor and tokenizer files, which a config.json alone lacks."""
    engine = cfg.rollout.engine
    if engine == "local" or getattr(cfg.rollout, engine).model_path:
        return []
    folder = cfg.model.engine_dir()
    config = folder / "config.json"
    archs = json.loads(config.read_text()).get("architectures") or [] if config.is_file() else []
    if not any(a.endswith("ForConditionalGeneration") for a in archs):
        return []
    missing = [f for f in PROCESSOR_FILES if not (folder / f).is_file()]
    if not any((folder / f).is_file() for f in TOKENIZER_FILES):
        missing.append(" or ".join(TOKENIZER_FILES))
    if not missing:
        return []
    return [f"model.path: {engine} starts {archs[0]} from {folder}, which lacks {', '.join(missing)} (its processor "
            f"is built at start-up); set model.path to the model's full HF directory (or rollout.{engine}.model_path)"]


def tokenizer_problems(cfg: Config) -> list[str]:
    """'qwen' (the fallback without model.path) is the Qwen2/3 BPE: not the tokenizer of another model_type."""
    model_type = cfg.model.architecture.model_type
    if cfg.model.tokenizer == "qwen" and model_type != "qwen3_moe":
        return [f"model.tokenizer: 'qwen' is the Qwen2/3 BPE, not the tokenizer of {cfg.model.hf_config} (model_type "
                f"{model_type!r}); set model.path to the model's HF directory (or model.tokenizer to its "
                "tokenizer.json)"]
    return []


def initial_weights_problems(cfg: Config, stage: str) -> list[str]:
    """A training stage starts from pretrained weights (checkpoint.load, else model.path) unless model.init=random."""
    if cfg.model.init == "random":
        return []
    if cfg.checkpoint.load:
        source, field = resolve_repo_path(cfg.checkpoint.load), "checkpoint.load"
        if not source.exists():
            return [f"checkpoint.load: {cfg.checkpoint.load} does not exist"]
    elif cfg.model.path:
        source, field = cfg.model.resolved_path(), "model.path"
    else:
        return [f"model.path: {stage} starts from pretrained weights and none are named; set model.path=<the "
                "model's HF directory> (or checkpoint.load=<a checkpoint>, or model.init=random for a random init)"]
    if weights_format(source) is None:
        return [f"{field}: {source} holds no weights (no *.safetensors, no Megatron checkpoint: metadata.json, "
                "trainer.json or latest)"]
    return []


def training_problems(cfg: Config) -> list[str]:
    """What any training job (the Trainer of sft, rm and grpo) needs of the layout beyond its validity."""
    cp = cfg.parallel.cp
    if cp > 1:
        # Megatron-Core leaves the split to the caller (each CP rank feeds its chunk of the sequence); the
        # training step feeds whole sequences, which would be wrong, not just slow.
        return [f"parallel.cp: {cp}: context parallelism is not wired into training (batches are not split "
                f"along the sequence over the CP ranks); use parallel.cp=1"]
    return []


def _grpo_problems(cfg: Config, inputs: bool) -> list[str]:
    g, d, out = cfg.grpo, cfg.data, []
    if cfg.rollout.temperature == 0:
        out.append("rollout.temperature: 0 samples greedily, so the G rollouts of a group would be identical and "
                   "carry no signal; GRPO needs a temperature > 0")
    if not any(w > 0 for w in d.mix.values()):
        out.append(f"data.mix: {d.mix} gives no dataset a positive weight; GRPO has no prompts")
    p = cfg.parallel
    if g.max_tokens_per_micro_batch is not None and cfg.model.moe_token_dispatcher == "allgather" and \
            (p.ep > 1 or p.pp > 1):
        # Megatron refuses variable_seq_lengths with allgather (PP), and the allgather dispatcher gathers equal
        # token counts over the expert-parallel group (EP): micro-batches of varying rows cannot run there
        out.append(f"grpo.max_tokens_per_micro_batch: micro-batches of varying rows need Megatron's variable shapes, "
                   f"which the allgather MoE dispatcher refuses with EP={p.ep} PP={p.pp}; use "
                   f"model.moe_token_dispatcher=alltoall (or auto on GPU), or grpo.micro_batch_size without a budget")
    if not inputs:
        return out
    if not cfg.rm.load:
        out.append("rm.load: GRPO needs a trained reward model for the preference score s (train one with "
                   "`megatron-search rm train`, then pass rm.load=<its checkpoint>)")
    paths = {"qa": d.qa_path, "rubric": d.rubric_path}
    for name, weight in d.mix.items():
        if weight > 0 and not paths[name]:
            out.append(f"data.mix: gives {name!r} weight {weight} but data.{name}_path is not set (set it, or drop "
                       f"{name!r} from data.mix)")
    if g.eval_interval and not d.qa_path:
        out.append("grpo.eval_interval: evaluation answers held-out records of data.qa_path, which is not set")
    return out

