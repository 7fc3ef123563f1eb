"""Write planned files in parallel: local processes (``--jobs``) or torchrun ranks.

A plan is data, so it splits by output file: each worker gets whole files
(tree, path) and writes them with the same code as the single-process path,
so the bytes are identical. Under torchrun every rank plans (cheap: pickles
only), writes files ``i`` with ``i % world_size == rank`` into the folder rank
0 created, and rank 0 alone writes the manifest and renames the folder. On
several hosts the output must be on a filesystem they share.
"""

from __future__ import annotations

import contextvars
import os
import sys
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, TypeVar

from ..dtypes import Size
from ..errors import CheckpointError
from ..osio.durability import durable, set_fsync
from ..osio.hashing import Hashes
from ..osio.libc import bind
from ..tensors import Progress, tree_nbytes, tree_pieces
from ..write.copier import Copier
from ..write.safetensors_file import write_safetensors
from ..write.torch_file import write_torch

T = TypeVar("T")


def _size_as_itself(size: Size) -> Any:
    return Size, (tuple(size),)


Job = Tuple[Any, ...]  # (tree, output path[, mesh place]), or a PlannedFile


class PlannedFiles:
    """The trees of many output files, each planned when it is written: a reshard to 100,000 ranks
    holds one rank's plan at a time, not all of them. File 0 is planned at once (its planning runs
    every check of the input); the others have its size and copy runs, as every FSDP rank's file does.
    ``plan(i)`` may give a dict of trees (torch FSDP's model and optimizer files of rank i): each is a
    file of its own, named by its key (:meth:`rank_jobs`)."""

    def __init__(self, plan: Callable[[int], Any], count: int) -> None:
        self._plan, self.count = plan, count
        self._recent: Dict[int, Any] = {}  # a rank's dict of trees, planned once for its several files
        self.first = plan(0)
        self.nbytes, self.pieces = tree_nbytes(self.first), tree_pieces(self.first)

    def tree(self, i: int) -> Any:
        if i == 0:
            return self.first
        tree = self._recent.get(i)
        if tree is None:  # writer threads may plan one rank twice at worst
            tree = self._plan(i)
            if len(self._recent) > 8:
                self._recent.clear()
            self._recent[i] = tree
        return tree

    def jobs(self, paths: Sequence[str]) -> List[PlannedFile]:
        return [PlannedFile(self, i, p) for i, p in enumerate(paths)]

    def rank_jobs(self, path: Callable[[str, int], str], place: Callable[[int], Any]) -> List[PlannedFile]:
        """One job per (rank, key) of dicts of trees, in rank order; ``path(key, rank)``, ``place(rank)``: the
        file's path and its DTensors' mesh place (``write_torch``'s)."""
        return [PlannedFile(self, i, path(k, i), k, place(i)) for i in range(self.count) for k in self.first]


class PlannedFile:
    """A job (tree, path) whose tree is planned when it is unpacked, or pickled for a worker process;
    ``key``: the file is that entry of the planned dict; ``place``: its DTensors' mesh place, a third item."""

    def __init__(self, files: PlannedFiles, index: int, path: str, key: Optional[str] = None, place: Any = None):
        self.files, self.index, self.path, self.key, self.place = files, index, path, key, place

    def _tree(self) -> Any:
        tree = self.files.tree(self.index)
        return tree if self.key is None else tree[self.key]

    def __getitem__(self, i: int) -> Any:  # a (tree, path) pair: job[1] plans nothing
        return self.path if i == 1 else tuple(self)[i]

    def __len__(self) -> int:
        return 2 if self.key is None else 3

    def __iter__(self) -> Any:
        return iter((self._tree(), self.path) if self.key is None else (self._tree(), self.path, self.place))

    def __reduce__(self) -> Any:
        return tuple, (tuple(self),)

    @property
    def nbytes(self) -> int:
        return self.files.nbytes if self.key is None else tree_nbytes(self.files.first[self.key])

    @property
    def pieces(self) -> int:
        return self.files.pieces if self.key is None else tree_pieces(self.files.first[self.key])


def job_nbytes(job: Any) -> int:
    return job.nbytes if isinstance(job, PlannedFile) else tree_nbytes(job[0])


def job_pieces(job: Any) -> int:
    return job.pieces if isinstance(job, PlannedFile) else tree_pieces(job[0])


Digests = Dict[str, str]  # file name -> digest, from the process that wrote the file


