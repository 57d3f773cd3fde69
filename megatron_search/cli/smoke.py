"""`megatron-search smoke`: a few Megatron optimizer steps on a fixed random batch; the loss must fall.

Checks the whole Megatron path of this stack on the current machine: config -> distributed init
(1 process, or torchrun/Slurm) -> model provider -> DDP + optimizer -> pipeline schedule.
Exits 0 when the last loss is below the first, 1 otherwise.
"""
from __future__ import annotations

import argparse
import sys
import time
import warnings

from .common import add_config_args, load_from_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("smoke", help="train the configured model for a few steps on a fixed batch (loss must fall)")
    add_config_args(p)
    p.add_argument("--steps", type=int, default=8, help="optimizer steps (default 8)")
    p.add_argument("--global-batch", type=int, default=4, help="sequences per step over all DP ranks (default 4)")
    p.add_argument("--micro-batch", type=int, default=2, help="sequences per microbatch (default 2)")
    p.add_argument("--seq-len", type=int, default=32, help="tokens per sequence (default 32)")
    p.add_argument("--lr", type=float, default=3e-3,
                   help="learning rate for the smoke run, replacing optim.lr (default 3e-3: a fixed batch is "
                        "memorised within a few steps)")
    p.set_defaults(func=run)


def _check_args(args: argparse.Namespace) -> None:
    for name in ("steps", "global_batch", "micro_batch", "seq_len"):
        if getattr(args, name) < 1:
            raise SystemExit(f"error: --{name.replace('_', '-')} must be >= 1 (got {getattr(args, name)})")
    if args.lr <= 0:
        raise SystemExit(f"error: --lr must be > 0 (got {args.lr})")


def run(args: argparse.Namespace) -> int:
    _check_args(args)
    cfg = load_from_args(args)
    cfg.optim.lr = args.lr
    # Megatron warns at import that TE/Apex are absent; the local/CPU path is the intended one here.
    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*")

    import torch

    from megatron_search.distributed import init_distributed
    from megatron_search.trainer.step import Batch, data_parallel_slice, make_optimizer, train_step, wrap_ddp
    from megatron_search.models.provider import build_model_chunks

    from megatron_search.distributed import DistEnvError, LayoutError
    from megatron_search.models.provider_common import ProviderError

    t0 = time.monotonic()
    try:
        ctx = init_distributed(cfg)
    except (DistEnvError, LayoutError, ProviderError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        try:
            chunks = build_model_chunks(cfg, ctx.groups)
            ddp = wrap_ddp(cfg, chunks, chunks[0].config)
            optimizer = make_optimizer(cfg, ddp)
        except (ProviderError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        vocab = cfg.model.architecture.vocab_size
        g = torch.Generator().manual_seed(cfg.run.seed)
        tokens = torch.randint(0, vocab, (args.global_batch, args.seq_len + 1), generator=g).to(ctx.device)
        batch = data_parallel_slice(Batch(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()), ctx.groups)
        if ctx.is_main:
            print(f"smoke: {cfg.model.architecture.model_type} world={ctx.world_size} tp={cfg.parallel.tp} "
                  f"pp={cfg.parallel.pp} ep={cfg.parallel.ep} dp={ctx.dp_size} backend={ctx.backend}", flush=True)
        losses = []
        for step in range(1, args.steps + 1):
            loss, grad_norm = train_step(ddp, optimizer, batch, args.micro_batch, ctx.groups)
            losses.append(loss)
            if ctx.is_main:
                print(f"step {step:3d}  loss {loss:.4f}  grad_norm {grad_norm:.4f}", flush=True)
    finally:
        ctx.teardown()
    fell = losses[-1] < losses[0]
    if ctx.is_main:
        verdict = "loss fell" if fell else "loss did NOT fall"
        print(f"smoke: {verdict} {losses[0]:.4f} -> {losses[-1]:.4f} in {time.monotonic() - t0:.1f}s", flush=True)
    return 0 if fell else 1
