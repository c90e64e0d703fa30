"""DLPack export of qkeep params through ctypes: a capsule over a DLManagedTensor (or, for consumers
that ask for DLPack 1.x, a DLManagedTensorVersioned) whose deleter lets go of the model.

Each export allocates its structs (and shape and strides arrays) as ctypes objects kept in a table
keyed by the managed struct's address, with a reference to the Param (and so to its model). The
consumer calls the deleter when its tensor dies; the capsule's destructor calls it when no consumer
took the capsule. Both come back into Python through ctypes callbacks, which take the GIL.
"""

import ctypes
import threading

from . import _lib

c_int32, c_int64, c_uint8, c_uint16, c_uint32, c_uint64, c_void_p = (
    ctypes.c_int32, ctypes.c_int64, ctypes.c_uint8, ctypes.c_uint16, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_void_p)

# DLDeviceType
KDL_CPU, KDL_CUDA, KDL_ROCM = 1, 2, 10
# DLDataTypeCode
KDL_INT, KDL_UINT, KDL_FLOAT, KDL_BFLOAT, KDL_COMPLEX, KDL_BOOL = 0, 1, 2, 4, 5, 6


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", c_int32), ("device_id", c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", c_uint8), ("bits", c_uint8), ("lanes", c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", c_void_p), ("device", DLDevice), ("ndim", c_int32), ("dtype", DLDataType),
                ("shape", ctypes.POINTER(c_int64)), ("strides", ctypes.POINTER(c_int64)), ("byte_offset", c_uint64)]


DELETER = ctypes.CFUNCTYPE(None, c_void_p)


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", c_void_p), ("deleter", DELETER)]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", c_uint32), ("minor", c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("version", DLPackVersion), ("manager_ctx", c_void_p), ("deleter", DELETER), ("flags", c_uint64),
                ("dl_tensor", DLTensor)]


# (DLPack code, bits, numpy typestr) of each qkeep dtype's storage; the FP8 and packed FP4/FP6
# dtypes have no type in numpy (and not in every DLPack consumer): they go as bytes.
_U8 = (KDL_UINT, 8, "|u1")
_TYPES = {
    "F32": (KDL_FLOAT, 32, "<f4"), "F16": (KDL_FLOAT, 16, "<f2"), "BF16": (KDL_BFLOAT, 16, "<u2"),
    "F64": (KDL_FLOAT, 64, "<f8"), "C64": (KDL_COMPLEX, 64, "<c8"), "BOOL": (KDL_BOOL, 8, "|b1"),
    "I8": (KDL_INT, 8, "|i1"), "I16": (KDL_INT, 16, "<i2"), "I32": (KDL_INT, 32, "<i4"), "I64": (KDL_INT, 64, "<i8"),
    "U8": _U8, "U16": (KDL_UINT, 16, "<u2"), "U32": (KDL_UINT, 32, "<u4"), "U64": (KDL_UINT, 64, "<u8"),
}


def _type(dtype):
    return _TYPES.get(_lib.DTYPES[dtype], _U8)


def array_typestr(dtype):
    return _type(dtype)[2]


def storage_shape(view):
    """The shape in storage elements: the logical one, except for the sub-byte dtypes (FP4: the last
    dimension halved; FP6: the bytes, flat)."""
    spec = view.spec
    shape = tuple(int(spec.shape[i]) for i in range(spec.ndim))
    name = _lib.DTYPES[spec.dtype]
    if name == "F4" and shape and shape[-1] % 2 == 0:
        return shape[:-1] + (shape[-1] // 2,)
    if name in ("F4", "F6_E2M3", "F6_E3M2"):
        return (int(view.nbytes),)
    return shape


def device_tuple(kind, index):
    if kind == _lib.DEVICE_HOST:
        return (KDL_CPU, 0)
    if kind == _lib.DEVICE_CUDA:
        return (KDL_CUDA, index)
    if kind == _lib.DEVICE_ROCM:
        return (KDL_ROCM, index)
    raise BufferError("qkeep: a device of an unknown type (its backend predates ABI 1.4) has no DLPack device")


_exports = {}  # address of the managed struct -> (struct, shape, strides, Param)
_lock = threading.Lock()


def _release(address):
    with _lock:
        _exports.pop(address, None)


@DELETER
def _deleter(address):
    _release(address)


_NAME = ctypes.create_string_buffer(b"dltensor")
_NAME_VERSIONED = ctypes.create_string_buffer(b"dltensor_versioned")
_pyapi = ctypes.pythonapi
_pyapi.PyCapsule_New.restype = ctypes.py_object
_pyapi.PyCapsule_New.argtypes = [c_void_p, c_void_p, c_void_p]
_pyapi.PyCapsule_IsValid.restype = ctypes.c_int
_pyapi.PyCapsule_IsValid.argtypes = [c_void_p, c_void_p]
_pyapi.PyCapsule_GetPointer.restype = c_void_p
_pyapi.PyCapsule_GetPointer.argtypes = [c_void_p, c_void_p]
_CAPSULE_DESTRUCTOR = ctypes.CFUNCTYPE(None, c_void_p)


@_CAPSULE_DESTRUCTOR
def _capsule_destructor(capsule):
    # The capsule is being freed: a consumer that took it renamed it ("used_dltensor") and owns the
    # deleter call; one that kept the original name was never consumed, so its export ends here.
    for name in (_NAME, _NAME_VERSIONED):
        if _pyapi.PyCapsule_IsValid(capsule, ctypes.addressof(name)):
            _release(_pyapi.PyCapsule_GetPointer(capsule, ctypes.addressof(name)))


def export(param, view, device, versioned):
    """A capsule over `view` of `param` on `device` ((qkeep device type, index))."""
    code, bits, _ = _type(view.spec.dtype)
    shape = storage_shape(view)
    ndim = len(shape)
    shape_arr = (c_int64 * max(ndim, 1))(*shape)
    strides_arr = (c_int64 * max(ndim, 1))()
    step = 1
    for i in reversed(range(ndim)):
        strides_arr[i] = step
        step *= shape[i]
    managed = DLManagedTensorVersioned() if versioned else DLManagedTensor()
    t = managed.dl_tensor
    t.data = view.data
    t.device = DLDevice(*device_tuple(*device))
    t.ndim = ndim
    t.dtype = DLDataType(code, bits, 1)
    t.shape = ctypes.cast(shape_arr, ctypes.POINTER(c_int64))
    t.strides = ctypes.cast(strides_arr, ctypes.POINTER(c_int64))
    t.byte_offset = 0
    managed.deleter = _deleter
    if versioned:
        managed.version = DLPackVersion(1, 0)
        managed.flags = 0
    address = ctypes.addressof(managed)
    with _lock:
        _exports[address] = (managed, shape_arr, strides_arr, param)
    name = _NAME_VERSIONED if versioned else _NAME
    try:
        return _pyapi.PyCapsule_New(address, ctypes.addressof(name), ctypes.cast(_capsule_destructor, c_void_p))
    except BaseException:
        _release(address)
        raise


def live_exports():
    """How many exports a consumer still holds (for tests)."""
    with _lock:
        return len(_exports)
