"""Model, Layer and Param: a loaded checkpoint, its layers and their params, over libqkeep."""

import ctypes
import os

from . import _dlpack, _lib
from ._lib import Error, check, text

_MATRICES = {"w13": _lib.MOE_W13, "w2": _lib.MOE_W2}
_DEVICE_NAMES = {_lib.DEVICE_HOST: "cpu", _lib.DEVICE_CUDA: "cuda", _lib.DEVICE_ROCM: "rocm"}
_WORKSPACE_ALIGN = 256
_X_ALIGN = 16


def _numpy():
    try:
        import numpy
    except ImportError:
        raise Error(_lib.E_UNSUPPORTED, "numpy is not installed (Param.numpy and forward on arrays need it)") from None
    return numpy


def _is_torch(x):
    return type(x).__module__.startswith("torch") and hasattr(x, "data_ptr") and hasattr(x, "device")


def _split_chain(chain):
    names = [n.strip() for n in chain.split(",")] if isinstance(chain, str) else [str(n).strip() for n in chain]
    if not names or any(not n for n in names):
        raise Error(_lib.E_INVAL, "backend chain %r: expected names separated by commas" % (chain,))
    return names


def load(checkpoint=None, backend=None, config=None, quantize=None, *, fuse=None, parallel=None):
    """Loads a checkpoint (a .safetensors file or a Hugging Face directory) and returns a Model.

    backend: the chain, "cuda-nvfp4, cpu-onednn, reference" (default: the config's [qkeep] backend).
    config: an INI file (default: as the qkeep command finds it: $QKEEP_CONFIG, the build tree's
    conf/qkeep.ini for a library used from its build tree, the installed qkeep.ini). Without a config
    a backend chain must be given; plugins are then found through $QKEEP_PLUGIN_PATH and the install
    directory. The config's [backend.NAME] keys, [model] fuse and parallel place apply either way.
    checkpoint None: the config's [model] checkpoint. fuse: a fusion map that overrides the config's.
    parallel: dict(tp_size=, tp_rank=, ep_size=, ep_rank=) overriding the config's.
    quantize: online quantization of an unquantized checkpoint (BF16, F16, F32) on load: a scheme name
    ("gptq-int4"), or a dict with "scheme" and qkeep quantize's options (group_size, asym_weights,
    static_input, asym_input, kv_cache_scales, activation_amax, threads). The model is then the one
    `qkeep quantize` with those options followed by a load gives; the unquantized names stay checkpoint
    names (lookup, reload, sync) and keep no bytes. Default: the config's [model] quantize, if any.
    """
    model = Model._open(backend, config, fuse, parallel, quantize)
    try:
        if checkpoint is None:
            checkpoint = text(_lib.lib.qkeep_config_checkpoint(model._cfg)) if model._cfg else None
            if checkpoint is None:
                raise Error(_lib.E_INVAL, "no checkpoint given and %s has no [model] checkpoint"
                            % (model.config_path or "no config",))
        model._load(checkpoint)
    except BaseException:
        model.close()
        raise
    return model


