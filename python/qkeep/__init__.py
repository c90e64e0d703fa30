"""qkeep for Python: load quantized checkpoints into qkeep's layers, run their kernels, reload new
weights in place, and share every param with numpy and torch without copies.

    import qkeep
    with qkeep.load("examples/tiny-mxfp4", backend="cuda-nvfp4, cpu-onednn, reference") as model:
        layer = model.layer("model.layers.0.self_attn.qkv_proj")
        y = layer.forward(x)                      # numpy on the CPU, a torch tensor on the GPU
        w = torch.from_dlpack(model.lookup("model.norm.weight"))   # zero-copy
        model.reload("examples/tiny-w1-mxfp4")    # w, and every captured pointer, now hold W1

A pure-Python package over libqkeep (ctypes); qkeep.torch patches transformers models.
"""

from . import _lib
from ._lib import Error
from ._model import Layer, Model, Param, load

__all__ = ["Error", "Layer", "Model", "Param", "load", "version", "library_path", "default_config"]
__version__ = _lib.lib.qkeep_version().decode()
library_path = _lib.library_path


def version():
    """The version of libqkeep in use ("0.1.0")."""
    return _lib.lib.qkeep_version().decode()


def default_config():
    """The config load() reads when given none (as the qkeep command finds it), or None."""
    return _lib.default_config()
