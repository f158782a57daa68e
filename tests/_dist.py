"""Shared helpers of the data-parallel tests: a free local port, and a function run in a gloo process group under mp.spawn."""
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    "A TCP port on 127.0.0.1 that nothing listens on now."
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); return s.getsockname()[1]


def _in_group(rank, world, port, fn, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def spawn_gloo(fn, world: int, *args):
    "Run fn(rank, world, *args) in `world` processes joined in one gloo group (fn: a module-level function, so it pickles)."
    mp.spawn(_in_group, args=(world, free_port(), fn, args), nprocs=world, join=True)


def _save_rank0(rank, world, run, folder, out):
    state = run(folder)
    if rank == 0: torch.save(state, out)


def one_and_two_processes(run, tmp_path):
    "The state dict `run(folder)` returns in one process, and rank 0's when it runs in 2 gloo processes (run: module-level)."
    single = run(tmp_path / "single")
    spawn_gloo(_save_rank0, 2, run, str(tmp_path / "ddp"), str(tmp_path / "ddp.pt"))
    return single, torch.load(tmp_path / "ddp.pt")
