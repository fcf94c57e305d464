"""Hand-made DLPack capsules for the extension-boundary tests: a tensor on any device (a CUDA tensor without a GPU),
of any dtype and strides, legacy ("dltensor") or versioned ("dltensor_versioned", with flags and a major version),
whose deleter counts its calls. The data pointer is null unless given: every test that uses one expects the extension
to refuse an argument before it reads memory (and a null pointer is refused by the backends' own checks anyway).
Built with ctypes on the layout of csrc/third_party/dlpack/dlpack.h (v1.3). Not a producer for real data.
Also `inner_strided`: a real tensor in a layout the extension refuses (last dimension not contiguous)."""

from __future__ import annotations

import ctypes

import torch

KDL_CPU, KDL_CUDA = 1, 2
DTYPES = {
    torch.float32: (2, 32),
    torch.float16: (2, 16),
    torch.bfloat16: (4, 16),
    torch.float64: (2, 64),
    torch.int64: (0, 64),
    torch.int32: (0, 32),
}


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", DELETER)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [
        ("major", ctypes.c_uint32),
        ("minor", ctypes.c_uint32),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", DELETER),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", DLTensor),
    ]


_new_capsule = ctypes.pythonapi.PyCapsule_New
_new_capsule.restype = ctypes.py_object
_new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


# Every FakeTensor made, kept for the whole session: a capsule points into its structs (and may call its deleter) after
# the FakeTensor itself is no longer referenced by the test.
_ALIVE: list[FakeTensor] = []


class FakeTensor:
    """Owns the structs one capsule points at; `capsule()` makes the capsule, `deleted` counts deleter calls."""

    def __init__(self, shape, dtype=torch.float32, device=(KDL_CUDA, 0), strides=None, data=0, **versioned):
        self.shape = (ctypes.c_int64 * len(shape))(*shape)
        if strides is None:
            strides, acc = [], 1
            for n in reversed(shape):
                strides.insert(0, acc)
                acc *= n
        self.strides = (ctypes.c_int64 * len(shape))(*strides)
        code, bits = DTYPES[dtype]
        self.tensor = DLTensor(data, DLDevice(*device), len(shape), DLDataType(code, bits, 1), self.shape, self.strides)
        _ALIVE.append(self)
        self.deleted = 0
        self.deleter = DELETER(self._count)
        self.versioned = versioned
        if versioned:
            major, flags = versioned.get("major", 1), versioned.get("flags", 0)
            self.managed = DLManagedTensorVersioned(major, 0, None, self.deleter, flags, self.tensor)
        else:
            self.managed = DLManagedTensor(self.tensor, None, self.deleter)

    def _count(self, _ptr) -> None:
        self.deleted += 1

    def capsule(self):
        name = b"dltensor_versioned" if self.versioned else b"dltensor"
        return _new_capsule(ctypes.addressof(self.managed), name, None)


def on_cuda(t: torch.Tensor, device: int = 0) -> FakeTensor:
    """A capsule description of `t`'s shape, strides and dtype on cuda:device, with a null data pointer."""
    return FakeTensor(tuple(t.shape), t.dtype, (KDL_CUDA, device), tuple(t.stride()))


def inner_strided(t: torch.Tensor) -> torch.Tensor:
    """t's values in a layout the kernels cannot read: every other element of a buffer twice as long in the last
    dimension (stride 2 there)."""
    return torch.stack([t, t], -1).reshape(*t.shape[:-1], -1)[..., ::2]
