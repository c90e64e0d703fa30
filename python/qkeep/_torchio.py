"""Forward operands as torch tensors (imported only when a tensor is passed to Layer.forward)."""

import torch

from . import _lib
from ._lib import Error

_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
_X_ALIGN = 16
_WORKSPACE_ALIGN = 256


def _check_device(layer, t, what):
    dev = layer.device
    if dev == "cpu":
        ok = t.device.type == "cpu"
    else:
        kind, _, index = dev.partition(":")
        # torch names a ROCm device "cuda" too
        ok = t.device.type == "cuda" and (t.device.index if t.device.index is not None else 0) == int(index)
    if not ok:
        raise Error(_lib.E_INVAL, "%s: %s is on %s; the layer's memory is %s" % (layer.name, what, t.device, dev))


def operands(layer, x, out, out_shape, topk_ids, topk_weights, matrix):
    if x.dtype not in _DTYPES:
        raise Error(_lib.E_UNSUPPORTED, "%s: x is %s; expected float32, bfloat16 or float16" % (layer.name, x.dtype))
    _check_device(layer, x, "x")
    if not x.is_contiguous():
        x = x.contiguous()
    if x.data_ptr() % _X_ALIGN:
        raise Error(_lib.E_INVAL, "%s: x at 0x%x is not 16-byte aligned (a view into another tensor?)"
                    % (layer.name, x.data_ptr()))
    if out is None:
        out = torch.empty(out_shape, dtype=x.dtype, device=x.device)
    else:
        if tuple(out.shape) != tuple(out_shape) or not out.is_contiguous() or out.dtype not in (torch.float32, x.dtype):
            raise Error(_lib.E_INVAL, "%s: out must be a contiguous float32 or %s tensor of shape %s, not %s %s"
                        % (layer.name, x.dtype, list(out_shape), out.dtype, list(out.shape)))
        _check_device(layer, out, "out")
    keep = []
    if topk_ids is not None:
        if topk_ids.dtype != torch.int32:
            topk_ids = topk_ids.to(torch.int32)  # torch.topk gives int64
        _check_device(layer, topk_ids, "topk_ids")
        keep.append(topk_ids.contiguous())
        if topk_weights is not None:
            _check_device(layer, topk_weights, "topk_weights")
            keep.append(topk_weights.to(torch.float32).contiguous())
        elif matrix == "w2":
            raise Error(_lib.E_INVAL, "%s: routed w2 needs topk_weights" % layer.name)
        else:
            keep.append(None)
    return x, out, keep


def ptr(t):
    return t.data_ptr()


def dtype(layer, t):
    return _lib.DTYPE[_DTYPES[t.dtype]]


def stream(layer, x):
    if x.device.type != "cuda":
        return None
    return torch.cuda.current_stream(x.device).cuda_stream or None


def workspace_key(layer, x):
    return ("torch", str(x.device))


def workspace(layer, x, nbytes):
    buf = torch.empty(nbytes + _WORKSPACE_ALIGN, dtype=torch.uint8, device=x.device)
    addr = buf.data_ptr()
    return buf, addr + (-addr % _WORKSPACE_ALIGN)
