"""torch's names and objects as a torch.save pickle writes them, without torch.

:class:`Global`, :class:`NewObj`, :class:`Call` and :class:`Literal` are
what the Python pickler of ``torch_save`` writes as torch's classes, calls
and small tensors. The stand-ins below serve the C pickler:

Python's C pickler writes a class as a GLOBAL only if it can import it from
its module; torch's own names would import torch, which takes seconds. It writes
these instead (``ckptshard.formats.torch_names FloatStorage``), and
:func:`.torch_save.lay_out_zip` renames them in the bytes to torch's
(``torch FloatStorage``): a protocol-2 GLOBAL is two text lines, with no
length or offset anywhere that the rename would break.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Dict, Tuple

from ..dtypes import STORAGE_CLASSES


class Global:
    """A name written as a pickle GLOBAL, never imported (torch's functions and classes)."""

    _made: ClassVar[Dict[Tuple[str, str], Global]] = {}

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    def __call__(self, *args: Any) -> Any:  # the pickler wants reduce functions callable; never called
        raise AssertionError(f"{self.module}.{self.name} is a name to write, not to call")

    @classmethod
    def of(cls, module: str, name: str) -> Global:
        return cls._made.setdefault((module, name), cls(module, name))


REBUILD_FROM_TYPE = Global.of("torch._tensor", "_rebuild_from_type_v2")  # a tensor subclass: DTensor, ShardedTensor
REBUILD_WRAPPER = Global.of("torch._utils", "_rebuild_wrapper_subclass")


def rebuild_wrapper(shell: tuple, dtype: Global, shape: Tuple[int, ...], stride: Tuple[int, ...], state: Any) -> Call:
    """A tensor subclass's pickle (DTensor, ShardedTensor) from its template's ``_rebuild_wrapper_subclass``
    arguments ``shell`` (class, dtype, size, stride, rest): class and rest kept, the others given, then its
    state."""
    args = (shell[0], dtype, shape, stride, *shell[4:])
    return Call(REBUILD_FROM_TYPE, (REBUILD_WRAPPER, shell[0], args, state))


class NewObj:
    """An instance of a torch class, pickled as protocol 2 pickles a plain object: NEWOBJ ``cls(*args)``
    (``cls.__new__`` only), then BUILD ``state`` unless it is :data:`NO_STATE`."""

    def __init__(self, cls: Global | Call, args: tuple = (), state: Any = None) -> None:
        self.cls, self.args, self.state = cls, args, state


class Call:
    """A value pickled as REDUCE ``func(*args)``, then BUILD ``state`` unless it is :data:`NO_STATE`."""

    def __init__(self, func: Global, args: tuple, state: Any = None) -> None:
        self.func, self.args, self.state = func, args, state


NO_STATE = None  # NewObj/Call state that writes no BUILD: torch never BUILDs None


@dataclass(frozen=True, eq=False)
class Literal:
    """A small tensor whose bytes are known when the file is laid out (a device mesh's rank map): written
    in place, not left as a hole."""

    shape: Tuple[int, ...]
    dtype: Any  # StoredDType
    data: bytes

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return len(self.data)


TORCH_NAME: Dict[str, Tuple[str, str]] = {}  # stand-in name -> (torch's module, torch's name)


def _stand_in(module: str, name: str) -> type:
    cls = type(name, (), {"__module__": __name__, "__qualname__": name})
    globals()[name] = cls
    TORCH_NAME[name] = (module, name)
    return cls


REBUILD_TENSOR = _stand_in("torch._utils", "_rebuild_tensor_v2")
SIZE = _stand_in("torch", "Size")
STORAGE = {name: _stand_in("torch", name) for name in STORAGE_CLASSES}  # by storage class name


def marker(name: str) -> bytes:
    """The GLOBAL opcode the C pickler writes for stand-in ``name`` (protocol 2)."""
    return b"c" + f"{__name__}\n{name}\n".encode()


def torch_global(name: str) -> bytes:
    """The GLOBAL opcode torch.save writes for the torch name behind stand-in ``name``."""
    module, real = TORCH_NAME[name]
    return b"c" + f"{module}\n{real}\n".encode()


@dataclass(frozen=True, eq=False)
class RequiresGrad:
    """A tensor pickled as one that requires grad (a LOCAL_STATE_DICT flat parameter's local shard)."""

    fill: Any  # a Fill
