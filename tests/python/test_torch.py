"""qkeep.torch on the CPU, where torch is installed (skipped otherwise): zero-copy torch views, and
patch() on a torch module tree shaped and named as the example model's checkpoint (a Llama-style
decoder, one layer with a 4-expert MoE block of transformers 5's form: a router and a stacked
`experts` module)."""

import unittest

import numpy as np

import qkeep
from qkeep import _lib
import qkeep_testutil as tu

try:
    import torch
    from torch import nn
except ImportError:
    torch = None

HAVE_FORWARD = _lib.has("qkeep_layer_forward")


def tiny_module():
    """A module tree with the example's names and shapes (bf16): the patch's subject."""

    def linear(k, n):
        return nn.Linear(k, n, bias=False, dtype=torch.bfloat16)

    class Norm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(256, dtype=torch.bfloat16))

    class Router(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(4, 256, dtype=torch.bfloat16))

    class Experts(nn.Module):  # transformers 5's stacked experts
        def __init__(self):
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.zeros(4, 512, 256, dtype=torch.bfloat16))
            self.down_proj = nn.Parameter(torch.zeros(4, 256, 256, dtype=torch.bfloat16))
            self.act_fn = nn.functional.silu

    root = nn.Module()
    root.model = nn.Module()
    root.model.embed_tokens = nn.Embedding(1024, 256, dtype=torch.bfloat16)
    root.model.norm = Norm()
    root.model.layers = nn.ModuleList()
    for i in range(3):
        block = nn.Module()
        block.input_layernorm, block.post_attention_layernorm = Norm(), Norm()
        block.self_attn = nn.Module()
        for name, n in (("q_proj", 256), ("k_proj", 128), ("v_proj", 128)):
            setattr(block.self_attn, name, linear(256, n))
        block.self_attn.o_proj = linear(256, 256)
        block.mlp = nn.Module()
        if i == 2:
            block.mlp.gate, block.mlp.experts = Router(), Experts()
        else:
            block.mlp.gate_proj, block.mlp.up_proj, block.mlp.down_proj = linear(256, 512), linear(256, 512), \
                linear(512, 256)
        root.model.layers.append(block)
    root.lm_head = linear(256, 1024)
    return root


