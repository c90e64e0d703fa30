"""qkeep.torch on a CUDA GPU (make check-gpu, through tests/python_gpu.sh): transformers Llama and
Qwen3-MoE models with random weights, saved by save_pretrained, quantized by `qkeep quantize` to NVFP4
(ModelOpt and compressed-tensors namings) and MXFP4, loaded on cuda-nvfp4 and patched into the
transformers model.

- every parameter and weight buffer of the patched model lies in qkeep's memory;
- a greedy decode of 32 tokens by the bf16 model, replayed through the patched one: the last
  position's logits have a cosine with the bf16 model's of at least 0.95 (NVFP4) or 0.93 (MXFP4)
  at every step (random weights: see COSINE; the worst figure and the share of agreeing argmax
  tokens are printed);
- every linear and MoE layer's forward on the GPU (bf16 activations) is within 5% (max |y - y_ref| /
  max |y_ref|, qkeep run's measure) of the reference backend's on the same checkpoint;
- a CUDA graph of a forward step of the patched model (captured in cudaStreamCaptureModeGlobal),
  replayed after Model.reload(W1), gives logits bitwise equal to the graph of a cold W1 model, and
  different from W0's.

Exits 77 (skip) without torch, transformers, a CUDA device, the cuda-nvfp4 plugin or the engine forward.
"""

import os
import subprocess
import sys
import tempfile
import unittest

SKIP = 77


def skip(why):
    print("SKIP: " + why)
    sys.exit(SKIP)


try:
    import torch
    import transformers
except ImportError as e:
    skip("no torch or transformers (%s)" % e)
if not torch.cuda.is_available():
    skip("torch sees no CUDA device")

import qkeep
import qkeep.torch
import qkeep_testutil as tu
from qkeep import _lib

if not _lib.has("qkeep_layer_forward"):
    skip("this libqkeep has no qkeep_layer_forward")
if not tu.built("cuda-nvfp4"):
    skip("the cuda-nvfp4 plugin is not built")

SCHEMES = ("modelopt-nvfp4", "ct-nvfp4", "mxfp4")
CHAIN = "cuda-nvfp4"
DEVICE = torch.device("cuda:0")
STEPS = 32
# The worst last-position logit cosine against the bf16 model over a teacher-forced 32-token decode,
# per scheme. Random weights give near-flat logits, so 4-bit weight noise shows more than on a
# trained model: measured on an H100 0.9757 (NVFP4, Llama), 0.9560 (NVFP4, Qwen3-MoE), 0.9589 and
# 0.9449 (MXFP4, whose power-of-two block scales round coarser). The bounds sit just under.
COSINE = {"modelopt-nvfp4": 0.95, "ct-nvfp4": 0.95, "mxfp4": 0.93}
LAYER_TOLERANCE = 0.05


def llama_config():
    return transformers.LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                    max_position_embeddings=256, tie_word_embeddings=False)


def qwen3_moe_config():
    return transformers.Qwen3MoeConfig(vocab_size=1024, hidden_size=256, intermediate_size=512,
                                       moe_intermediate_size=256, num_experts=4, num_experts_per_tok=2,
                                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                       head_dim=64, decoder_sparse_step=1, norm_topk_prob=True,
                                       max_position_embeddings=256, tie_word_embeddings=False)


MODELS = {"llama": llama_config, "qwen3-moe": qwen3_moe_config}


def hf_model(config, path=None, seed=0):
    """A bf16 transformers model on the GPU: random (seed) or from path; eager attention."""
    config._attn_implementation = "eager"
    if path:
        m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="eager")
    else:
        torch.manual_seed(seed)
        m = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="eager")
    return m.to(DEVICE).eval()