class Model:
    """A loaded checkpoint: its layers on a chain of backends. Close it (or use `with`) to free its
    memory; every view of its params (numpy arrays, DLPack and CUDA interface tensors) is valid until
    then, and stays on the same memory across reloads."""

    def __init__(self):
        raise TypeError("use qkeep.load(...)")

    @classmethod
    def _open(cls, backend, config, fuse, parallel, quantize=None):
        self = object.__new__(cls)
        self._handle = self._cfg = None
        self._plugins, self._plugin_array = [], None
        self._layers = self._by_ptr = None
        self._workspaces = {}
        self.checkpoint = None
        self.config_path = None
        self.fuse = None
        try:
            self._open_config(backend, config)
            self._open_chain(backend)
            arr = (ctypes.c_void_p * max(len(self._plugins), 1))(*self._plugins)
            handle = ctypes.c_void_p()
            check(_lib.lib.qkeep_model_new_chain(arr, len(self._plugins), ctypes.byref(handle)))
            self._handle = handle
            self._configure(fuse, parallel)
            self._set_quantize(quantize)
        except BaseException:
            self.close()
            raise
        return self

    def _open_config(self, backend, config):
        path = os.fspath(config) if config is not None else _lib.default_config()
        if path is None or (config is None and backend is not None and not os.path.exists(path)):
            if backend is None:
                raise Error(_lib.E_CONFIG, "no config: pass config= or backend=, or set QKEEP_CONFIG")
            return  # a chain given and no config where the default would be: plugins from the search path
        cfg = ctypes.c_void_p()
        check(_lib.lib.qkeep_config_load(_lib.fsencode(path), ctypes.byref(cfg)), path)
        self._cfg = cfg
        self.config_path = path

    def _open_chain(self, backend):
        if backend is None:  # the config's own chain, with its file:line in errors
            plugins = ctypes.POINTER(ctypes.c_void_p)()
            n = ctypes.c_size_t()
            check(_lib.lib.qkeep_plugins_open_config(self._cfg, ctypes.byref(plugins), ctypes.byref(n)))
            self._plugin_array = (plugins, n.value)
            self._plugins = [plugins[i] for i in range(n.value)]
            return
        plugin_dir = _lib.lib.qkeep_config_plugin_dir(self._cfg) if self._cfg else None
        names = _split_chain(backend)
        for i, name in enumerate(names):
            plugin = ctypes.c_void_p()
            where = "backend '%s' (chain position %d of \"%s\")" % (name, i + 1, ", ".join(names))
            check(_lib.lib.qkeep_plugin_open(name.encode(), plugin_dir, ctypes.byref(plugin)), where)
            self._plugins.append(plugin.value)
            if self._cfg:
                check(_lib.lib.qkeep_plugin_configure(plugin, self._cfg), where)

    def _configure(self, fuse, parallel):
        if fuse is None and self._cfg:
            fuse = text(_lib.lib.qkeep_config_fuse(self._cfg))
        if fuse is not None:
            check(_lib.lib.qkeep_model_set_fusion(self._handle, fuse.encode()), "fuse = %s" % fuse)
        self.fuse = fuse  # the fusion map loads use (None: qkeep's default)
        place = _lib.Parallel(size=ctypes.sizeof(_lib.Parallel))
        if self._cfg:
            check(_lib.lib.qkeep_config_parallel(self._cfg, ctypes.byref(place)))
        for key, value in (parallel or {}).items():
            if key not in ("tp_size", "tp_rank", "ep_size", "ep_rank"):
                raise Error(_lib.E_INVAL, "parallel: unknown key %r (expected tp_size, tp_rank, ep_size, ep_rank)"
                            % (key,))
            setattr(place, key, int(value))
        check(_lib.lib.qkeep_model_set_parallel(self._handle, ctypes.byref(place)))

    def _set_quantize(self, quantize):
        set_quantize = _lib.optional("qkeep_model_set_quantize", ctypes.c_int,
                                     [ctypes.c_void_p, ctypes.POINTER(_lib.QuantizeOptions)])
        opts = _lib.QuantizeOptions(size=ctypes.sizeof(_lib.QuantizeOptions))
        if quantize is None:
            from_config = _lib.optional("qkeep_config_quantize", ctypes.c_int,
                                        [ctypes.c_void_p, ctypes.POINTER(_lib.QuantizeOptions)])
            if not self._cfg or from_config is None or from_config(self._cfg, ctypes.byref(opts)) != 0:
                self.quantize = None
                return
        else:
            spec = {"scheme": quantize} if isinstance(quantize, str) else dict(quantize)
            scheme = spec.pop("scheme", None)
            if not isinstance(scheme, str):
                raise Error(_lib.E_INVAL, "quantize: a scheme name, or a dict with \"scheme\" (got %r)" % (quantize,))
            for key, value in spec.items():
                if key not in _lib.QUANTIZE_KEYS:
                    raise Error(_lib.E_INVAL, "quantize: unknown option %r (expected %s)"
                                % (key, ", ".join(_lib.QUANTIZE_KEYS)))
                setattr(opts, key, value)
            self._quantize_scheme = scheme.encode()  # kept: the library copies it, but only at the call
            opts.scheme = self._quantize_scheme
        if set_quantize is None:
            raise Error(_lib.E_UNSUPPORTED, "quantize: this libqkeep has no online quantization")
        check(set_quantize(self._handle, ctypes.byref(opts)), "quantize = %s" % text(opts.scheme))
        self.quantize = text(opts.scheme)

    def _load(self, checkpoint):
        path = os.fspath(checkpoint)
        check(_lib.lib.qkeep_model_load(self._handle, _lib.fsencode(path)), path)
        self.checkpoint = path

    # ---- lifetime ------------------------------------------------------------------------------

    @property
    def closed(self):
        return self._handle is None

    def _h(self):
        if self._handle is None:
            raise Error(_lib.E_STATE, "the model of %s is closed" % (self.checkpoint,))
        return self._handle

    def close(self):
        """Frees the model, its plugins and config. Views of its params are invalid from here on.
        A second close does nothing."""
        if getattr(self, "_handle", None) is not None:
            _lib.lib.qkeep_model_free(self._handle)
            self._handle = None
        self._layers = self._by_ptr = None
        self._workspaces = {}
        if getattr(self, "_plugin_array", None):
            _lib.lib.qkeep_plugins_close(*self._plugin_array)
        else:
            for p in getattr(self, "_plugins", ()):
                _lib.lib.qkeep_plugin_close(p)
        self._plugins, self._plugin_array = [], None
        if getattr(self, "_cfg", None):
            _lib.lib.qkeep_config_free(self._cfg)
            self._cfg = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):
        if _lib is not None and getattr(_lib, "lib", None) is not None:
            self.close()

    def __repr__(self):
        state = "closed" if self.closed else "%d layers" % len(self.layers())
        return "<qkeep.Model %s, %s>" % (self.checkpoint, state)

    # ---- the model ---------------------------------------------------------------------------------

    def reload(self, checkpoint, partial=False):
        """Reloads new weights (W1) in place: every param keeps its memory, so views taken before stay
        valid and show W1; equal to a cold start on W1 (digest). partial: only the layers W1 has
        tensors for. On failure the model keeps W0 (the error says why)."""
        path = os.fspath(checkpoint)
        flags = _lib.RELOAD_PARTIAL if partial else 0
        check(_lib.lib.qkeep_model_reload(self._h(), _lib.fsencode(path), flags), path)
        self.checkpoint = path

    def digest(self):
        """128-bit XXH3 of every registered tensor, as 32 hex digits (qkeep census's digest)."""
        d = _lib.Digest()
        check(_lib.lib.qkeep_digest(self._h(), ctypes.byref(d)), self.checkpoint)
        out = (ctypes.c_char * 33)()
        _lib.lib.qkeep_digest_hex(ctypes.byref(d), out)
        return out.value.decode()

    def backends(self):
        """The chain's links: dicts of name, usable, layers (and probe_message when not usable)."""
        h = self._h()
        links = []
        for i in range(_lib.lib.qkeep_model_backend_count(h)):
            b = _lib.ChainInfo(size=ctypes.sizeof(_lib.ChainInfo))
            check(_lib.lib.qkeep_model_backend_info(h, i, ctypes.byref(b)))
            link = {"name": text(b.name), "usable": bool(b.usable), "layers": int(b.layers)}
            if not b.usable:
                link["probe_message"] = text(b.probe_message) or ""
            links.append(link)
        return links

    def census(self):
        """The census as `qkeep census --json` prints it (the same keys and values)."""
        c = _lib.Census(size=ctypes.sizeof(_lib.Census))
        check(_lib.lib.qkeep_census(self._h(), ctypes.byref(c)), self.checkpoint)
        layers = self.layers()
        out = {"ok": True, "checkpoint": self.checkpoint, "backends": self.backends(),
               "owners": [{"layer": l.name, "scheme": l.scheme, "kind": l.kind, "backend": l.backend}
                          for l in layers],
               "layers": len(layers)}
        for f in ("loader_params", "registered_same", "missing", "c1", "c2", "aliases", "retired", "retired_bytes",
                  "released", "released_bytes"):
            out[f] = int(getattr(c, f))
        out["release_reasons"] = [text(c.reason[i]) for i in range(c.reasons)]
        out["buffers"], out["kept_bytes"], out["total_bytes"] = int(c.buffers), int(c.kept_bytes), int(c.total_bytes)
        out["kept_share"] = float("%.6g" % c.kept_share)  # the CLI prints six significant digits
        out["quantized_on_load"] = int(c.quantized_on_load)
        out["quantized_on_load_bytes"] = int(c.quantized_on_load_bytes)
        out["quantized_on_load_kept_bytes"] = 0
        out["digest"] = self.digest()
        return out

    def load_stats(self):
        """Where the last load or reload spent its time (seconds) and the checkpoint bytes it read."""
        s = _lib.LoadStats(size=ctypes.sizeof(_lib.LoadStats))
        check(_lib.lib.qkeep_model_load_stats(self._h(), ctypes.byref(s)))
        return {f: getattr(s, f) for f, _ in _lib.LoadStats._fields_ if f != "size"}

    def layers(self):
        """Every layer, in model order."""
        if self._layers is None:
            h = self._h()
            self._layers = [Layer(self, _lib.lib.qkeep_model_layer(h, i))
                            for i in range(_lib.lib.qkeep_model_layer_count(h))]
            self._by_ptr = {l._ptr: l for l in self._layers}
        return list(self._layers)

    def layer(self, name):
        """The layer `name` ("model.layers.0.self_attn.qkv_proj"); Error(QKEEP_E_NOTFOUND) when absent."""
        ptr = _lib.lib.qkeep_model_find_layer(self._h(), name.encode())
        if not ptr:
            raise Error(_lib.E_NOTFOUND, "%s: no layer '%s'" % (self.checkpoint, name))
        self.layers()
        return self._by_ptr[ptr]

    def lookup(self, checkpoint_name):
        """The param a checkpoint tensor name loads into ("model.norm.weight"), under its layer's name
        for it ("weight"). Fused members (q_proj into qkv_proj, gate and up into gate_up_proj, experts
        into w13/w2) give the fused param."""
        layer = ctypes.c_void_p()
        param = _lib.lib.qkeep_model_lookup(self._h(), checkpoint_name.encode(), ctypes.byref(layer))
        if not param:
            raise Error(_lib.E_NOTFOUND, "%s: no param loads tensor '%s'" % (self.checkpoint, checkpoint_name))
        self.layers()
        state = _lib.optional("qkeep_param_state", ctypes.c_int, [ctypes.c_void_p])
        if state is not None and state(param) == _lib.PARAM_QUANTIZED:
            return QuantizedOnLoad(self._by_ptr[layer.value], checkpoint_name)
        return Param(self._by_ptr[layer.value], text(_lib.lib.qkeep_param_runtime_name(param)))

    def storages(self):
        """Every distinct storage of the model once (params and buffers): (layer, name, address,
        capacity), the memory every view of the model lies in."""
        out = []

        def collect(user, layer, name, data, capacity):
            out.append((layer.decode(), name.decode(), int(data or 0), int(capacity)))
            return 0

        check(_lib.lib.qkeep_foreach_storage(self._h(), _lib.STORAGE_FN(collect), None), self.checkpoint)
        return out

    def params(self):
        """Every param of every layer, by "layer/name" (its registered names, aliases included)."""
        return {"%s/%s" % (l.name, n): p for l in self.layers() for n, p in l.params().items()}

    # ---- workspaces for the forward -------------------------------------------------------------------

    def _workspace(self, key, nbytes, make):
        """A scratch buffer of at least nbytes for `key` (a device and an array library), grown as
        needed and shared by every layer of the model on that device: (keep-alive object, address)."""
        have = self._workspaces.get(key)
        if have is None or have[2] < nbytes:
            buf, addr = make(nbytes)
            have = (buf, addr, nbytes)
            self._workspaces[key] = have
        return have[0], have[1]

    def reserve_workspace(self, layer_args):
        """Sizes the workspaces ahead (before capturing a CUDA graph): layer_args is an iterable of
        (layer, example x, kwargs of forward) whose forward would run later. Returns the bytes."""
        most = 0
        for layer, x, kw in layer_args:
            most = max(most, layer._prepare(x, None, **kw)[2])
        return most


