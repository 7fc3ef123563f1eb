"""Run a function on every rank of a local gloo process group."""

from __future__ import annotations

import os
import socket
import sys
import time
import warnings
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _quiet_known_warnings() -> None:
    # fairscale 0.4.13 on torch 2.x: deprecations it cannot fix any more.
    warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    warnings.filterwarnings("ignore", category=FutureWarning, message=".*_base. is a private function")


def _worker(
    rank: int, world_size: int, port: int, backend: str, parent: int, fn: Callable[..., Any], args: tuple
) -> None:
    from ..execute.parallel import die_with_parent

    die_with_parent(parent)  # a parent stopped by SIGTERM or kill -9 leaves no rank behind
    _quiet_known_warnings()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        from .cpu_compat import install_cpu_compat

        # A gloo rank computes on the CPU even where GPUs exist: without the layer, fairscale
        # would move its parameters to cuda (its default compute device) under gloo.
        install_cpu_compat(force=backend == "gloo")
        fn(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Done and agreed: leave without the interpreter's teardown, where a gloo thread still joinable
    # now and then ends the process in std::terminate (SIGABRT) after all the work succeeded.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def beat(path: str) -> None:
    """A rank's sign of progress (each training step): :func:`run_world`'s ``heartbeat`` file touched."""
    with open(path, "a"):
        pass
    os.utime(path)


def run_world(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    heartbeat: Optional[str] = None,
    idle_timeout: Optional[float] = None,
) -> None:
    """Spawn ``world_size`` processes, each calling ``fn(rank, world_size, *args)``.

    ``backend``: gloo (CPU; every rank installs the CPU compat layer, also on
    a machine with GPUs) or nccl (one GPU per rank, no compat layer).

    ``heartbeat``, ``idle_timeout``: the ranks :func:`beat` that file as they progress; when no rank has
    for ``idle_timeout`` seconds (start-up counts from the spawn), every rank is killed and TimeoutError
    raised. Whatever ends the wait (an error, SIGTERM turned into SystemExit, Ctrl-C) kills every rank.

    ``fn`` must be importable (module level): the processes are spawned, not
    forked, so a parent that already started torch threads cannot deadlock them.
    """
    context = mp.start_processes(
        _worker,
        args=(world_size, free_port(), backend, os.getpid(), fn, args),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )
    began = time.time()
    try:
        while not context.join(timeout=0.5):
            if idle_timeout is None:
                continue
            last = max(began, os.stat(heartbeat).st_mtime if heartbeat and os.path.exists(heartbeat) else began)
            if time.time() - last > idle_timeout:
                raise TimeoutError(f"no rank made progress for {idle_timeout:g} s")
    finally:
        for p in context.processes:
            if p.is_alive():
                p.kill()
        for p in context.processes:
            p.join()
