"""One typed config schema for every stage (see schema.Config), YAML + dotted overrides."""
from .hf import Architecture, HFConfigError, architecture_from_hf, load_hf_config
from .loader import ConfigError, apply_overrides, config_from_dict, dump_config, load_config
from .schema import STAGES, Config, layout_problems, stage_problems

__all__ = [
    "Architecture",
    "Config",
    "ConfigError",
    "HFConfigError",
    "apply_overrides",
    "architecture_from_hf",
    "config_from_dict",
    "dump_config",
    "layout_problems",
    "load_config",
    "load_hf_config",
    "stage_problems",
    "STAGES",
]