class Param:
    """A param or buffer of a layer, by one of its registered names: its current view (dtype, shape,
    address) is read from the library at each access, and the memory it names stays put across
    reloads. numpy(), __array_interface__, __dlpack__ and __cuda_array_interface__ share it without
    copying."""

    __slots__ = ("layer", "name", "__weakref__")

    def __init__(self, layer, name):
        self.layer = layer
        self.name = name

    def _view(self):
        v = _lib.View(size=ctypes.sizeof(_lib.View))
        check(_lib.lib.qkeep_view_of(self.layer._p(), self.name.encode(), ctypes.byref(v)),
              "%s: %s" % (self.layer.name, self.name))
        return v

    @property
    def dtype(self):
        """The safetensors dtype name ("BF16", "F8_E4M3", "U8")."""
        return _lib.DTYPES[self._view().spec.dtype]

    @property
    def shape(self):
        s = self._view().spec
        return tuple(int(s.shape[i]) for i in range(s.ndim))

    @property
    def nbytes(self):
        return int(self._view().nbytes)

    @property
    def data_ptr(self):
        """The address of the first byte (host or device memory)."""
        return int(self._view().data or 0)

    @property
    def state(self):
        return _lib.PARAM_STATES[self._view().state]

    @property
    def device(self):
        return self.layer.device

    @property
    def checkpoint_name(self):
        p = _lib.lib.qkeep_param_lookup(self.layer._p(), self.name.encode())
        return text(_lib.lib.qkeep_param_checkpoint_name(p)) if p else None

    def __repr__(self):
        try:
            return "<qkeep.Param %s/%s %s%s on %s>" % (self.layer.name, self.name, self.dtype, list(self.shape),
                                                       self.device)
        except Error:
            return "<qkeep.Param %s/%s (closed)>" % (self.layer.name, self.name)

    # ---- zero-copy views ----------------------------------------------------------------------------

    def _interface(self):
        v = self._view()
        typestr, shape = _dlpack.array_typestr(v.spec.dtype), _dlpack.storage_shape(v)
        return {"shape": shape, "typestr": typestr, "data": (int(v.data or 0), False), "strides": None,
                "version": 3}

    @property
    def __array_interface__(self):
        if self.layer.device != "cpu":
            raise _lib._NoInterface(_lib.E_UNSUPPORTED, "%s: %s lives on %s, not in host memory (use __dlpack__)"
                                    % (self.layer.name, self.name, self.layer.device))
        return self._interface()

    @property
    def __cuda_array_interface__(self):
        if not self.layer.device.startswith("cuda"):
            raise _lib._NoInterface(_lib.E_UNSUPPORTED, "%s: %s lives on %s, not on a CUDA device"
                                    % (self.layer.name, self.name, self.layer.device))
        d = self._interface()
        d["stream"] = None  # loads and reloads finish before they return: nothing to wait for
        return d

    def numpy(self):
        """A numpy array over the param's host memory (no copy): writes through it change the param.
        Dtypes numpy lacks come as their storage: BF16 as uint16, FP8 and packed FP4/FP6 as uint8
        (FP4's last dimension halved, FP6 flat)."""
        np = _numpy()
        return np.asarray(self)

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        """A DLPack capsule over the param's memory (host or device; no copy), that keeps the model
        alive until the consumer frees it. BF16 is exported as bfloat16; FP8 and packed FP4/FP6 as uint8
        (view them as the float type in torch)."""
        if copy:
            raise BufferError("qkeep params are shared, never copied (copy=True)")
        if dl_device is not None and tuple(dl_device) != self.__dlpack_device__():
            raise BufferError("%s: %s lives on %s" % (self.layer.name, self.name, self.layer.device))
        versioned = max_version is not None and tuple(max_version) >= (1, 0)
        return _dlpack.export(self, self._view(), self.layer._device_tuple(), versioned)

    def __dlpack_device__(self):
        return _dlpack.device_tuple(*self.layer._device_tuple())


