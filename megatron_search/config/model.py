"""Model and parallelism sections."""
from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path
from typing import Literal, Optional

from pydantic import Field, PositiveInt, model_validator

from .base import Section
from .hf import Architecture, HFConfigError, architecture_from_hf, load_hf_config


CHAT_STYLE_OF = {"qwen3_moe": "qwen3", "qwen3_5_moe": "qwen3_5"}  # the tool-call syntax each model was trained on
TINY_DEFAULT = "configs/models/tiny_qwen3_moe"  # the embedded default's architecture (no model.path)
_PACKAGE = Path(__file__).resolve().parents[1]


def data_root() -> Path:
    """Where the shipped `configs/` folder lives: the checkout's root (editable installs, tests), or the copy a built
    wheel carries inside the package (`megatron_search/_data`, setup.py), so `pip install .` works anywhere."""
    installed = _PACKAGE / "_data"
    return installed if (installed / "configs").is_dir() else _PACKAGE.parent


REPO_ROOT = data_root()


def resolve_repo_path(path: str | Path) -> Path:
    """An absolute or existing path as it is; else the same path under data_root() (configs/... of the package)."""
    p = Path(path)
    return p if p.is_absolute() or p.exists() else REPO_ROOT / p


class ModelConfig(Section):
    """Which model: one Hugging Face directory (model.path) supplies the architecture, tokenizer, chat format and
    initial weights; hf_config, tokenizer and chat_style override what it supplies. Plus Megatron build choices."""

    path: Optional[str] = Field(
        None, description="the model: an HF directory (config.json, tokenizer.json, chat template, safetensors) "
        "giving the architecture, tokenizer, chat format and initial weights of every stage and the engines; or a "
        "Megatron checkpoint of ours (a run's, or `convert hf-to-mcore` output) as initial weights")
    init: Literal["pretrained", "random"] = Field(
        "pretrained", description="pretrained: training starts from checkpoint.load, else from model.path's weights "
        "(a training stage without either is refused); random: model.path's weights are not loaded and, without "
        "checkpoint.load, training starts from a random init (the tiny demo, the tests)")
    hf_config: Optional[str] = Field(
        None, description="overrides model.path's config.json for the architecture: config.json or a directory "
        "holding one; relative paths resolve against the repository root, then the current directory. Neither set: "
        f"{TINY_DEFAULT} (the embedded default)")
    tokenizer: Optional[str] = Field(
        None, description="overrides model.path's tokenizer.json: a tokenizer.json path (or a directory holding one), "
        "or 'qwen' = the real Qwen2/3 BPE shipped in qwen-agent. Unset and no model.path: 'qwen'")
    chat_style: Optional[Literal["qwen3", "qwen3_5"]] = Field(
        None, description="tool-call syntax of the chat format (qwen3: JSON, qwen3_5: XML); unset: what model.path's "
        "chat template writes, else the model_type's (qwen3_moe -> qwen3, qwen3_5_moe -> qwen3_5); another than the "
        "model's is an error")
    params_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    transformer_impl: Literal["auto", "local", "transformer_engine"] = Field(
        "auto", description="auto: Transformer Engine specs when TE is importable, local otherwise"
    )
    recompute: Literal["none", "selective", "full"] = "none"
    recompute_modules: Optional[list[Literal["core_attn", "moe_act", "layernorm", "mlp", "moe", "shared_experts"]]] = Field(
        None, description="with recompute=selective, the modules recomputed (Megatron's recompute_modules; None = its "
        "default, core_attn); 'moe' recomputes the router too, where routing replay replays the engine's experts"
    )
    mtp: bool = Field(
        False, description="build the model's multi-token-prediction layer (Qwen3.5, HF mtp.*; needs "
        "mtp_num_hidden_layers=1 in the config.json): loaded, exported and synced with the rest of the model; "
        "SFT trains it (cross entropy of token t+2 under the same loss mask, weighted by mtp_loss_scaling_factor); "
        "GRPO keeps it frozen and out of the RL loss (train/grpo.py). Off: HF mtp.* tensors are carried "
        "through conversion unchanged and never synced")
    mtp_loss_scaling_factor: float = Field(
        0.1, ge=0.0, description="weight of the MTP loss added to the SFT loss (Megatron's "
        "mtp_loss_scaling_factor, whose default 0.1 this is); used only with model.mtp")
    seed: int = 1234
    # MoE router losses: set here only. The HF config's router_aux_loss_coef (0.001 in the Qwen3 / Qwen3.5
    # configs) is a pre-training value and is never read: inherited into RL it multiplied the grad norm
    # 3.4x for a peer (Megatron-LM #5694). The RECIPE write-up names no router loss for RL.
    moe_aux_loss_coeff: float = Field(
        0.0, ge=0.0, description="Megatron aux load-balancing loss coefficient; 0 = no aux loss (RL default); "
        "never taken from the HF config's router_aux_loss_coef"
    )
    moe_z_loss_coeff: float = Field(
        0.0, ge=0.0, description="Megatron router z-loss coefficient; 0 = no z-loss (RL default; passed to "
        "Megatron as None, its 'off')"
    )
    moe_token_dispatcher: Literal["auto", "allgather", "alltoall", "flex"] = Field(
        "auto", description="auto: alltoall on GPU, allgather on CPU (alltoall needs CUDA streams); flex: Megatron's "
        "fused all-to-all through model.moe_flex_dispatcher_backend (needs its package, a GPU and TP x EP > 1; "
        "checked when the model is built)"
    )
    moe_flex_dispatcher_backend: Literal["deepep", "hybridep"] = Field(
        "deepep", description="with moe_token_dispatcher=flex: DeepEP (the deep_ep package's Buffer) or HybridEP "
        "(deep_ep's HybridEPBuffer); Megatron-Core 0.16.1's moe_flex_dispatcher_backend, which replaces its deprecated "
        "moe_enable_deepep")
    moe_router_dtype: Optional[Literal["fp32", "fp64"]] = Field(
        None, description="dtype of the router's logits, softmax and the experts' weighted sum (Megatron's "
        "moe_router_dtype); None = the parameters' dtype. The GPU configs use fp32, as slime's MoE scripts do")
    moe_permute_fusion: bool = Field(
        False, description="fused token permutation in the dispatcher (Megatron's moe_permute_fusion; needs "
        "Transformer Engine >= 2.1's moe_permute ops: refused when the model is built without them)")
    fusions: Literal["auto", "off"] = Field(
        "auto", description="Megatron's fused kernels. auto: on a GPU, each fusion whose prerequisite is present "
        "(gradient_accumulation_fusion: the fused_weight_gradient_mlp_cuda extension; apply_rope_fusion: TE's fused "
        "RoPE; bias_activation_fusion, bias_dropout_fusion: Megatron's jit fusions), logged at model build; none on "
        "CPU. off: none (docs/ARCHITECTURE.md, 'Throughput settings')")
    require_te: bool = Field(
        False, description="refuse to build the model without Transformer Engine specs (instead of falling back to "
        "local specs and a per-expert loop); checked when the model is built, not when the config is loaded")

    @model_validator(mode="before")
    @classmethod
    def _from_model_path(cls, data):
        """Fills hf_config, tokenizer and chat_style from model.path (and the model_type) where unset, so every
        reader and the printed config see the resolved values."""
        if not isinstance(data, dict):
            return data
        if "checkpoint" in data:
            raise ValueError("model.checkpoint is gone: model.path names the HF directory (or Megatron checkpoint) "
                             "of the model, its initial weights included")
        data = dict(data)
        path = data.get("path")
        folder = resolve_repo_path(path) if path else None
        if folder is not None and not folder.exists():
            raise ValueError(f"model.path: {path} does not exist")
        hf_side = _hf_side(folder) if folder is not None else None
        if folder is not None and hf_side is None and not (data.get("hf_config") and data.get("tokenizer")):
            raise ValueError(f"model.path: {path} holds no config.json (nor hf_extra/config.json, as `convert "
                             "hf-to-mcore` writes): set model.hf_config and model.tokenizer to the model's HF files")
        if not data.get("hf_config"):
            data["hf_config"] = str(hf_side) if hf_side is not None else TINY_DEFAULT
        elif hf_side is not None:
            _same_architecture(resolve_repo_path(data["hf_config"]), hf_side)
        if not data.get("tokenizer"):
            if hf_side is not None and not (hf_side / "tokenizer.json").is_file():
                raise ValueError(f"model.path: {hf_side} holds no tokenizer.json; set model.tokenizer to the "
                                 "model's tokenizer.json")
            data["tokenizer"] = str(hf_side / "tokenizer.json") if hf_side is not None else "qwen"
        model_type = _model_type(resolve_repo_path(data["hf_config"]))
        template = chat_template_of(hf_side) if hf_side is not None else None
        template_style = chat_style_of_template(template[1]) if template else None
        # the model's own format: what its chat template writes (Qwen3-Coder is a qwen3_moe that calls tools in
        # XML), else its model_type's
        own_style = template_style or CHAT_STYLE_OF.get(model_type)
        why = (f"the chat template {template[0]} writes tool calls as {own_style!r}" if template_style else
               f"{data['hf_config']} is model_type {model_type!r}, which calls tools in {own_style!r}")
        style = data.get("chat_style")
        if style is None:
            data["chat_style"] = own_style or "qwen3"
        elif own_style is not None and style != own_style:
            raise ValueError(f"model.chat_style: {style!r} is not the chat format of the model ({why}); drop "
                             f"model.chat_style or set it to {own_style!r}")
        return data

    @model_validator(mode="after")
    def _recompute_modules_need_selective(self):
        if self.recompute_modules is not None and self.recompute != "selective":
            raise ValueError(f"model.recompute_modules: {self.recompute_modules} applies to recompute=selective only "
                             f"(recompute={self.recompute!r})")
        if self.require_te and self.transformer_impl == "local":
            raise ValueError("model.require_te: true asks for Transformer Engine specs, model.transformer_impl=local "
                             "refuses them; set one of them differently")
        return self

    def resolved_hf_config(self) -> Path:
        return resolve_repo_path(self.hf_config)

    def engine_dir(self) -> Path:
        """The HF directory engines start from when rollout.*.model_path is unset: model.path when it is one, else
        the HF files it keeps (a convert output's hf_extra/), else model.hf_config's directory. GRPO starts them
        with dummy weights: the policy is pushed before the first rollout, so reading the weights would be waste."""
        path = self.resolved_path()
        side = _hf_side(path) if path is not None else None
        if side is not None:
            return side
        hf = self.resolved_hf_config()
        return hf if hf.is_dir() else hf.parent

    def resolved_path(self) -> Optional[Path]:
        """model.path resolved like hf_config (None when unset)."""
        return resolve_repo_path(self.path) if self.path else None

    @cached_property
    def architecture(self) -> Architecture:
        path = self.resolved_hf_config()
        return architecture_from_hf(load_hf_config(path), where=str(path))


