"""A tensor-parallel step as torchrun-style code: the README's launcher lines run it."""

import os

import torch
import torch.distributed as dist

import harmpi.distributed  # noqa: F401  (registers the "harmpi" backend)

dist.init_process_group("harmpi")
rank, world = dist.get_rank(), dist.get_world_size()
partial = torch.full((5120,), float(rank + 1), dtype=torch.bfloat16)  # this rank's partial sum
dist.all_reduce(partial)
expected = world * (world + 1) / 2
ok = bool((partial == expected).all())
print(f"my_tp_script: rank {rank}/{world} (RANK={os.environ['RANK']} "
      f"LOCAL_RANK={os.environ['LOCAL_RANK']}): all_reduce sum {partial[0].item():g}, "
      f"expected {expected:g}: {'ok' if ok else 'WRONG'}", flush=True)
dist.destroy_process_group()
raise SystemExit(0 if ok else 1)
