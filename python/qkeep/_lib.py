"""The C library through ctypes: finding libqkeep, its structs and prototypes, and Error.

libqkeep is looked up, in this order: $QKEEP_LIBRARY (a path); a libqkeep.so.0 next to this
package; the build tree this package lies in (python/qkeep/ beside libqkeep/.libs/); the
library directory `make install` recorded in _install.py; then the dynamic loader's own
search (LD_LIBRARY_PATH, ld.so.cache). Symbols that a library may lack (the engine forward of
ABI 1.4) are looked up when first used, so that importing qkeep never depends on them.
"""

import ctypes
import os

c_int, c_int32, c_int64, c_uint32, c_uint64 = ctypes.c_int, ctypes.c_int32, ctypes.c_int64, ctypes.c_uint32, ctypes.c_uint64
c_size_t, c_bool, c_double, c_char_p, c_void_p = ctypes.c_size_t, ctypes.c_bool, ctypes.c_double, ctypes.c_char_p, ctypes.c_void_p
POINTER = ctypes.POINTER

SONAME = "libqkeep.so.0"

# enum qkeep_error (qkeep_types.h)
E_INVAL, E_NOMEM, E_IO, E_FORMAT, E_NOTFOUND, E_EXISTS, E_ABI = -1, -2, -3, -4, -5, -6, -7
E_PLUGIN, E_NODEV, E_UNSUPPORTED, E_DEVICE, E_RULE, E_CONFIG, E_STATE = -8, -9, -10, -11, -12, -13, -14

# enum qkeep_dtype: the safetensors names, by value
DTYPES = ("F32", "F16", "BF16", "F8_E4M3", "F8_E8M0", "U8", "I8", "I32", "I64", "BOOL", "F4", "F6_E2M3",
          "F6_E3M2", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "I16", "U16", "U32", "U64", "F64", "C64")
DTYPE = {name: value for value, name in enumerate(DTYPES)}

KINDS = ("linear", "embedding", "moe", "kv_scales", "other")  # enum qkeep_layer_kind (its C names come from the library)
PARAM_STATES = ("live", "retired", "released", "quantized on load")
PARAM_QUANTIZED = 3
DEVICE_HOST, DEVICE_CUDA, DEVICE_ROCM, DEVICE_OTHER = 0, 1, 2, 3
MOE_W13, MOE_W2 = 0, 1
MAX_DIMS = 6
RELOAD_PARTIAL = 1


class Error(Exception):
    """A qkeep failure: `code` is the negative QKEEP_E_* number, `name` its text ("invalid argument"),
    `message` the detail (which file, tensor, key, layer or plugin)."""

    def __init__(self, code, message, name=None):
        self.code = int(code)
        self.message = message
        self.name = name if name is not None else strerror(code)
        super().__init__("%s: %s" % (self.name, message) if message else self.name)


class _NoInterface(Error, AttributeError):
    """A param that has no such interface (host memory has no __cuda_array_interface__, device memory
    no __array_interface__): an AttributeError too, so that hasattr() answers False."""


class Spec(ctypes.Structure):
    _fields_ = [("dtype", c_int), ("ndim", c_int), ("shape", c_int64 * MAX_DIMS)]


class View(ctypes.Structure):
    _fields_ = [("size", c_size_t), ("data", c_void_p), ("nbytes", c_size_t), ("capacity", c_size_t),
                ("spec", Spec), ("state", c_int)]


class LayerInfo(ctypes.Structure):
    _fields_ = [("size", c_size_t), ("name", c_char_p), ("scheme", c_char_p), ("kind", c_int), ("n", c_int64),
                ("k", c_int64), ("experts", c_int64), ("group_size", c_int64), ("shards", c_int),
                ("shard_n", c_int64 * 8), ("flags", c_uint32), ("weight_dtype", c_int32)]


class ChainInfo(ctypes.Structure):
    _fields_ = [("size", c_size_t), ("name", c_char_p), ("usable", c_bool), ("probe_message", c_char_p),
                ("layers", c_size_t)]


