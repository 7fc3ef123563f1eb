"""Let fairscale's FSDP run on a machine without CUDA, over gloo.

fairscale's FSDP calls CUDA stream APIs unconditionally in its backward
hooks. Streams only order GPU work; on the CPU everything already runs in
program order, so stand-ins that do nothing are exact. The stand-ins are
installed into fairscale's FSDP module namespace only (its ``torch`` name
becomes a proxy whose ``cuda`` attribute is fake), never into ``torch``
itself, and only in a process that runs FSDP on the CPU: where CUDA is
absent, or in a gloo rank (:func:`..launch.run_world`) on a machine that
has GPUs, whose models and collectives still stay on the CPU.
``Tensor.record_stream`` is the one global touch: it becomes a no-op for
the fake streams and stays the real method for real ones.

One fairscale bug shows only on CPU and is fixed here too:
``gather_full_optim_state_dict`` all-gathers every optimizer tensor into one
reused buffer and keeps ``x.cpu()`` of it, a copy on GPU but the same tensor
on CPU, so every gathered moment ends up equal to the last one gathered
(``exp_avg == exp_avg_sq``). While that method runs, its ``all_gather``
writes into fresh tensors instead.

gloo in torch 2.0 has no ``all_gather_into_tensor`` /
``reduce_scatter_tensor`` (``_all_gather_base``, ``_reduce_scatter_base``),
which fairscale calls whenever torch names them, and before that no
``reduce_scatter`` at all (fairscale 0.3's): where gloo refuses one,
the layer answers it with ``all_gather`` into the output's chunks, or an
``all_reduce`` of which this rank keeps its chunk (the same sums; every rank
adds in one order, so runs stay deterministic).

Also needed on CPU: ``bucket_cap_mb=0`` (gloo's reduce-scatter rejects the
2-D input fairscale's bucketer builds) and
``compute_device=torch.device("cpu")``; :func:`cpu_fsdp_kwargs` gives both.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any, Dict, Iterator, List

import torch

_installed = False


class _FakeStream:
    """A CUDA stream stand-in: every ordering call is a no-op."""

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> None:
        return None

    def synchronize(self) -> None:
        pass


class _FakeCuda(types.SimpleNamespace):
    """The subset of ``torch.cuda`` fairscale's FSDP touches."""

    def __init__(self) -> None:
        super().__init__()
        self._stack: List[_FakeStream] = [_FakeStream()]

    Stream = _FakeStream

    def is_available(self) -> bool:
        return True

    def current_stream(self, device: Any = None) -> _FakeStream:
        return self._stack[-1]

    @contextlib.contextmanager
    def stream(self, s: _FakeStream) -> Iterator[None]:
        # fairscale asserts current_stream() is the stream it entered.
        self._stack.append(s)
        try:
            yield
        finally:
            self._stack.pop()

    def synchronize(self, device: Any = None) -> None:
        pass

    def memory_allocated(self, device: Any = None) -> int:
        return 0

    def max_memory_allocated(self, device: Any = None) -> int:
        return 0


class _TorchProxy(types.ModuleType):
    """``torch`` as fairscale's FSDP module sees it: real, except ``cuda``."""

    def __init__(self, fake_cuda: _FakeCuda) -> None:
        super().__init__("torch")
        self.cuda = fake_cuda

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


