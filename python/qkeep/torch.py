"""qkeep for torch and transformers: zero-copy torch views of qkeep params, modules whose forward is a
qkeep layer's, and patch(), which puts a loaded qkeep model under a transformers model.

    hf = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16).cuda()
    model = qkeep.load("llama-nvfp4", backend="cuda-nvfp4")
    qkeep.torch.patch(hf, model)     # linears and MoE experts run qkeep's kernels; every other
                                     # weight (norms, embeddings, router, biases) is a view of qkeep's
    model.reload("llama-nvfp4-w1")   # the whole hf model now computes with W1, graphs included

Fused layers (qkv_proj, gate_up_proj) run once per input and hand each original module (q_proj,
k_proj, v_proj; gate_proj, up_proj) its slice. MoE blocks of Qwen3-MoE and Mixtral style (a router
and a stacked `experts` module taking (hidden, top_k_index, top_k_weights)) and gpt-oss's
(interleaved gate/up rows, clamped SwiGLU) run qkeep's routed MoE. Nothing in the patched forward
allocates through the host or synchronises, so a decode step can be captured in a CUDA graph
(size the workspaces first with one eager step).
"""

import torch
from torch import nn

from . import _lib
from ._lib import Error

_DEFAULT_FUSE = "qkv_proj=q_proj+k_proj+v_proj,gate_up_proj=gate_proj+up_proj"
_FLOAT8 = {"F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
           "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz"}


def tensor(param):
    """A torch tensor over the param's memory (no copy; host or device), with the param's dtype where
    torch has it (FP8 included) and its logical shape; it keeps the model alive while it lives."""
    t = torch.from_dlpack(param)
    name = _FLOAT8.get(param.dtype)
    if name and hasattr(torch, name):
        t = t.view(getattr(torch, name))
    return t


def _fusion_rules(spec):
    rules = {}
    if spec and spec.strip() != "none":
        for rule in spec.split(","):
            fused, _, members = rule.partition("=")
            for i, member in enumerate(members.split("+")):
                rules[member.strip()] = (fused.strip(), i)
    return rules


class _FusedRun:
    """One fused qkeep layer shared by its members: it runs once per input (the same tensor, unchanged)
    and each member takes its columns of the output."""

    def __init__(self, layer):
        self.layer = layer
        self._key = None
        self._x = self._y = None

    def __call__(self, x):
        key = (id(x), x._version, x.data_ptr(), tuple(x.shape))
        if self._key != key or self._x is not x:
            self._y = self.layer.forward(x)
            self._x, self._key = x, key
        return self._y


class QkeepLinear(nn.Module):
    """Replaces an nn.Linear: y = qkeep's forward of the layer (bias included), or its columns
    [start, stop) for a member of a fused layer. It holds no torch parameter: the weights are qkeep's
    (`qkeep_layer`)."""

    def __init__(self, run, start, stop, in_features, out_features):
        super().__init__()
        self.run = run
        self.start, self.stop = start, stop
        self.in_features, self.out_features = in_features, out_features
        self.qkeep_layer = run.layer

    def forward(self, x):
        y = self.run(x)
        if self.start == 0 and self.stop == y.shape[-1]:
            return y
        return y[..., self.start:self.stop]

    def extra_repr(self):
        return "%s[%d:%d], in_features=%d, out_features=%d" % (self.qkeep_layer.name, self.start, self.stop,
                                                              self.in_features, self.out_features)


