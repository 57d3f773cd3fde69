"""Process placement (torchrun/Slurm), torch.distributed + Megatron parallel init, CPU compatibility."""
from .env import DistEnv, DistEnvError, expand_hostlist, read_dist_env
from .init import DistContext, LayoutError, free_port, host_group, init_distributed

__all__ = [
    "DistContext",
    "DistEnv",
    "DistEnvError",
    "LayoutError",
    "expand_hostlist",
    "free_port",
    "host_group",
    "init_distributed",
    "read_dist_env",
]
