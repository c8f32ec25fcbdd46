"""The shape and dtype of one tensor written by ``torch.save``, read without torch (the gateway has none).

``torch.save`` writes a zip archive: ``<root>/data.pkl`` (a pickle that calls
``torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)``) and the raw storages beside it. The
pickle is read with an unpickler that resolves only the handful of globals such a file names and refuses
everything else, so a hostile sidecar answer cannot run code here: it can only be refused.
"""

from __future__ import annotations

import io
import pickle
import zipfile
from dataclasses import dataclass
from typing import Any

#: ``torch.<Name>Storage`` -> the dtype name the tensor has.
_STORAGE_DTYPES = {
    "FloatStorage": "float32",
    "DoubleStorage": "float64",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
}


class NotATensor(ValueError):
    """The bytes are not one tensor as ``torch.save`` writes it; the message says what is wrong."""


@dataclass(frozen=True, slots=True)
class TensorHeader:
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True, slots=True)
class _Storage:
    dtype: str


def _rebuild_tensor(storage: Any, _offset: Any, size: Any, *_rest: Any) -> TensorHeader:
    if not isinstance(storage, _Storage):
        raise NotATensor("the tensor's storage is not a storage reference")
    if not isinstance(size, tuple) or not all(isinstance(n, int) and n >= 0 for n in size):
        raise NotATensor(f"the tensor's size is not a tuple of sizes: {size!r}")
    return TensorHeader(size, storage.dtype)


class _HeaderUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        if module == "torch" and name in _STORAGE_DTYPES:
            return name  # resolved to a dtype by persistent_load
        raise NotATensor(f"unexpected object in the tensor file: {module}.{name}")

    def persistent_load(self, pid: Any) -> _Storage:
        if not (isinstance(pid, tuple) and len(pid) >= 2 and pid[0] == "storage"):
            raise NotATensor(f"unexpected persistent id in the tensor file: {pid!r}"[:200])
        return _Storage(_STORAGE_DTYPES.get(str(pid[1]), str(pid[1])))


def read_header(data: bytes) -> TensorHeader:
    """Shape and dtype of the single tensor ``data`` holds, or ``NotATensor``."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        names = [n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
        if len(names) != 1:
            raise NotATensor("not a torch.save archive (no single data.pkl)")
        obj = _HeaderUnpickler(io.BytesIO(archive.read(names[0]))).load()
    except NotATensor:
        raise
    except (zipfile.BadZipFile, pickle.UnpicklingError, EOFError, KeyError, ValueError, TypeError) as exc:
        raise NotATensor(f"not a torch.save archive ({type(exc).__name__}: {exc})"[:300]) from exc
    if not isinstance(obj, TensorHeader):
        raise NotATensor(f"the archive holds a {type(obj).__name__}, not a tensor")
    return obj