def _write_one(job: Job, trust_pickles: bool, tick: Optional[Progress] = None) -> Tuple[str, str]:
    tree, path, *place = job  # (tree, path[, mesh place]): torch FSDP files name their DTensors' place
    with Copier() as copier, Hashes() as hashes:
        write_torch(path, tree, copier, tick, trust_pickles, hashes, place[0] if place else None)
        return path, hashes.digest(path)  # also waits for the hash pass's CRCs: the file is final


def _write_one_safetensors(
    job: Job, metadata: Optional[Dict[str, str]], tick: Optional[Progress] = None
) -> Tuple[str, str]:
    tensors, path = job
    with Copier() as copier, Hashes() as hashes:
        write_safetensors(path, tensors, copier, tick, metadata, hashes)
        return path, hashes.digest(path)


PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> None:
    """In a worker process: be killed when ``parent`` dies, even by ``kill -9`` (Linux's PR_SET_PDEATHSIG).

    Without it the workers of a killed run write on for minutes, holding
    the caller's stdout open (a caller capturing it waits that long).
    """
    import signal

    prctl = bind("prctl", ("c_int", "c_ulong", "c_ulong", "c_ulong", "c_ulong"))
    if prctl is not None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # it died before the request took effect
        os._exit(1)


def by_name(written: Sequence[Tuple[str, str]]) -> Digests:
    return {os.path.basename(path): digest for path, digest in written}


def merged(shares: Sequence[Digests]) -> Digests:
    """Every rank's (or worker batch's) digests, in one mapping."""
    return {name: digest for share in shares for name, digest in share.items()}


def map_in_processes(
    fn: Callable[..., T], jobs: Sequence[Any], n: int, done: Optional[Callable[[Any], None]] = None, *args: Any
) -> List[T]:
    """``fn(job, *args)`` for every job, ``n`` processes at a time (spawned: safe beside torch's
    threads); results in job order, ``done(job)`` after each (progress)."""
    # Imported here, not at start-up: every command imports this module, few start processes.
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing.reduction import ForkingPickler

    # Size pickles as torch.Size elsewhere (so torch.save writes one); on the way to a worker it stays
    # itself, or unpickling the job would import torch (1-2 s and ~200 MiB per worker).
    ForkingPickler.register(Size, _size_as_itself)
    pool = ProcessPoolExecutor(
        max_workers=n,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_worker_start,
        initargs=(os.getpid(), durable()),
    )
    try:
        futures = [pool.submit(fn, job, *args) for job in jobs]
        out = []
        for f, job in zip(futures, jobs):
            out.append(f.result())
            if done:
                done(job)
    except BaseException:
        # Ctrl-C, SIGTERM or a failed job: the workers are killed, not left to find their queue closed
        # (each would print an EOFError traceback) nor waited for.
        for proc in list((getattr(pool, "_processes", None) or {}).values()):
            proc.kill()
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
    return out


