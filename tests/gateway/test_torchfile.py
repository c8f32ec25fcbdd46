"""The torch-free reader of ``torch.save`` headers: real files' shapes, and refusal of anything else."""

from __future__ import annotations

import base64
import io
import pickle
import zipfile

import pytest
from vision_fakes import EMBEDS_6X8, GRID_1X3, GRID_3

from gateway.torchfile import NotATensor, TensorHeader, read_header


@pytest.mark.parametrize(
    ("b64", "header"),
    [
        (GRID_3, TensorHeader((3,), "int64")),
        (GRID_1X3, TensorHeader((1, 3), "int64")),
        (EMBEDS_6X8, TensorHeader((6, 8), "bfloat16")),
    ],
)
def test_shapes_and_dtypes_of_real_torch_save_files(b64: str, header: TensorHeader) -> None:
    assert read_header(base64.b64decode(b64)) == header


class _Boom:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        import os

        return (os.system, ("echo pwned",))


def _archive(payload: bytes) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("archive/data.pkl", payload)
    return buf.getvalue()


def test_a_pickle_naming_any_other_global_is_refused_without_running_it() -> None:
    with pytest.raises(NotATensor, match=r"unexpected object in the tensor file: (posix|os)\.system"):
        read_header(_archive(pickle.dumps(_Boom(), protocol=2)))


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"not a zip", "not a torch.save archive (BadZipFile"),
        (_archive(pickle.dumps([1, 2], protocol=2)), "the archive holds a list, not a tensor"),
        (_archive(b"\x80\x02garbage"), "not a torch.save archive"),
    ],
)
def test_what_is_not_one_tensor_is_refused_with_a_reason(data: bytes, message: str) -> None:
    with pytest.raises(NotATensor, match=message.replace("(", r"\(")):
        read_header(data)