class Census(ctypes.Structure):
    _fields_ = [("size", c_size_t)] + [(f, c_int64) for f in (
        "loader_params", "registered_same", "missing", "c1", "c2", "aliases", "retired", "retired_bytes",
        "released", "released_bytes")] + [("reasons", c_int), ("reason", c_char_p * 8), ("buffers", c_int64),
                                          ("kept_bytes", c_int64), ("total_bytes", c_int64),
                                          ("kept_share", c_double), ("quantized_on_load", c_int64),
                                          ("quantized_on_load_bytes", c_int64)]


class QuantizeOptions(ctypes.Structure):
    """struct qkeep_quantize_options up to `threads`: what a load that quantizes takes (its size says so)."""
    _fields_ = [("size", c_size_t), ("scheme", c_char_p), ("group_size", c_int64), ("asym_weights", c_bool),
                ("static_input", c_bool), ("asym_input", c_bool), ("kv_cache_scales", c_bool),
                ("activation_amax", ctypes.c_float), ("max_shard_bytes", c_int64), ("threads", c_int)]


QUANTIZE_KEYS = ("group_size", "asym_weights", "static_input", "asym_input", "kv_cache_scales", "activation_amax",
                 "threads")


def optional(name, restype, argtypes):
    """A function of a newer library (None when the loaded one lacks it)."""
    fn = getattr(lib, name, None)
    if fn is not None:
        fn.restype, fn.argtypes = restype, argtypes
    return fn


class Digest(ctypes.Structure):
    _fields_ = [("hi", c_uint64), ("lo", c_uint64)]


class Parallel(ctypes.Structure):
    _fields_ = [("size", c_size_t), ("tp_size", c_int), ("tp_rank", c_int), ("ep_size", c_int),
                ("ep_rank", c_int)]


class LoadStats(ctypes.Structure):
    _fields_ = [("size", c_size_t), ("open_seconds", c_double), ("read_seconds", c_double),
                ("pwal_seconds", c_double), ("checkpoint_bytes", c_int64), ("validate_seconds", c_double)]


class ForwardArgs(ctypes.Structure):
    _fields_ = [("size", c_size_t), ("m", c_int64), ("x", c_void_p), ("x_dtype", c_int), ("y", c_void_p),
                ("y_dtype", c_int), ("expert", c_int32), ("matrix", c_int), ("topk", c_int32),
                ("topk_ids", c_void_p), ("topk_weights", c_void_p), ("stream", c_void_p),
                ("workspace", c_void_p), ("workspace_bytes", c_size_t)]


class LayerDevice(ctypes.Structure):
    _fields_ = [("size", c_size_t), ("type", c_int), ("index", c_int), ("forward", c_bool),
                ("graph_safe", c_bool), ("routed", c_bool)]


NAME_FN = ctypes.CFUNCTYPE(c_int, c_void_p, c_char_p, c_bool, POINTER(View))
STORAGE_FN = ctypes.CFUNCTYPE(c_int, c_void_p, c_char_p, c_char_p, c_void_p, c_size_t)

