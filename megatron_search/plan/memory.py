"""Per-GPU memory estimates for a training layout and its SGLang rollout engines.

Model (documented in docs/PLANNER.md, checked against FACTS.md's published layouts):
- weights: params_dtype bytes per parameter on its rank (dense / TP, routed experts / (EP x ETP),
  embedding on the first stage, output layer on the last, norms replicated);
- gradients: 4 bytes per parameter when main_grads_fp32, else the param bytes;
- optimizer: fp32 master weights + Adam m and v = 12 bytes per parameter, divided by the
  distributed-optimizer shard group: DP x CP for dense weights, the expert data-parallel group
  (TP x CP x DP) / (EP x ETP) for routed experts;
- activations: the bf16 tensors autograd keeps per layer (sequence parallel shards them by TP), times
  the layers a pipeline stage keeps in flight under 1F1B (all L layers' worth on the first stage,
  x (1 + (PP-1)/(PP x VPP)) when interleaved); full recompute keeps only each layer's input plus one
  layer's working set; logits for the loss on the last stage.
- SGLang: weights / (engine TP), KV cache per token for full-attention layers and a fixed recurrent
  state per sequence for Gated DeltaNet layers.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from megatron_search.config.hf import Architecture
from megatron_search.config.schema import Config, layout_problems, stage_problems

from .params import ParamCounts, count_params
from .residency import COLOCATED_ORDER, holder_sizes, price
from .step_time import reference_time, step_time

GIB = 1024**3
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
ADAM_STATE_BYTES = 12  # fp32 master copy + exp_avg + exp_avg_sq
ACT_BYTES = 2  # activations are kept in bf16 in mixed-precision training
GDN_STATE_BYTES = 4  # SGLang keeps the recurrent state in fp32


@dataclass
class StageMemory:
    stage: int
    params: int
    expert_params: int
    weights: float
    grads: float
    optimizer: float
    activations: float

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations


@dataclass
class RolloutMemory:
    engine_gpus: int
    engines: int
    weights: float
    kv_bytes_per_token: float
    state_bytes_per_seq: float
    kv_budget: float

    @property
    def max_tokens(self) -> int:
        return int(max(self.kv_budget, 0) // self.kv_bytes_per_token) if self.kv_bytes_per_token else 0


@dataclass
class Plan:
    train_gpus: int
    rollout_gpus: int
    dp: int
    counts: ParamCounts
    stages: list[StageMemory] = field(default_factory=list)
    rollout: RolloutMemory | None = None
    problems: list[str] = field(default_factory=list)
    sync: object | None = None  # plan.weight_sync.SyncReport (GRPO)
    moments: list = field(default_factory=list)  # colocated GRPO: plan.residency.PricedMoment, every stage
    checkpoint: object | None = None  # plan.checkpoint.CheckpointEstimate
    step_time: object | None = None  # plan.step_time.StepTimeEstimate
    references: object | None = None  # plan.step_time.ReferenceEstimate (GRPO, references from the rollout engines)

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def peak_stage(self) -> StageMemory:
        return max(self.stages, key=lambda s: s.total)


def layer_activation_bytes(a: Architecture, layer: int, tokens: float, recompute: str) -> float:
    """bf16 bytes autograd keeps for one layer of one micro-batch (before TP/SP sharding)."""
    h = a.hidden_size
    if a.is_full_attention(layer):
        q = a.num_attention_heads * a.head_dim
        gate = q if a.model_type == "qwen3_5_moe" else 0
        core = q  # attention output before o_proj (flash attention keeps no s x s matrix)
        mixer = h + q + gate + 2 * a.num_key_value_heads * a.head_dim + core + q
        if recompute == "selective":
            mixer -= core
    else:
        qk = 2 * a.linear_num_key_heads * a.linear_key_head_dim
        v = a.linear_num_value_heads * a.linear_value_head_dim
        mixer = h + (qk + 2 * v + 2 * a.linear_num_value_heads) + (qk + v) + 3 * v
    k, i = a.moe_top_k, a.moe_ffn_hidden_size
    moe = h + k * (h + 2 * i + i + h)
    if a.shared_expert_intermediate_size:
        moe += 3 * a.shared_expert_intermediate_size
    return tokens * (2 * h + mixer + moe) * ACT_BYTES


def _stage_layers(num_layers: int, pp: int) -> list[range]:
    per = num_layers // pp
    return [range(s * per, (s + 1) * per) for s in range(pp)]


def training_memory(cfg: Config, stage_kind: str, dp: int, counts: ParamCounts) -> list[StageMemory]:
    a, p, o = cfg.model.architecture, cfg.parallel, cfg.optim
    if stage_kind == "sft":
        mbs, seq = cfg.sft.micro_batch_size, cfg.sft.seq_length
    else:
        mbs, seq = cfg.grpo.micro_batch_size, cfg.rollout.max_total_tokens
        if cfg.grpo.max_tokens_per_micro_batch is not None:  # train/microbatches.py: rows x width <= budget, a longer
            mbs, seq = 1, max(cfg.grpo.max_tokens_per_micro_batch, seq)  # row alone
    pbytes = DTYPE_BYTES[cfg.model.params_dtype]
    gbytes = 4 if o.main_grads_fp32 else pbytes
    dense_shard = dp * p.cp if p.distributed_optimizer else 1
    expert_shard = max((p.tp * p.cp * dp) // (p.ep * p.etp), 1) if p.distributed_optimizer else 1
    tokens = mbs * seq / p.cp / p.tp  # per rank, sequence parallel
    interleave = 1 + (p.pp - 1) / (p.pp * p.vpp) if p.vpp else 1.0
    out = []
    for s, layers in enumerate(_stage_layers(a.num_layers, p.pp)):
        dense = sum(counts.dense_per_layer[i] for i in layers) / p.tp + sum(counts.norms_per_layer[i] for i in layers)
        if s == 0:
            dense += counts.embedding / p.tp
        if s == p.pp - 1:
            dense += (counts.output_layer + counts.mtp) / p.tp + counts.final_norm
        experts = counts.experts_per_layer * len(layers) / (p.ep * p.etp)
        params = dense + experts
        opt = ADAM_STATE_BYTES * (dense / dense_shard + experts / expert_shard)
        per_layer = [layer_activation_bytes(a, i, tokens, cfg.model.recompute) for i in layers]
        # Under 1F1B stage s keeps (PP - s) micro-batches in flight, each over its own layers.
        inflight = (p.pp - s) * interleave
        if cfg.model.recompute == "full":
            act = inflight * len(layers) * tokens * a.hidden_size * ACT_BYTES + max(per_layer)
        else:
            act = inflight * sum(per_layer)
        if s == p.pp - 1:
            seq_tokens = mbs * seq / p.cp  # the output layer gathers the sequence-parallel shards
            act += seq_tokens * (a.vocab_size / p.tp) * (ACT_BYTES + 4)  # bf16 logits + fp32 grad chunk
        out.append(
            StageMemory(s, int(params), int(experts), params * pbytes, params * gbytes, opt, act)
        )
    return out


def rollout_memory(cfg: Config, counts: ParamCounts, rollout_gpus: int) -> RolloutMemory:
    a, sg, c = cfg.model.architecture, cfg.rollout.sglang, cfg.cluster
    engine_gpus = sg.tp * sg.dp
    weights = counts.total * 2 / sg.tp  # bf16 serving weights, sharded over the engine's TP ranks
    full_layers = sum(a.is_full_attention(i) for i in range(a.num_layers))
    kv_heads = max(a.num_key_value_heads / sg.tp, 1)  # KV heads are replicated when TP exceeds them
    kv_per_token = full_layers * 2 * kv_heads * a.head_dim * 2
    state = 0.0
    if a.is_hybrid:
        gdn_layers = a.num_layers - full_layers
        nv = max(a.linear_num_value_heads / sg.tp, 1)
        conv_ch = (2 * a.linear_num_key_heads * a.linear_key_head_dim + a.linear_num_value_heads * a.linear_value_head_dim) / sg.tp
        state = gdn_layers * (nv * a.linear_key_head_dim * a.linear_value_head_dim * GDN_STATE_BYTES
                              + conv_ch * a.linear_conv_kernel_dim * 2)
    budget = sg.mem_fraction_static * c.gpu_mem_gib * GIB - weights
    return RolloutMemory(engine_gpus, rollout_gpus // engine_gpus, weights, kv_per_token, state, budget)


def make_plan(cfg: Config, stage_kind: str = "grpo") -> Plan:
    """Check the layout on the configured cluster and estimate per-GPU memory."""
    c, r = cfg.cluster, cfg.rollout
    total = c.nodes * c.gpus_per_node
    problems: list[str] = []
    if r.mode == "disaggregated":
        if c.rollout_nodes == 0 and stage_kind == "grpo":
            problems.append("cluster.rollout_nodes: disaggregated rollouts need at least one rollout node")
        if c.rollout_nodes >= c.nodes:
            problems.append(f"cluster.rollout_nodes: {c.rollout_nodes} of {c.nodes} nodes leaves none for training")
        train_gpus = (c.nodes - c.rollout_nodes) * c.gpus_per_node
        rollout_gpus = c.rollout_nodes * c.gpus_per_node
    else:
        train_gpus = rollout_gpus = total
    problems += layout_problems(cfg, train_gpus) + stage_problems(cfg, stage_kind, train_gpus, inputs=False)
    p = cfg.parallel
    dp = max(train_gpus // (p.tp * p.pp * p.cp), 1)
    counts = count_params(cfg.model.architecture, include_mtp=cfg.model.mtp)
    plan = Plan(train_gpus, rollout_gpus, dp, counts, problems=problems)
    if any(x.startswith(("parallel.pp", "model.")) for x in problems):
        return plan
    plan.stages = training_memory(cfg, stage_kind, dp, counts)
    from .checkpoint import checkpoint_estimate  # start-up: plan/checkpoint.py imports this module (import cycle)

    plan.checkpoint = checkpoint_estimate(cfg, plan)
    plan.step_time = step_time(cfg, stage_kind, counts, train_gpus, plan.checkpoint.save_s)
    if plan.step_time.margin_s > c.preemption_notice_s:
        problems.append(f"preemption: a stop needs about {plan.step_time.margin_s:.0f} s (the update in flight "
                        f"{plan.step_time.step_s:.0f} s, then a save {plan.checkpoint.save_s:.0f} s at the configured "
                        f"filesystem bandwidth), more than the {c.preemption_notice_s:.0f} s of notice "
                        "(cluster.preemption_notice_s, the scripts' --signal); raise both, or shorten the step")
    usable = (c.gpu_mem_gib - c.memory_headroom_gib) * GIB
    peak = plan.peak_stage
    if peak.total > usable:
        problems.append(
            f"memory: training needs {peak.total / GIB:.1f} GiB on pipeline stage {peak.stage}, "
            f"more than the {usable / GIB:.1f} GiB usable per GPU (raise PP/EP, or recompute)"
        )
    if stage_kind == "grpo" and rollout_gpus:
        sg = cfg.rollout.sglang
        if rollout_gpus % (sg.tp * sg.dp):
            problems.append(
                f"rollout.sglang: an engine spans TP x DP = {sg.tp * sg.dp} GPUs, which does not divide the "
                f"{rollout_gpus} rollout GPUs"
            )
        if sg.tp % sg.ep:
            problems.append(f"rollout.sglang.ep: EP={sg.ep} must divide the engine TP={sg.tp}")
        ro = rollout_memory(cfg, counts, rollout_gpus)
        plan.references = reference_time(cfg, ro.engines)
        if plan.references is not None and plan.references.seconds > cfg.parallel.phase_timeout_s:
            problems.append(f"grpo.reference_source: the rollout engines would answer all {plan.references.answers:,} "
                            f"reference prompts at step 0, up to {plan.references.seconds / 3600:.1f} h at "
                            f"cluster.engine_tokens_per_s, longer than the {cfg.parallel.phase_timeout_s / 3600:.1f} h "
                            "the other ranks wait (parallel.phase_timeout_s); serve a frozen reference "
                            "(grpo.reference_urls), shorten the run, or raise the timeout")
        plan.rollout = ro
        if ro.kv_budget <= 0:
            problems.append(
                f"rollout.sglang: bf16 weights need {ro.weights / GIB:.1f} GiB per GPU at TP={sg.tp}, more than "
                f"mem_fraction_static x GPU memory = {sg.mem_fraction_static * c.gpu_mem_gib:.1f} GiB"
            )
        elif ro.max_tokens < cfg.rollout.max_total_tokens:
            problems.append(
                f"rollout.sglang: KV cache holds {ro.max_tokens} tokens, fewer than one rollout "
                f"(rollout.max_total_tokens={cfg.rollout.max_total_tokens})"
            )
        if cfg.rollout.mode == "colocated" and ro.kv_budget > 0:
            # every stage's GPU also hosts an engine: the loop's order of moments (plan/residency.py), priced on each
            fraction = sg.mem_fraction_static * c.gpu_mem_gib * GIB
            sizes = {st.stage: holder_sizes(st, ro, fraction, cfg.weight_bucket_bytes()) for st in plan.stages}
            plan.moments = price(COLOCATED_ORDER, sizes)
            over = [m for m in plan.moments if m.total > usable]
            if over:
                worst = max(over, key=lambda m: m.total)
                problems.append(f"memory: colocated moment '{worst.moment.name}' needs {worst.total / GIB:.1f} GiB on "
                                f"pipeline stage {worst.stage} ({', '.join(sorted(worst.parts))}), more than the "
                                f"{usable / GIB:.1f} GiB usable ({len(over)} moment(s) x stage(s) over)")
        if not any(x.startswith(("parallel.", "rollout.weight_bucket_mb")) for x in problems):
            # start-up: numpy + weights/send_plan.py (+0.11 s on plan), only for a grpo plan's weight-sync report
            from .weight_sync import weight_sync_report

            plan.sync = weight_sync_report(cfg, train_gpus)
    return plan