@unittest.skipIf(torch is None, "torch is not installed")
class TestTorch(unittest.TestCase):
    def setUp(self):
        import qkeep.torch as qt
        self.qt = qt
        self.model = qkeep.load(tu.example("tiny"), backend="reference")
        self.addCleanup(self.model.close)

    def test_a_torch_view_is_the_param(self):
        for key, p in self.model.params().items():
            t = self.qt.tensor(p)
            self.assertEqual(t.data_ptr(), p.data_ptr, key)
            self.assertEqual(tuple(t.shape), p.shape, key)
        w = self.qt.tensor(self.model.lookup("model.norm.weight"))
        self.assertEqual(w.dtype, torch.bfloat16)
        w[0] = 5.0  # a write through torch is the param's
        self.assertEqual(int(self.model.lookup("model.norm.weight").numpy()[0]), 0x40A0)

    def test_patch_replaces_the_linears_and_experts_and_views_every_other_weight(self):
        hf = tiny_module()
        done = self.qt.patch(hf, self.model)
        self.assertEqual(len(done.linears), 2 * 7 + 4 + 1)  # 7 per dense layer, q/k/v/o in the MoE one, lm_head
        self.assertEqual(done.experts, ["model.layers.2.mlp"])
        self.assertEqual(self.qt.foreign_tensors(hf, self.model), [])
        attn = hf.model.layers[0].self_attn
        self.assertIs(attn.q_proj.run, attn.v_proj.run)  # one fused qkv_proj run
        self.assertEqual([(m.start, m.stop) for m in (attn.q_proj, attn.k_proj, attn.v_proj)],
                         [(0, 256), (256, 384), (384, 512)])
        mlp = hf.model.layers[1].mlp
        self.assertEqual([(m.start, m.stop) for m in (mlp.gate_proj, mlp.up_proj)], [(0, 512), (512, 1024)])
        self.assertIsInstance(hf.model.layers[2].mlp.experts, self.qt.QkeepExperts)
        norm = self.model.lookup("model.norm.weight")
        self.assertEqual(hf.model.norm.weight.data_ptr(), norm.data_ptr)
        self.assertEqual(hf.model.embed_tokens.weight.data_ptr(), self.model.lookup("model.embed_tokens.weight").data_ptr)
        self.assertEqual(hf.model.layers[2].mlp.gate.weight.data_ptr(),
                         self.model.lookup("model.layers.2.mlp.gate.weight").data_ptr)

    def test_a_reload_updates_the_patched_modules_weights_in_place(self):
        hf = tiny_module()
        self.qt.patch(hf, self.model)
        before = {n: p.data_ptr() for n, p in hf.named_parameters()}
        self.model.reload(tu.example("tiny-w1"))
        with qkeep.load(tu.example("tiny-w1"), backend="reference") as cold:
            self.assertEqual({n: p.data_ptr() for n, p in hf.named_parameters()}, before)
            for name, p in hf.named_parameters():
                self.assertTrue(torch.equal(p, self.qt.tensor(cold.lookup(name)).view(p.shape)), name)

    def test_an_unfused_model_patches_each_projection_to_its_own_layer(self):
        with qkeep.load(tu.example("tiny"), backend="reference", fuse="none") as m:
            hf = tiny_module()
            done = self.qt.patch(hf, m)
            q = hf.model.layers[0].self_attn.q_proj
            self.assertEqual((q.qkeep_layer.name, q.start, q.stop), ("model.layers.0.self_attn.q_proj", 0, 256))
            self.assertEqual(len(done.linears), 19)
            self.assertEqual(self.qt.foreign_tensors(hf, m), [])

    def test_a_weight_qkeep_does_not_hold_is_an_error_naming_it(self):
        hf = tiny_module()
        hf.model.extra = nn.Linear(3, 3)
        with self.assertRaises(qkeep.Error) as e:
            self.qt.patch(hf, self.model)
        self.assertIn("model.extra", str(e.exception))

    @unittest.skipUnless(HAVE_FORWARD, "this libqkeep has no qkeep_layer_forward yet")
    def test_the_readme_example_runs_and_its_view_sees_w1(self):
        import os
        import textwrap
        with open(os.path.join(tu.SRC, "README.md")) as f:
            text = f.read()
        section = text[text.index("## From Python"):]
        block = section[section.index("\n\n    ") + 2:]
        block = textwrap.dedent(block[:block.index("\n\n")])
        self.assertIn("qkeep.load", block)
        cwd = os.getcwd()
        os.chdir(tu.BUILD)
        try:
            scope = {}
            exec(compile(block, "README.md", "exec"), scope)
        finally:
            os.chdir(cwd)
        model = scope["model"]
        self.addCleanup(model.close)
        self.assertEqual(scope["y"].shape, (4, 512))
        with qkeep.load(tu.example("tiny-w1-mxfp4"), backend="reference") as cold:
            self.assertTrue(torch.equal(scope["norm"], self.qt.tensor(cold.lookup("model.norm.weight"))))
        self.assertEqual(scope["norm"].data_ptr(), model.lookup("model.norm.weight").data_ptr)

    @unittest.skipUnless(HAVE_FORWARD, "this libqkeep has no qkeep_layer_forward yet")
    def test_the_patched_mlp_and_moe_compute_what_the_reference_layers_do(self):
        hf = tiny_module()
        self.qt.patch(hf, self.model)
        x = torch.rand(3, 256, dtype=torch.float32) * 2 - 1
        mlp = hf.model.layers[0].mlp
        with torch.no_grad():
            y = mlp.down_proj(nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
        gate_up = self.model.layer("model.layers.0.mlp.gate_up_proj").forward(x.numpy())
        h = gate_up[:, :512] / (1 + np.exp(-gate_up[:, :512])) * gate_up[:, 512:]
        want = self.model.layer("model.layers.0.mlp.down_proj").forward(h.astype(np.float32))
        np.testing.assert_allclose(y.numpy(), want, rtol=1e-4, atol=1e-4)
        experts = hf.model.layers[2].mlp.experts
        if experts.qkeep_layer.routed:
            ids = torch.tensor([[0, 3], [1, 2], [2, 0]])
            weights = torch.tensor([[0.7, 0.3], [0.5, 0.5], [0.9, 0.1]])
            with torch.no_grad():
                y = experts(x, ids, weights)
            layer = experts.qkeep_layer
            want = np.zeros((3, 256), np.float32)
            for t in range(3):
                for s in range(2):
                    g = layer.forward(x[t:t + 1].numpy(), matrix="w13", expert=int(ids[t, s]))
                    a = (g[:, :256] / (1 + np.exp(-g[:, :256])) * g[:, 256:]).astype(np.float32)
                    want[t] += float(weights[t, s]) * layer.forward(a, matrix="w2", expert=int(ids[t, s]))[0]
            np.testing.assert_allclose(y.numpy(), want, rtol=1e-3, atol=1e-3)


if __name__ == "__main__":
    unittest.main()