# name: (restype, argtypes). Every function here is in every ABI 1.x library.
_PROTOTYPES = {
    "qkeep_version": (c_char_p, []),
    "qkeep_strerror": (c_char_p, [c_int]),
    "qkeep_errmsg": (c_char_p, []),
    "qkeep_dtype_bits": (ctypes.c_uint, [c_int]),
    "qkeep_layer_kind_name": (c_char_p, [c_int]),
    "qkeep_config_load": (c_int, [c_char_p, POINTER(c_void_p)]),
    "qkeep_config_free": (None, [c_void_p]),
    "qkeep_config_plugin_dir": (c_char_p, [c_void_p]),
    "qkeep_config_checkpoint": (c_char_p, [c_void_p]),
    "qkeep_config_reload_checkpoint": (c_char_p, [c_void_p]),
    "qkeep_config_fuse": (c_char_p, [c_void_p]),
    "qkeep_config_path": (c_char_p, [c_void_p]),
    "qkeep_config_parallel": (c_int, [c_void_p, POINTER(Parallel)]),
    "qkeep_plugin_open": (c_int, [c_char_p, c_char_p, POINTER(c_void_p)]),
    "qkeep_plugin_configure": (c_int, [c_void_p, c_void_p]),
    "qkeep_plugin_close": (None, [c_void_p]),
    "qkeep_plugins_open_config": (c_int, [c_void_p, POINTER(POINTER(c_void_p)), POINTER(c_size_t)]),
    "qkeep_plugins_close": (None, [POINTER(c_void_p), c_size_t]),
    "qkeep_model_new_chain": (c_int, [POINTER(c_void_p), c_size_t, POINTER(c_void_p)]),
    "qkeep_model_set_fusion": (c_int, [c_void_p, c_char_p]),
    "qkeep_model_set_parallel": (c_int, [c_void_p, POINTER(Parallel)]),
    "qkeep_model_free": (None, [c_void_p]),
    "qkeep_model_load": (c_int, [c_void_p, c_char_p]),
    "qkeep_model_reload": (c_int, [c_void_p, c_char_p, ctypes.c_uint]),
    "qkeep_model_load_stats": (c_int, [c_void_p, POINTER(LoadStats)]),
    "qkeep_model_backend_count": (c_size_t, [c_void_p]),
    "qkeep_model_backend_info": (c_int, [c_void_p, c_size_t, POINTER(ChainInfo)]),
    "qkeep_model_layer_count": (c_size_t, [c_void_p]),
    "qkeep_model_layer": (c_void_p, [c_void_p, c_size_t]),
    "qkeep_model_find_layer": (c_void_p, [c_void_p, c_char_p]),
    "qkeep_model_lookup": (c_void_p, [c_void_p, c_char_p, POINTER(c_void_p)]),
    "qkeep_layer_get_info": (c_int, [c_void_p, POINTER(LayerInfo)]),
    "qkeep_layer_backend": (c_char_p, [c_void_p]),
    "qkeep_view_of": (c_int, [c_void_p, c_char_p, POINTER(View)]),
    "qkeep_param_lookup": (c_void_p, [c_void_p, c_char_p]),
    "qkeep_param_checkpoint_name": (c_char_p, [c_void_p]),
    "qkeep_param_runtime_name": (c_char_p, [c_void_p]),
    "qkeep_foreach_name": (c_int, [c_void_p, NAME_FN, c_void_p]),
    "qkeep_foreach_storage": (c_int, [c_void_p, STORAGE_FN, c_void_p]),
    "qkeep_census": (c_int, [c_void_p, POINTER(Census)]),
    "qkeep_digest": (c_int, [c_void_p, POINTER(Digest)]),
    "qkeep_digest_hex": (None, [POINTER(Digest), ctypes.c_char * 33]),
    "qkeep_layer_apply_f32": (c_int, [c_void_p, c_int64, c_void_p, c_void_p]),
    "qkeep_layer_apply_expert_f32": (c_int, [c_void_p, c_int32, c_int, c_int64, c_void_p, c_void_p]),
}
# ABI 1.4 (the engine forward): bound at first use.
_LAZY_PROTOTYPES = {
    "qkeep_layer_forward": (c_int, [c_void_p, POINTER(ForwardArgs)]),
    "qkeep_layer_workspace": (c_int, [c_void_p, POINTER(ForwardArgs), POINTER(c_size_t)]),
    "qkeep_layer_device": (c_int, [c_void_p, POINTER(LayerDevice)]),
}


def _install_dirs():
    """The directories `make install` recorded (python/qkeep/_install.py), or None in a build tree."""
    try:
        from . import _install
    except ImportError:
        return None
    return _install


def _build_tree_library():
    """libqkeep of the build tree this package lies in (python/qkeep/ beside libqkeep/.libs/), or None."""
    top = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.path.join(top, "libqkeep", ".libs", SONAME)
    return path if os.path.isfile(path) else None