class Layer:
    """One layer: its name, scheme, kind, dims, owner backend and device; its params; its forward."""

    def __init__(self, model, ptr):
        self.model = model
        self._ptr = ptr
        info = _lib.LayerInfo(size=ctypes.sizeof(_lib.LayerInfo))
        check(_lib.lib.qkeep_layer_get_info(ptr, ctypes.byref(info)))
        self.name = text(info.name)
        self.scheme = text(info.scheme)
        self.kind = text(_lib.lib.qkeep_layer_kind_name(info.kind))
        self.n, self.k, self.experts, self.group_size = int(info.n), int(info.k), int(info.experts), int(info.group_size)
        self.shard_n = tuple(int(info.shard_n[i]) for i in range(max(info.shards, 0)))
        self.flags = int(info.flags)
        self.backend = text(_lib.lib.qkeep_layer_backend(ptr)) or "host"
        self._dev = None

    def _p(self):
        self.model._h()
        return self._ptr

    def __repr__(self):
        return "<qkeep.Layer %s %s %s n=%d k=%d on %s>" % (self.name, self.kind, self.scheme, self.n, self.k,
                                                           self.backend)

    def _device_info(self):
        if self._dev is None:
            d = _lib.LayerDevice(size=ctypes.sizeof(_lib.LayerDevice))
            if _lib.has("qkeep_layer_device"):
                check(_lib.lazy("qkeep_layer_device")(self._p(), ctypes.byref(d)), self.name)
            elif self.backend in ("host", "reference") or self.backend.startswith("cpu-"):
                d.type, d.forward = _lib.DEVICE_HOST, self.kind in ("linear", "moe")
            else:
                raise Error(_lib.E_UNSUPPORTED, "%s: this libqkeep (%s) cannot say where backend '%s' keeps it"
                            % (self.name, _lib.library_path, self.backend))
            self._dev = d
        return self._dev

    def _device_tuple(self):
        d = self._device_info()
        return int(d.type), int(d.index)

    @property
    def device(self):
        """"cpu" for host memory, "cuda:0" for a CUDA device, "rocm:0" for a HIP one."""
        t, i = self._device_tuple()
        return "cpu" if t == _lib.DEVICE_HOST else "%s:%d" % (_DEVICE_NAMES.get(t, "other"), i)

    @property
    def has_forward(self):
        return bool(self._device_info().forward)

    @property
    def graph_safe(self):
        return bool(self._device_info().graph_safe)

    @property
    def routed(self):
        return bool(self._device_info().routed)

    def params(self, buffers=False):
        """Every registered name of the layer's params (aliases included) -> Param; with buffers=True
        the kernel-only buffers too."""
        names = []

        def collect(user, name, is_buffer, view):
            if buffers or not is_buffer:
                names.append(name.decode())
            return 0

        check(_lib.lib.qkeep_foreach_name(self._p(), _lib.NAME_FN(collect), None), self.name)
        return {n: Param(self, n) for n in names}

    def param(self, name):
        """The param or buffer registered as `name`; Error(QKEEP_E_NOTFOUND) when absent."""
        p = Param(self, name)
        p._view()
        return p

    # ---- the forward -----------------------------------------------------------------------------------

    def _shapes(self, x_shape, expert, matrix, topk_ids):
        """(m, input features, output shape, topk) for this layer and call."""
        if self.kind == "moe":
            if matrix not in _MATRICES:
                raise Error(_lib.E_INVAL, "%s: an MoE layer's forward takes matrix='w13' or 'w2', not %r"
                            % (self.name, matrix))
            k_in, n_out = (self.k, self.n) if matrix == "w13" else (self.n // 2, self.k)
        elif self.kind == "linear":
            if matrix is not None or expert is not None or topk_ids is not None:
                raise Error(_lib.E_INVAL, "%s: expert, matrix and topk_ids are for MoE layers" % self.name)
            k_in, n_out = self.k, self.n
        else:
            raise Error(_lib.E_UNSUPPORTED, "%s: a %s layer has no forward" % (self.name, self.kind))
        if not x_shape or x_shape[-1] != k_in:
            raise Error(_lib.E_INVAL, "%s: x has shape %s, expected [..., %d]" % (self.name, list(x_shape), k_in))
        rows = 1
        for d in x_shape[:-1]:
            rows *= int(d)
        if topk_ids is None:
            if self.kind == "moe" and expert is None:
                raise Error(_lib.E_INVAL, "%s: an MoE forward takes expert= or topk_ids=" % self.name)
            return rows, tuple(x_shape[:-1]) + (n_out,), 0
        ids_shape = tuple(topk_ids.shape)
        if len(ids_shape) != 2:
            raise Error(_lib.E_INVAL, "%s: topk_ids has shape %s, expected [m, topk]" % (self.name, list(ids_shape)))
        m, topk = int(ids_shape[0]), int(ids_shape[1])
        want = m if matrix == "w13" else m * topk
        if rows != want:
            raise Error(_lib.E_INVAL, "%s: routed %s takes %d rows of x for %d tokens x topk %d, not %d"
                        % (self.name, matrix, want, m, topk, rows))
        return m, ((m * topk, n_out) if matrix == "w13" else (m, n_out)), topk

    def _prepare(self, x, out, expert=None, matrix=None, topk_ids=None, topk_weights=None, stream=None):
        """Checks the call and returns (args, keep-alive list, workspace bytes, out)."""
        if self.kind == "moe" and isinstance(matrix, int):
            matrix = {_lib.MOE_W13: "w13", _lib.MOE_W2: "w2"}.get(matrix, matrix)
        m, out_shape, topk = self._shapes(tuple(x.shape), expert, matrix, topk_ids)
        if _is_torch(x):
            from . import _torchio as io
        else:
            io = _NumpyIO
        x, out, keep = io.operands(self, x, out, out_shape, topk_ids, topk_weights, matrix)
        args = _lib.ForwardArgs(size=ctypes.sizeof(_lib.ForwardArgs), m=m, x=io.ptr(x), x_dtype=io.dtype(self, x),
                                y=io.ptr(out), y_dtype=io.dtype(self, out), expert=int(expert or 0),
                                matrix=_MATRICES.get(matrix, 0), topk=topk)
        if topk:
            args.topk_ids = io.ptr(keep[0])
            args.topk_weights = io.ptr(keep[1]) if keep[1] is not None else None
        args.stream = io.stream(self, x) if stream is None else stream
        nbytes = ctypes.c_size_t()
        check(_lib.lazy("qkeep_layer_workspace")(self._p(), ctypes.byref(args), ctypes.byref(nbytes)), self.name)
        if nbytes.value:
            buf, addr = self.model._workspace(io.workspace_key(self, x), nbytes.value,
                                              lambda n: io.workspace(self, x, n))
            keep.append(buf)
            args.workspace, args.workspace_bytes = addr, nbytes.value
        return args, keep, nbytes.value, out

    def forward(self, x, out=None, *, expert=None, matrix=None, topk_ids=None, topk_weights=None, stream=None):
        """y = x W^T (+ bias) through the layer's kernel, on activations in the layer's memory.

        x: a numpy array (f32 or f16) for a host layer, or a torch tensor (f32, bf16, f16) on the
        layer's device, [..., K], contiguous. out: where y goes ([..., N], f32 or x's dtype);
        allocated like x when None. MoE layers: matrix "w13" ([m, H] -> [m, 2I]) or "w2" ([m, I] ->
        [m, H]) with expert=E for one expert, or routed with topk_ids [m, topk] (int32) and, for w2,
        topk_weights [m, topk] (f32): w13 gives [m * topk, 2I], w2 takes [m * topk, I] to [m, H].
        A device layer runs on torch's current stream (or `stream`, a cudaStream_t as an int) and
        returns before the kernel ends; the scratch it needs comes from one workspace per device,
        kept by the model and grown as needed. Returns out."""
        args, keep, _, out = self._prepare(x, out, expert, matrix, topk_ids, topk_weights, stream)
        check(_lib.lazy("qkeep_layer_forward")(self._p(), ctypes.byref(args)), self.name)
        del keep
        return out

    __call__ = forward


class _NumpyIO:
    """Forward operands as numpy arrays in host memory."""

    @staticmethod
    def operands(layer, x, out, out_shape, topk_ids, topk_weights, matrix):
        np = _numpy()
        if layer.device != "cpu":
            raise Error(_lib.E_INVAL, "%s lives on %s: pass a torch tensor on that device, not a numpy array"
                        % (layer.name, layer.device))
        x = np.asarray(x)
        if x.dtype not in (np.float32, np.float16):
            raise Error(_lib.E_UNSUPPORTED, "%s: x is %s; numpy activations are float32 or float16 (bfloat16 through "
                        "torch)" % (layer.name, x.dtype))
        if not x.flags.c_contiguous or x.ctypes.data % _X_ALIGN:
            x = np.array(x, order="C", copy=True)  # a fresh array: malloc's 16-byte alignment
        if out is None:
            out = np.empty(out_shape, dtype=x.dtype)
        elif (not isinstance(out, np.ndarray) or tuple(out.shape) != tuple(out_shape) or not out.flags.c_contiguous
              or not out.flags.writeable or out.dtype not in (np.float32, x.dtype)):
            raise Error(_lib.E_INVAL, "%s: out must be a writable C-contiguous float32 or %s array of shape %s"
                        % (layer.name, x.dtype, list(out_shape)))
        keep = []
        if topk_ids is not None:
            keep.append(np.ascontiguousarray(topk_ids, dtype=np.int32))
            if matrix == "w2" and topk_weights is None:
                raise Error(_lib.E_INVAL, "%s: routed w2 needs topk_weights" % layer.name)
            keep.append(np.ascontiguousarray(topk_weights, dtype=np.float32) if topk_weights is not None else None)
        return x, out, keep

    @staticmethod
    def ptr(a):
        return a.ctypes.data

    @staticmethod
    def dtype(layer, a):
        return _lib.DTYPE["F32" if a.dtype.itemsize == 4 else "F16"]

    @staticmethod
    def stream(layer, x):
        return None

    @staticmethod
    def workspace_key(layer, x):
        return ("numpy", "cpu")

    @staticmethod
    def workspace(layer, x, nbytes):
        np = _numpy()
        buf = np.empty(nbytes + _WORKSPACE_ALIGN, dtype=np.uint8)
        addr = buf.ctypes.data
        return buf, addr + (-addr % _WORKSPACE_ALIGN)


class QuantizedOnLoad:
    """An unquantized checkpoint tensor of a model that quantizes on load (qkeep.load(quantize=...)): its
    name is a checkpoint name of the model (lookup, reload, sync), but it keeps no bytes: what loads into
    it lands quantized in its layer's kernel params."""

    state = "quantized on load"
    nbytes = 0

    def __init__(self, layer, name):
        self.layer, self.name = layer, name

    def __repr__(self):
        return "<qkeep quantized-on-load %s of layer %s>" % (self.name, self.layer.name)