def _worker_start(parent: int, fsync: bool) -> None:
    """A worker process: dies with its parent, leaves Ctrl-C (sent to the whole terminal's process group) to
    the parent, which stops it, and makes its outputs durable as the parent's command does."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(parent)
    set_fsync(fsync)


def writer_threads(files: int) -> int:
    """Threads that write an output of ``files`` files at once: one per file, at most 4; one on a single core.

    The kernel copies (``copy_file_range``) and hashes (XXH3) without the
    GIL, but two threads writing one file queue on its inode lock, so the
    parallelism is across files; each thread has its own hash pass. A
    thread per file rather than per core keeps every core busy to the end:
    3 files on 2 cores, two threads copy the third file while a core idles.
    """
    return 1 if _cores() == 1 else max(1, min(files, 4))


AUTO = 0  # --jobs 0, the CLI's default: processes or threads, chosen from the plan (auto_processes)
SMALL_PIECE = 4 << 20  # bytes: runs this small on average make one process's threads contend
MIN_SPAWN_BYTES = 1 << 30  # below this, starting workers costs more than contention...
MANY_PIECES = 5_000  # ...unless the runs are this many: each costs Python time in one process


def auto_processes(files: int, pieces: int, nbytes: int, cores: int) -> int:
    """Local processes that write an output of ``files`` files, copied in ``pieces`` runs of ``nbytes`` in all,
    when the user chose none; 1 means threads of this process (:func:`writer_threads`).

    One process's threads (a writer and a hash thread per file) share its
    GIL and hand work to each other per run, so many small runs contend;
    processes do not (measured in docs/performance.md, "Parallel writing").
    Starting the workers gains little or loses with runs over a few MiB or
    with fewer files than two per process, so each process gets two files
    at least.
    """
    if cores < 2 or files < 4 or nbytes > SMALL_PIECE * pieces:
        return 1
    if nbytes < MIN_SPAWN_BYTES and pieces < MANY_PIECES:
        return 1
    return min(cores, files // 2)


def _cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def map_in_threads(fn: Callable[..., T], jobs: Sequence[Any], n: int, tick: Optional[Progress], *args: Any) -> List[T]:
    """``fn(job, *args, tick)`` for every job, ``n`` threads at a time; results in job order.

    ``tick`` (progress) is called from every thread, under one lock. On the
    first failure the jobs not yet started are cancelled, and it is raised
    once the running ones have ended (a kernel copy cannot be interrupted).
    """
    from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

    lock = threading.Lock()

    def locked(nbytes: int) -> None:
        with lock:
            tick(nbytes)  # type: ignore[misc]

    with ThreadPoolExecutor(max_workers=n, thread_name_prefix="ckptshard writer") as pool:
        # Each in a copy of this context: the command's input watch and fsync choice (contextvars).
        futures = [
            pool.submit(contextvars.copy_context().run, fn, job, *args, locked if tick else None) for job in jobs
        ]
        try:
            wait(futures, return_when=FIRST_EXCEPTION)
        finally:  # a failure, or Ctrl-C in this thread: start nothing more
            for f in futures:
                f.cancel()
        return [f.result() for f in futures]


def map_jobs(
    fn: Callable[..., T],
    jobs: Sequence[Any],
    processes: int,
    tick: Optional[Progress],
    nbytes: Callable[[Any], int],
    *args: Any,
    pieces: Optional[Callable[[Any], int]] = None,
) -> List[T]:
    """``fn(job, *args)`` for every job: in ``processes`` local processes where more than 1 (``--jobs``),
    else in :func:`writer_threads` threads of this one; results in job order. ``processes`` :data:`AUTO`:
    as :func:`auto_processes` says from ``pieces(job)`` (copy runs) and ``nbytes(job)``; threads without
    ``pieces`` or under torchrun (the ranks share the host).

    Progress: threads tick as they copy; a process's job ticks its ``nbytes(job)`` when it is done.
    """
    if processes == AUTO:
        processes = 1
        if pieces is not None and torchrun_world() is None:
            processes = auto_processes(len(jobs), sum(map(pieces, jobs)), sum(map(nbytes, jobs)), _cores())
    if processes > 1:
        return map_in_processes(fn, jobs, processes, (lambda job: tick(nbytes(job))) if tick else None, *args)
    return map_in_threads(fn, jobs, writer_threads(len(jobs)), tick, *args)


def write_torch_files(
    jobs: Sequence[Job], processes: int, trust_pickles: bool, tick: Optional[Progress] = None
) -> Digests:
    """Write every (tree, path) job as torch.save (see :func:`map_jobs`); each file's digest, by name,
    computed by the process or thread that wrote it."""
    return by_name(map_jobs(_write_one, jobs, processes, tick, job_nbytes, trust_pickles, pieces=job_pieces))


def write_safetensors_files(
    jobs: Sequence[Job], processes: int, metadata: Optional[Dict[str, str]], tick: Optional[Progress] = None
) -> Digests:
    """Write every ({name: Fill}, path) job as a safetensors file (see :func:`map_jobs`); digests by name."""
    return by_name(
        map_jobs(
            _write_one_safetensors,
            jobs,
            processes,
            tick,
            lambda job: sum(f.nbytes for f in job[0].values()),
            metadata,
            pieces=lambda job: tree_pieces(job[0]),
        )
    )


def torchrun_world() -> Optional[Tuple[int, int]]:
    """(rank, world size) when launched by torchrun with more than one rank, else None.

    torchrun is known by its own variable (``TORCHELASTIC_RUN_ID``), not by
    ``RANK``/``WORLD_SIZE`` alone: job scripts (SLURM's among them) export
    those for the training they launch, and a conversion run from such a
    shell is one process.
    """
    env = os.environ
    if "TORCHELASTIC_RUN_ID" not in env or "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    try:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    except ValueError:
        raise CheckpointError(
            f"torchrun set RANK={env['RANK']!r} WORLD_SIZE={env['WORLD_SIZE']!r}: not numbers"
        ) from None
    return (rank, world) if world > 1 else None


TIMEOUT_ENV = "CKPTSHARD_DIST_TIMEOUT"  # seconds a torchrun rank waits for the others, at start and at each step


def dist_timeout() -> float:
    try:
        return float(os.environ.get(TIMEOUT_ENV, "900"))
    except ValueError:
        raise CheckpointError(f"{TIMEOUT_ENV}={os.environ[TIMEOUT_ENV]!r}: not a number of seconds") from None


def leads() -> bool:
    """True in a single process and on torchrun's rank 0: the one that reports and writes single files."""
    world = torchrun_world()
    return world is None or world[0] == 0


def init_torchrun() -> None:
    """Join torchrun's process group, waiting at most :func:`dist_timeout` seconds for the other ranks.

    The wait runs in a helper thread so that this one stays interruptible
    (Ctrl-C, SIGTERM): gloo's own wait does not return to Python until it ends.
    """
    import datetime

    import torch.distributed as dist

    if dist.is_initialized():
        return
    timeout = dist_timeout()
    failure: List[BaseException] = []

    def join() -> None:
        try:
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
        except BaseException as e:  # reported by the waiting thread
            failure.append(e)

    helper = threading.Thread(target=join, name="ckptshard torchrun join", daemon=True)
    helper.start()
    while helper.is_alive():
        helper.join(0.2)
    if failure:
        rank, world = torchrun_world() or (0, 1)
        raise CheckpointError(
            f"torchrun rank {rank}: the other ranks of {world} did not join within {timeout:g} s "
            f"({type(failure[0]).__name__}; {TIMEOUT_ENV} sets the wait)"
        )


def leave_torchrun() -> None:
    """After a command succeeded on a torchrun rank: leave the process group and exit 0 at once.

    The interpreter's own teardown now and then ends in std::terminate
    ('terminate called without an active exception', SIGABRT) while a gloo
    thread is still joinable; torchrun would then report a failed run whose
    output is complete and in place. Nothing to do outside torchrun.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_initialized():
        return
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def agree(error: Optional[str], payload: Any = None) -> List[Any]:
    """Every rank's payload, after every rank says how it went.

    If any rank reports an error, every rank raises it: no rank is left
    waiting in a collective for one that gave up.
    """
    import torch.distributed as dist

    init_torchrun()
    got: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(got, (error, payload))
    errors = [e for e, _ in got if e]
    if errors:
        raise CheckpointError(errors[0])
    return [p for _, p in got]


def write_folder_across_ranks(
    dst: str,
    overwrite: bool,
    nbytes: int,
    rank: int,
    world: int,
    write_share: Callable[[str], Any],
    finish: Callable[[str, List[Any]], T],
) -> T:
    """The torchrun protocol for one output folder, shared by every command that writes one.

    Rank 0 checks the space and makes the temporary folder; every rank learns
    its name (or rank 0's error) and calls ``write_share(folder)``; every rank
    reports how that went, and if any failed all raise and rank 0 removes the
    folder; otherwise rank 0 calls ``finish(folder, every rank's result)``
    (index, metadata, manifest) and renames the folder into place before any
    rank returns. Returns ``finish``'s result on rank 0, None elsewhere.
    """
    import contextlib

    import torch.distributed as dist

    from ..osio.atomic import atomic_output, check_space

    init_torchrun()
    ctx = atomic_output(dst, is_dir=True, overwrite=overwrite) if rank == 0 else contextlib.nullcontext()
    out = None
    with ctx as tmp:
        error = None
        if rank == 0:
            try:
                check_space(dst, nbytes)
            except CheckpointError as e:
                error = str(e)
        folder = agree(error, tmp)[0]
        failure: Optional[Exception] = None
        result = None
        try:
            result = write_share(folder)
        except Exception as e:
            failure = e
        try:  # every rank's share is complete, or rank 0 removes the folder
            results = agree(None if failure is None else f"rank {rank}: {failure}", result)
        except CheckpointError:
            if failure is not None:
                raise failure from None  # the failing rank keeps its own error
            raise
        if rank == 0:
            out = finish(folder, results)
    dist.barrier()  # the folder is in place before any rank reports success
    return out  # type: ignore[return-value]


def run_checked(check: Callable[[], T]) -> T:
    """Run an input/output check; under torchrun all ranks fail together if one does."""
    if torchrun_world() is None:
        return check()
    try:
        out = check()
    except CheckpointError as e:
        agree(str(e))
        raise
    agree(None)
    return out