def _untrusted(path):
    """Why a library named by the environment must not be loaded (the plugins' rule: the file and its
    directory owned by root or the caller and writable by no one else), or None."""
    real = os.path.realpath(path)
    for what in (real, os.path.dirname(real)):
        try:
            st = os.stat(what)
        except OSError as e:
            return "%s: %s" % (what, e.strerror)
        if st.st_uid not in (0, os.getuid()):
            return "%s is owned by uid %d, neither root nor the caller" % (what, st.st_uid)
        if st.st_mode & 0o022:
            return "%s is writable by its group or others (mode %o)" % (what, st.st_mode & 0o7777)
    return None


def _candidates():
    env = os.environ.get("QKEEP_LIBRARY")
    if env:  # named explicitly: nothing else is tried
        why = _untrusted(env)
        if why:
            raise ImportError("qkeep: QKEEP_LIBRARY=%s refused: %s" % (env, why))
        return [env]
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), SONAME)
    found = [p for p in (here, _build_tree_library()) if p and os.path.isfile(p)]
    inst = _install_dirs()
    if inst is not None:
        found.append(os.path.join(inst.LIBDIR, SONAME))
    found.append(SONAME)  # the loader's own search
    return found


def _open():
    errors = []
    for path in _candidates():
        try:
            return ctypes.CDLL(path), path
        except OSError as e:
            errors.append("%s: %s" % (path, e))
    raise ImportError("qkeep: cannot load libqkeep (set QKEEP_LIBRARY to its path): " + "; ".join(errors))


lib, library_path = _open()
for _name, (_res, _args) in _PROTOTYPES.items():
    _fn = getattr(lib, _name)
    _fn.restype, _fn.argtypes = _res, _args
_lazy = {}


def lazy(name):
    """A function of ABI 1.4 or later, bound at first use; Error(QKEEP_E_UNSUPPORTED) naming the library
    when this libqkeep predates it."""
    fn = _lazy.get(name)
    if fn is None:
        try:
            fn = getattr(lib, name)
        except AttributeError:
            raise Error(E_UNSUPPORTED, "%s: %s is not in this libqkeep (it came with ABI 1.4)"
                        % (library_path, name)) from None
        fn.restype, fn.argtypes = _LAZY_PROTOTYPES[name]
        _lazy[name] = fn
    return fn


def has(name):
    """Whether the library exports `name` (for the lazily bound functions)."""
    return hasattr(lib, name)


def strerror(code):
    return lib.qkeep_strerror(int(code)).decode("utf-8", "replace")


def errmsg():
    return (lib.qkeep_errmsg() or b"").decode("utf-8", "replace")


def check(rc, context=None):
    """Raises Error for a negative return code, with the calling thread's detail message (read at
    once, on the thread that made the failing call) and, when the detail lacks it, `context`."""
    if rc >= 0:
        return rc
    msg = errmsg()
    if context and context not in msg:
        msg = "%s: %s" % (context, msg) if msg else context
    raise Error(rc, msg)


def text(b):
    return b.decode("utf-8", "replace") if b is not None else None


def fsencode(path):
    return os.fsencode(os.fspath(path))


def build_tree():
    """The build tree's top directory when the library in use is a build tree's, else None."""
    d = os.path.dirname(os.path.abspath(library_path)) if os.sep in library_path else None
    if d and os.path.basename(d) == ".libs" and os.path.basename(os.path.dirname(d)) == "libqkeep":
        return os.path.dirname(os.path.dirname(d))
    return None


def default_config():
    """The config the qkeep command would read: $QKEEP_CONFIG, else the build tree's conf/qkeep.ini
    for a library used from its build tree, else the installed one; None when there is none."""
    env = os.environ.get("QKEEP_CONFIG")
    if env:
        return env
    top = build_tree()
    if top:
        return os.path.join(top, "conf", "qkeep.ini")
    inst = _install_dirs()
    if inst is not None:
        return os.path.join(inst.PKGDATADIR, "qkeep.ini")
    return None
