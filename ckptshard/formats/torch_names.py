"""Stand-ins for the torch names a torch.save pickle refers to, so the C pickler can write them without torch.

Python's C pickler writes a class as a GLOBAL only if it can import it from
its module; torch's own names would import torch, which takes seconds. It writes
these instead (``ckptshard.formats.torch_names FloatStorage``), and
:func:`.torch_save.lay_out_zip` renames them in the bytes to torch's
(``torch FloatStorage``): a protocol-2 GLOBAL is two text lines, with no
length or offset anywhere that the rename would break.
"""

from __future__ import annotations

from typing import Dict, Tuple

from ..dtypes import STORAGE_CLASSES

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
