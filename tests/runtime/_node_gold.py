"""A trainer rank under torchrun for test_multinode's gold test: the 4-rank gold layout of
test_trainer_parallel on this process group; global rank 0 writes its rows and weights to argv[2].

    torchrun ... tests/runtime/_node_gold.py LAYOUT OUT.pt
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
torch.set_num_threads(1)
from test_trainer_parallel import LAYOUTS, V, _cfg, _train  # noqa: E402

from primerl.runtime.trainer import Trainer  # noqa: E402

layout, out = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
trainer = Trainer(_cfg(world, "fp32", LAYOUTS[layout]), V, rank=rank, world_size=world)
rows, weights = _train(trainer, trainer.dims.batch)
hosts = [None] * world
dist.all_gather_object(hosts, os.environ.get("PRIMERL_TEST_NODE", "?"))
if rank == 0:
    torch.save({"rows": rows, "weights": weights, "hosts": hosts}, out)
# every rank past its last collective before any tears the group down (as trainer_main does): a rank
# whose peers closed their gloo connections mid-teardown aborted at exit (-6) once in CI
dist.barrier()
dist.destroy_process_group()