class QkeepExperts(nn.Module):
    """Replaces a stacked experts module: forward(hidden [T, H], top_k_index [T, k], top_k_weights
    [T, k]) -> [T, H] through qkeep's routed MoE (w13, the activation, w2 with the router weights)."""

    def __init__(self, layer, act, gpt_oss=None):
        super().__init__()
        self.qkeep_layer = layer
        self.act = act
        self.gpt_oss = gpt_oss  # (alpha, limit) for gpt-oss's clamped SwiGLU
        self.interleaved = bool(layer.flags & (1 << 7))  # QKEEP_LAYER_F_INTERLEAVED_W13
        self.num_experts = layer.experts

    def _activation(self, y13):
        if self.interleaved:
            gate, up = y13[..., 0::2], y13[..., 1::2]
        else:
            gate, up = y13.chunk(2, dim=-1)
        if self.gpt_oss is not None:
            alpha, limit = self.gpt_oss
            gate = gate.clamp(max=limit)
            up = up.clamp(min=-limit, max=limit)
            return ((up + 1) * (gate * torch.sigmoid(gate * alpha))).contiguous()
        return (self.act(gate) * up).contiguous()

    def forward(self, hidden_states, top_k_index=None, top_k_weights=None, router_indices=None, routing_weights=None,
                **unused):
        # Qwen3-MoE and Mixtral pass (top_k_index, top_k_weights); gpt-oss (router_indices=, routing_weights=)
        top_k_index = top_k_index if top_k_index is not None else router_indices
        top_k_weights = top_k_weights if top_k_weights is not None else routing_weights
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        ids = top_k_index.reshape(x.shape[0], -1)
        weights = top_k_weights.reshape(x.shape[0], -1).to(torch.float32)
        if weights.shape[-1] != ids.shape[-1]:  # dense [T, E] scores (gpt-oss): each slot's own weight
            weights = weights.gather(1, ids.long())
        ids = ids.to(torch.int32)
        if self.qkeep_layer.routed:
            y13 = self.qkeep_layer.forward(x, matrix="w13", topk_ids=ids)
            y = self.qkeep_layer.forward(self._activation(y13), matrix="w2", topk_ids=ids, topk_weights=weights)
        else:  # every expert on every token, masked: slow, but graph-safe without routing kernels
            y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
            for e in range(self.num_experts):
                w = (weights * (ids == e)).sum(dim=-1, keepdim=True)
                h = self._activation(self.qkeep_layer.forward(x, matrix="w13", expert=e))
                y += w * self.qkeep_layer.forward(h, matrix="w2", expert=e).float()
        return y.to(hidden_states.dtype).reshape(shape)


class QkeepSparseMoeBlock(nn.Module):
    """Replaces a MoE block whose experts are a list of MLPs (transformers 4.x's Qwen3-MoE and
    Mixtral): the router (`gate`, its weight qkeep's) picks top-k, qkeep's experts run them. Returns
    (hidden, router_logits) as those blocks do."""

    def __init__(self, gate, experts, top_k, norm_topk_prob):
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob

    def forward(self, hidden_states):
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        logits = self.gate(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return self.experts(x, ids, weights).reshape(shape), logits


def _set_module(root, path, module):
    parent, _, child = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, module)


def _view_like(model, name, like, device):
    """qkeep's param for the torch tensor `name` (its checkpoint name), as a tensor of like's shape."""
    p = model.lookup(name)
    t = tensor(p)
    dims = [d for d in t.shape if d != 1] == [d for d in like.shape if d != 1]
    if not dims or t.dtype != like.dtype:  # a repacked layout (a CPU backend's PWAL) is no view
        raise Error(_lib.E_INVAL, "%s: qkeep holds %s %s, the torch model %s %s" % (
            name, p.dtype, list(p.shape), like.dtype, list(like.shape)))
    if device is not None and t.device != device:
        raise Error(_lib.E_INVAL, "%s: qkeep keeps it on %s (backend %s), the torch model on %s" % (
            name, t.device, p.layer.backend, device))
    return t.view(like.shape)


class Patch:
    """What patch() did: the modules it replaced and the params it turned into qkeep views."""

    def __init__(self):
        self.linears, self.experts, self.views = [], [], []

    def __repr__(self):
        return "<qkeep.torch.Patch %d linears, %d MoE blocks, %d weight views>" % (
            len(self.linears), len(self.experts), len(self.views))