def per_expert(path):
    """Rewrites stacked bf16 experts (mlp.experts.gate_up_proj [E, 2I, H], down_proj [E, H, I]), where
    save_pretrained wrote them so, as the per-expert tensors of the published checkpoints
    (experts.N.gate_proj.weight...), which qkeep quantize reads."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    file = os.path.join(path, "model.safetensors")
    if not os.path.exists(file):
        return
    with safe_open(file, "pt") as f:
        keys = list(f.keys())
        if not any(k.endswith("mlp.experts.gate_up_proj") for k in keys):
            return
        tensors = {}
        for k in keys:
            t = f.get_tensor(k)
            if k.endswith("mlp.experts.gate_up_proj"):
                inter = t.shape[1] // 2
                for e in range(t.shape[0]):
                    tensors["%s.%d.gate_proj.weight" % (k[:-len(".gate_up_proj")], e)] = t[e, :inter].contiguous()
                    tensors["%s.%d.up_proj.weight" % (k[:-len(".gate_up_proj")], e)] = t[e, inter:].contiguous()
            elif k.endswith("mlp.experts.down_proj"):
                for e in range(t.shape[0]):
                    tensors["%s.%d.down_proj.weight" % (k[:-len(".down_proj")], e)] = t[e].contiguous()
            else:
                tensors[k] = t
    save_file(tensors, file, metadata={"format": "pt"})


class Fixture:
    """Per model: W0 and W1 saved by save_pretrained, and each quantized into every scheme."""

    def __init__(self, root, name):
        self.dir = os.path.join(root, name)
        self.config = MODELS[name]()
        self.bf16 = {}
        for w, seed in (("w0", 1), ("w1", 2)):
            path = os.path.join(self.dir, w)
            hf_model(self.config, seed=seed).save_pretrained(path)
            per_expert(path)
            self.bf16[w] = path
            for scheme in SCHEMES:
                subprocess.run([tu.CLI, "quantize", path, self.q(w, scheme), "--scheme", scheme], check=True,
                               stdout=subprocess.DEVNULL)

    def q(self, w, scheme):
        return os.path.join(self.dir, "%s-%s" % (w, scheme))


def cosine(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    return float(torch.dot(a, b) / (a.norm() * b.norm()))


def rel_error(y, ref):
    y, ref = y.double(), ref.double()
    return float((y - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


@torch.no_grad()
def logits(model, ids):
    """The logits of every position, with the causal mask made here on the device (4-D, additive, as
    eager attention adds it): transformers' own eager mask copies a host scalar to the GPU, which a
    CUDA graph capture refuses."""
    n = ids.shape[1]
    pos = torch.arange(n, device=ids.device).unsqueeze(0)
    mask = torch.full((n, n), torch.finfo(torch.bfloat16).min, dtype=torch.bfloat16, device=ids.device)
    mask = torch.triu(mask, diagonal=1).view(1, 1, n, n).expand(ids.shape[0], 1, n, n)
    return model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits


class TestPatched(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory(prefix="qkeep-gpu-")
        cls.fixtures = {name: Fixture(cls.tmp.name, name) for name in MODELS}

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def patched(self, fx, w, scheme):
        qm = qkeep.load(fx.q(w, scheme), backend=CHAIN)
        self.addCleanup(qm.close)
        hf = hf_model(fx.config, path=fx.bf16[w])
        qkeep.torch.patch(hf, qm)
        return hf, qm

    def test_every_weight_of_the_patched_model_is_qkeeps(self):
        for name, fx in self.fixtures.items():
            for scheme in SCHEMES:
                with self.subTest(model=name, scheme=scheme):
                    hf, qm = self.patched(fx, "w0", scheme)
                    self.assertEqual(qkeep.torch.foreign_tensors(hf, qm), [])
                    self.assertTrue(all(l.device == "cuda:0" for l in qm.layers()))
                    for key, p in qm.params().items():  # DLPack and the CUDA interface share the memory
                        self.assertEqual(p.__dlpack_device__(), (2, 0))
                        self.assertEqual(torch.from_dlpack(p).data_ptr(), p.data_ptr, key)
                        if p.dtype in ("F32", "F16", "I32", "U8"):
                            self.assertEqual(torch.as_tensor(p, device=DEVICE).data_ptr(), p.data_ptr, key)
                        self.assertFalse(hasattr(p, "__array_interface__"))

    def test_greedy_decode_agrees_with_the_bf16_model(self):
        for name, fx in self.fixtures.items():
            ref = hf_model(fx.config, path=fx.bf16["w0"])
            for scheme in SCHEMES:
                with self.subTest(model=name, scheme=scheme):
                    hf, _ = self.patched(fx, "w0", scheme)
                    ids = torch.tensor([[1, 17, 42, 99, 7, 300, 5, 12]], device=DEVICE)
                    worst, agree = 1.0, 0
                    for _ in range(STEPS):
                        want, got = logits(ref, ids)[0, -1], logits(hf, ids)[0, -1]
                        worst = min(worst, cosine(want, got))
                        agree += int(want.argmax() == got.argmax())
                        ids = torch.cat([ids, want.argmax().view(1, 1)], dim=1)  # the bf16 model's token
                    print("%s %s: %d steps, worst logit cosine %.5f, argmax agrees at %d of %d"
                          % (name, scheme, STEPS, worst, agree, STEPS))
                    self.assertGreaterEqual(worst, COSINE[scheme])

    def test_each_layer_matches_the_reference_backend(self):
        gen = torch.Generator(device=DEVICE).manual_seed(3)
        for name, fx in self.fixtures.items():
            for scheme in SCHEMES:
                with self.subTest(model=name, scheme=scheme), \
                        qkeep.load(fx.q("w0", scheme), backend=CHAIN) as gpu, \
                        qkeep.load(fx.q("w0", scheme), backend="reference") as ref:
                    for layer in gpu.layers():
                        if not layer.has_forward:
                            continue
                        r = ref.layer(layer.name)
                        calls = [{}] if layer.kind == "linear" else \
                            [dict(matrix=m, expert=e) for e in range(layer.experts) for m in ("w13", "w2")]
                        if layer.kind == "moe" and layer.routed:
                            calls.append("routed")
                        for kw in calls:
                            if kw == "routed":
                                self.check_routed(layer, r, gen)
                                continue
                            k = layer.n // 2 if kw.get("matrix") == "w2" else layer.k
                            x = (torch.rand(4, k, generator=gen, device=DEVICE) * 2 - 1).to(torch.bfloat16)
                            y = layer.forward(x, **kw).float().cpu()
                            want = torch.from_numpy(r.forward(x.float().cpu().numpy(), **kw))
                            self.assertLess(rel_error(y, want), LAYER_TOLERANCE, (layer.name, kw))

    def check_routed(self, layer, ref, gen):
        m, topk = 6, 2
        ids = torch.stack([torch.randperm(layer.experts, generator=gen, device=DEVICE)[:topk] for _ in range(m)])
        ids = ids.to(torch.int32)
        weights = torch.rand(m, topk, generator=gen, device=DEVICE)
        x = (torch.rand(m, layer.k, generator=gen, device=DEVICE) * 2 - 1).to(torch.bfloat16)
        y13 = layer.forward(x, matrix="w13", topk_ids=ids).float().cpu()
        want = torch.cat([torch.from_numpy(ref.forward(x[t:t + 1].float().cpu().numpy(), matrix="w13",
                                                       expert=int(ids[t, s]))) for t in range(m) for s in range(topk)])
        self.assertLess(rel_error(y13, want), LAYER_TOLERANCE, (layer.name, "routed w13"))
        x2 = (torch.rand(m * topk, layer.n // 2, generator=gen, device=DEVICE) * 2 - 1).to(torch.bfloat16)
        y2 = layer.forward(x2, matrix="w2", topk_ids=ids, topk_weights=weights).float().cpu()
        rows = [torch.from_numpy(ref.forward(x2[t * topk + s:t * topk + s + 1].float().cpu().numpy(), matrix="w2",
                                             expert=int(ids[t, s]))) * float(weights[t, s])
                for t in range(m) for s in range(topk)]
        want2 = torch.stack([sum(rows[t * topk:(t + 1) * topk])[0] for t in range(m)])
        self.assertLess(rel_error(y2, want2), LAYER_TOLERANCE, (layer.name, "routed w2"))

    def test_a_graph_replayed_after_a_reload_equals_a_cold_w1_graph(self):
        for name, fx in self.fixtures.items():
            for scheme in SCHEMES:
                with self.subTest(model=name, scheme=scheme):
                    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]], device=DEVICE)
                    hf0, qm0 = self.patched(fx, "w0", scheme)
                    graph0, out0 = self.capture(hf0, ids)
                    graph0.replay()
                    w0_logits = out0.clone()
                    qm0.reload(fx.q("w1", scheme))
                    graph0.replay()
                    hf1, _ = self.patched(fx, "w1", scheme)
                    graph1, out1 = self.capture(hf1, ids)
                    graph1.replay()
                    torch.cuda.synchronize()
                    self.assertTrue(torch.equal(out0, out1), "graph after reload != graph of a cold W1")
                    self.assertFalse(torch.equal(out0, w0_logits), "the reload changed nothing")
                    self.assertEqual(qkeep.torch.foreign_tensors(hf0, qm0), [])

    def capture(self, model, ids):
        """A CUDA graph of one forward step (after an eager warm-up that sizes the workspaces)."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                logits(model, ids)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="global"):
            out = logits(model, ids)
        return graph, out


if __name__ == "__main__":
    print("torch %s, transformers %s, %s" % (torch.__version__, transformers.__version__, torch.cuda.get_device_name()))
    unittest.main(verbosity=2)