class _FreshAllGather(types.ModuleType):
    """``torch.distributed`` whose ``all_gather`` never writes into tensors it was handed."""

    def __init__(self, real: types.ModuleType) -> None:
        super().__init__("torch.distributed")
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def all_gather(self, tensor_list: List[torch.Tensor], tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        tensor_list[:] = [torch.empty_like(t) for t in tensor_list]
        return self._real.all_gather(tensor_list, tensor, *args, **kwargs)


class _GlooCollectives(types.ModuleType):
    """``torch.distributed`` whose flat-tensor collectives fall back to list ones where gloo lacks them."""

    def __init__(self, real: types.ModuleType) -> None:
        super().__init__("torch.distributed")
        self._real = real
        self._unsupported: set = set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def _try(self, name: str, *args: Any, **kwargs: Any) -> bool:
        if name in self._unsupported:
            return False
        try:
            getattr(self._real, name)(*args, **kwargs)
            return True
        except RuntimeError as e:  # raised before anything is sent, so every rank falls back alike
            if "support" not in str(e):
                raise
            self._unsupported.add(name)
            return False

    def _all_gather_base(self, output: torch.Tensor, input: torch.Tensor, group: Any = None) -> None:
        if not self._try("_all_gather_base", output, input, group=group):
            self._real.all_gather(list(output.chunk(self._real.get_world_size(group))), input, group=group)

    def reduce_scatter(self, output: torch.Tensor, input_list: List[torch.Tensor], group: Any = None) -> None:
        if not self._try("reduce_scatter", output, input_list, group=group):  # fairscale before 0.4 calls it
            total = torch.stack(input_list)
            self._real.all_reduce(total, group=group)
            output.copy_(total[self._real.get_rank(group)])

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, group: Any = None) -> None:
        if not self._try("_reduce_scatter_base", output, input, group=group):
            total = input.clone()
            self._real.all_reduce(total, group=group)
            output.copy_(total.chunk(self._real.get_world_size(group))[self._real.get_rank(group)])


def _patch_gather_optim_state(fsdp_mod: types.ModuleType) -> None:
    cls = fsdp_mod.FullyShardedDataParallel
    original = cls._gather_optim_state

    def _gather_optim_state(self: Any, sd_state: Any) -> Any:
        real = fsdp_mod.dist
        fsdp_mod.dist = _FreshAllGather(real)
        try:
            return original(self, sd_state)
        finally:
            fsdp_mod.dist = real

    cls._gather_optim_state = _gather_optim_state


def needs_cpu_compat() -> bool:
    """True where CUDA is absent: the layer is needed whatever the caller runs (gloo ranks also force it)."""
    return not torch.cuda.is_available()


def install_cpu_compat(force: bool = False) -> bool:
    """Install the stand-ins if CUDA is absent, or if ``force`` (a CPU-only process on a GPU machine). Idempotent.

    Returns True if the layer is active after the call.
    """
    global _installed
    if _installed:
        return True
    if not (force or needs_cpu_compat()):
        return False
    try:
        from fairscale.nn.data_parallel import fully_sharded_data_parallel as fsdp_mod
    except ImportError:  # fairscale is an optional extra: torch FSDP runs need no layer
        return False
    try:
        from fairscale.internal import reduce_scatter_bucketer
    except ImportError:  # fairscale before 0.4
        from fairscale.utils import reduce_scatter_bucketer  # type: ignore[no-redef]

    fake = _FakeCuda()
    fsdp_mod.torch = _TorchProxy(fake)  # type: ignore[attr-defined]
    collectives = _GlooCollectives(torch.distributed)
    fsdp_mod.dist = collectives  # type: ignore[attr-defined]
    reduce_scatter_bucketer.dist = collectives  # type: ignore[attr-defined]
    real_record_stream = torch.Tensor.record_stream

    def record_stream(self: torch.Tensor, stream: Any) -> None:
        if isinstance(stream, _FakeStream):
            return None
        return real_record_stream(self, stream)

    torch.Tensor.record_stream = record_stream  # type: ignore[method-assign]
    _patch_gather_optim_state(fsdp_mod)
    _installed = True
    return True


def is_installed() -> bool:
    return _installed


def cpu_fsdp_kwargs() -> Dict[str, Any]:
    """FSDP keyword arguments every wrap needs on CPU (empty where FSDP may use the GPU)."""
    if not (_installed or needs_cpu_compat()):
        return {}
    return {"compute_device": torch.device("cpu"), "bucket_cap_mb": 0}