def patch(hf_model, qkeep_model, fuse=None):
    """Makes hf_model (a transformers Llama, Qwen3, Qwen3-MoE or gpt-oss style model, on the device of
    qkeep's layers) compute with qkeep_model's layers: its nn.Linear modules and MoE experts become
    qkeep modules, and every other weight (embeddings, norms, routers, an unquantized lm_head, biases)
    a zero-copy view of qkeep's param of the same checkpoint name, so that qkeep_model.reload() or a
    sync updates the whole model in place. fuse: the fusion map of the qkeep model's layers (default:
    the one it was loaded with). Error, naming the module, for a weight qkeep does not hold or holds elsewhere.
    Returns a Patch."""
    if fuse is None:
        fuse = getattr(qkeep_model, "fuse", None) or _DEFAULT_FUSE
    rules = _fusion_rules(fuse)
    done = Patch()
    runs = {}
    config = getattr(hf_model, "config", None)

    def layer_of(path):
        try:
            return qkeep_model.layer(path), 0, None
        except Error:
            pass
        parent, _, child = path.rpartition(".")
        if child in rules:
            fused, index = rules[child]
            layer = qkeep_model.layer((parent + "." if parent else "") + fused)
            start = sum(layer.shard_n[:index])
            return layer, start, start + layer.shard_n[index]
        raise Error(_lib.E_NOTFOUND, "%s: no qkeep layer holds this module (fusion map %r)" % (path, fuse))

    def run_of(layer):
        if layer.name not in runs:
            runs[layer.name] = _FusedRun(layer)
        return runs[layer.name]

    # MoE blocks first: their experts are not nn.Linear (transformers 5) or are many of them (4.x).
    for path, module in list(hf_model.named_modules()):
        experts = getattr(module, "experts", None)
        if experts is None or path.endswith(".experts"):
            continue
        layer = qkeep_model.layer(path + ".experts")
        act = getattr(experts, "act_fn", None) or getattr(getattr(experts, "0", None), "act_fn", None) or \
            nn.functional.silu
        gpt_oss = (float(experts.alpha), float(experts.limit)) if hasattr(experts, "alpha") and hasattr(
            experts, "limit") else None
        new = QkeepExperts(layer, act, gpt_oss)
        if isinstance(experts, nn.ModuleList):  # 4.x: the block's own forward loops over MLPs
            top_k = getattr(module, "top_k", None) or getattr(config, "num_experts_per_tok")
            norm = getattr(module, "norm_topk_prob", getattr(config, "norm_topk_prob", True))
            _set_module(hf_model, path, QkeepSparseMoeBlock(module.gate, new, top_k, norm))
        else:
            _set_module(hf_model, path + ".experts", new)
        done.experts.append(path)

    for path, module in list(hf_model.named_modules()):
        if not isinstance(module, nn.Linear):
            continue
        try:
            layer, start, stop = layer_of(path)
        except Error:
            if path.endswith(".gate") or path.endswith(".router"):
                continue  # a router that qkeep loads as a plain tensor: a view below
            raise
        if not layer.has_forward or layer.kind != "linear":
            continue  # qkeep keeps it without a kernel: the module stays torch's, on qkeep's weights
        stop = layer.n if stop is None else stop
        _set_module(hf_model, path, QkeepLinear(run_of(layer), start, stop, module.in_features, module.out_features))
        done.linears.append(path)

    # Every other weight: a view of qkeep's param of that checkpoint name.
    tied = []
    for mpath, module in list(hf_model.named_modules()):
        if isinstance(module, (QkeepLinear, QkeepExperts)):
            continue
        for pname, param in list(module.named_parameters(recurse=False)):
            name = (mpath + "." if mpath else "") + pname
            try:
                view = _view_like(qkeep_model, name, param, param.device)
            except Error as e:
                if e.code == _lib.E_NOTFOUND and pname == "weight" and mpath.endswith("lm_head"):
                    tied.append((module, pname))  # a tied lm_head: the embedding's, below
                    continue
                raise
            setattr(module, pname, nn.Parameter(view, requires_grad=False))
            done.views.append(name)
        for bname, buf in list(module.named_buffers(recurse=False)):
            name = (mpath + "." if mpath else "") + bname
            try:
                view = _view_like(qkeep_model, name, buf, buf.device)
            except Error as e:
                if e.code == _lib.E_NOTFOUND:
                    continue  # computed buffers (rotary inv_freq) are not weights
                raise
            module._buffers[bname] = view
            done.views.append(name)
    if tied:
        embed = hf_model.get_input_embeddings()
        for module, pname in tied:
            setattr(module, pname, embed.weight)
    return done


def qkeep_storages(qkeep_model):
    """(address, capacity) of every storage of the model: what a patched model's tensors must lie in."""
    return [(ptr, cap) for _, _, ptr, cap in qkeep_model.storages()]


def foreign_tensors(hf_model, qkeep_model):
    """Names of hf_model's parameters and weight buffers whose memory is not qkeep's (empty after a
    complete patch), computed buffers (rotary inv_freq) aside."""
    spans = sorted(qkeep_storages(qkeep_model))

    def inside(t):
        a, n = t.data_ptr(), t.numel() * t.element_size()
        return any(lo <= a and a + n <= lo + cap for lo, cap in spans)

    out = [n for n, p in hf_model.named_parameters() if not inside(p)]
    out += [n for n, b in hf_model.named_buffers() if not n.endswith("inv_freq") and b.numel() and not inside(b)]
    return out
