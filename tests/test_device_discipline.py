"""Device discipline: no raw tensor collective in train/, trainer/, distributed/, weights/ or rm/.

NCCL takes CUDA tensors only, and the scalars these packages reduce (losses, token counts, flags) are
built on the host: a raw dist.all_reduce of one runs on CPU (gloo) and fails on every GPU cluster.
Every tensor collective goes through megatron_search/distributed/collectives.py, which places the tensor
on its group's device. Point-to-point weight moves (weights/export.py) post their tensors on the
parameters' own device and are not matched here; object collectives pickle and place their own buffers.
"""
import re
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_search.distributed import collectives as coll

PKG = Path(__file__).resolve().parents[1] / "megatron_search"
RAW = re.compile(r"\bdist\.(all_reduce|broadcast|all_gather|all_gather_into_tensor|reduce_scatter|"
                 r"reduce_scatter_tensor|reduce|gather|scatter|all_to_all|all_to_all_single|barrier)\(")


def test_no_raw_tensor_collective_outside_the_helper():
    hits = []
    for sub in ("train", "trainer", "distributed", "weights", "rm"):
        for path in sorted((PKG / sub).rglob("*.py")):
            if path.name == "collectives.py":
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if RAW.search(line):
                    hits.append(f"{path.relative_to(PKG.parent)}:{n}: {line.strip()}")
    assert hits == [], "raw collectives (use megatron_search.distributed.collectives):\n" + "\n".join(hits)


def test_the_pattern_catches_a_raw_call():
    assert RAW.search("    dist.all_reduce(loss, group=g)") and RAW.search("dist.barrier()")
    assert not RAW.search("coll.all_reduce(loss)") and not RAW.search("dist.all_gather_object(out, x)")


def test_helper_reduces_in_place_on_the_groups_device(tmp_path):
    """One process, gloo: the group's device is the host; a reduction of 1 rank is the identity, in place."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "default"), 1), rank=0, world_size=1)
    try:
        assert coll.group_device() == torch.device("cpu")
        t = torch.tensor([1.5, -2.0], dtype=torch.float64)
        out = coll.all_reduce(t, op=dist.ReduceOp.MAX)
        assert out is t and t.tolist() == [1.5, -2.0]
        coll.broadcast(t, src=0)
        coll.barrier()
    finally:
        dist.destroy_process_group()