def weights_format(folder: Path) -> Optional[str]:
    """What initial weights a folder holds, told apart by its files: 'run' (a training run's checkpoint, or a
    checkpoint root holding them), 'mcore' (a `convert hf-to-mcore` output), 'hf' (safetensors), else None."""
    if (folder / "trainer.json").is_file() or (folder / "latest").is_file() or any(folder.glob("*/trainer.json")):
        return "run"
    if (folder / "metadata.json").is_file():
        return "mcore"
    if any(folder.glob("*.safetensors")):
        return "hf"
    return None


def chat_template_of(folder: Path) -> Optional[tuple[Path, str]]:
    """(file, text) of an HF directory's chat template: chat_template.jinja (Qwen3.5), else tokenizer_config.json's
    chat_template (Qwen3; a list of named templates gives its 'default'); None when it has none."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja, jinja.read_text()
    config = folder / "tokenizer_config.json"
    if not config.is_file():
        return None
    try:
        template = json.loads(config.read_text()).get("chat_template")
    except (json.JSONDecodeError, AttributeError):
        return None
    if isinstance(template, list):
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    return (config, template) if isinstance(template, str) else None


def chat_style_of_template(template: str) -> Optional[str]:
    """The tool-call syntax a chat template writes: 'qwen3_5' (XML `<function=NAME>`), 'qwen3' (a JSON object
    with "name" in `<tool_call>`), None when it writes neither (no tool calls, or another family's)."""
    if "<tool_call>" not in template:
        return None
    if "<function=" in template:
        return "qwen3_5"
    if '{"name": ' in template:
        return "qwen3"
    return None


def _hf_side(folder: Path) -> Optional[Path]:
    """Where a model.path keeps its HF files: the folder itself, or the hf_extra/ of a `convert hf-to-mcore`
    output; None for a folder with neither (a training run's checkpoint)."""
    for candidate in (folder, folder / "hf_extra"):
        if (candidate / "config.json").is_file():
            return candidate
    return None


def _same_architecture(hf_config: Path, hf_side: Path) -> None:
    """model.hf_config (the planner's architecture in the shipped configs) must describe model.path's model."""
    try:
        want = architecture_from_hf(load_hf_config(hf_config), where=str(hf_config))
        have = architecture_from_hf(load_hf_config(hf_side), where=str(hf_side))
    except HFConfigError:
        return  # reported where the architecture is read
    diffs = [f"{k} {getattr(want, k)} vs {getattr(have, k)}" for k in want.__dataclass_fields__
             if getattr(want, k) != getattr(have, k)]
    if diffs:
        raise ValueError(f"model.hf_config: {hf_config} does not describe model.path's model {hf_side} ("
                         + "; ".join(diffs) + "); drop model.hf_config or point it at the same model")


def _model_type(hf_config: Path) -> Optional[str]:
    """model_type of a config.json (or its directory), None when it cannot be read (reported where it is used)."""
    try:
        return load_hf_config(hf_config).get("model_type")
    except HFConfigError:
        return None


class ParallelConfig(Section):
    """Megatron parallel layout. DP is derived: world / (TP * PP * CP)."""

    tp: PositiveInt = 1
    pp: PositiveInt = 1
    vpp: Optional[PositiveInt] = Field(None, description="virtual pipeline stages per rank")
    cp: PositiveInt = 1
    ep: PositiveInt = 1
    etp: PositiveInt = Field(
        1, description="expert tensor parallel size; when not given it equals tp (Megatron-LM's default)"
    )
    sequence_parallel: bool = False
    world_size: Optional[PositiveInt] = Field(
        None, description="expected world size; checked against TP*PP*CP*DP when given and at launch"
    )
    distributed_optimizer: bool = True
    overlap_grad_reduce: bool = Field(
        False, description="Megatron DDP launches each gradient bucket's all-reduce / reduce-scatter during the "
        "backward of the last micro-batch, as soon as the bucket is complete (DistributedDataParallelConfig."
        "overlap_grad_reduce); off: all of them after the backward")
    overlap_param_gather: bool = Field(
        False, description="the distributed optimizer's parameter all-gather runs bucket by bucket during the next "
        "forward (DistributedDataParallelConfig.overlap_param_gather); needs distributed_optimizer and "
        "overlap_grad_reduce. Between optimizer.step() and that forward the parameters outside this rank's shard "
        "are stale: checkpoint saves and weight exports force the gather first (models/provider.py sync_params)")
    backend: Literal["auto", "nccl", "gloo"] = Field("auto", description="auto: nccl on GPU, gloo on CPU")
    phase_timeout_s: float = Field(
        6 * 3600.0, gt=0, description="timeout of the host (gloo) group over every rank that carries GRPO's phase "
        "hand-offs: the other ranks wait on it, off the GPU, while rank 0 rolls out, scores and evaluates (an NCCL "
        "collective would hold a GPU kernel and trip its watchdog after 600 s); longer than any rollout phase")

    @property
    def sequence_multiple(self) -> int:
        """Training sequence lengths must be a multiple of this: sequence parallelism splits them over TP."""
        return self.tp if self.sequence_parallel else 1

    @model_validator(mode="after")
    def _param_gather_overlap_needs(self):
        # Megatron-LM's arguments.py refuses the same: the overlapped gather is the distributed optimizer's, and its
        # buckets are dispatched from the grad-sync bookkeeping that overlap_grad_reduce sets up.
        if self.overlap_param_gather and not self.distributed_optimizer:
            raise ValueError("parallel.overlap_param_gather: overlaps the distributed optimizer's parameter all-gather; "
                             "set parallel.distributed_optimizer=true or parallel.overlap_param_gather=false")
        if self.overlap_param_gather and not self.overlap_grad_reduce:
            raise ValueError("parallel.overlap_param_gather: needs parallel.overlap_grad_reduce=true (as Megatron-LM "
                             "requires); set both or neither")
        return self

    @model_validator(mode="before")
    @classmethod
    def _etp_defaults_to_tp(cls, data):
        # With EP=1, ETP must equal TP (see layout_problems), so an unset ETP follows TP.
        if isinstance(data, dict) and data.get("etp") is None and "tp" in data:
            data = {**data, "etp": data["tp"]}
        return data
