"""The qkeep Python package on the CPU: every example loads on the CPU chain, its census is the qkeep
command's, the forward agrees with the reference backend (and the reference with numpy), a reload
keeps every pointer and equals a cold W1, views share the params' memory, every failure is a
qkeep.Error naming its file, and 1,000 load/close cycles leak nothing."""

import ctypes
import gc
import os
import unittest
import weakref

import numpy as np

import qkeep
from qkeep import _dlpack, _lib
import qkeep_testutil as tu

HAVE_FORWARD = _lib.has("qkeep_layer_forward")
NEED_FORWARD = "this libqkeep has no qkeep_layer_forward yet"


def bf16_to_f32(u16):
    return (u16.astype(np.uint32) << 16).view(np.float32)


def rel_error(y, ref):
    y, ref = np.asarray(y, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    return float(np.max(np.abs(y - ref)) / max(np.max(np.abs(ref)), 1e-30))


class Base(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tu.TempDir()
        cls.dir = cls.tmp.__enter__()
        cls.chain = tu.cpu_chain()
        cls.config = tu.write_config(cls.dir, cls.chain)
        os.makedirs(os.path.join(cls.dir, "ref"))
        cls.ref_config = tu.write_config(os.path.join(cls.dir, "ref"), "reference")
        cls.schemes = tu.schemes()

    @classmethod
    def tearDownClass(cls):
        cls.tmp.__exit__(None, None, None)

    def load(self, name, config=None, **kw):
        m = qkeep.load(tu.example(name), config=config or self.config, **kw)
        self.addCleanup(m.close)
        return m


class TestLoad(Base):
    def test_the_package_is_the_build_trees(self):
        self.assertEqual(os.path.realpath(qkeep.library_path),
                         os.path.realpath(os.path.join(tu.BUILD, "libqkeep", ".libs", "libqkeep.so.0")))
        self.assertRegex(qkeep.version(), r"^\d+\.\d+\.\d+")

    @unittest.skipUnless(os.path.realpath(tu.SRC) == os.path.realpath(tu.BUILD), "the build tree is not the source tree")
    def test_imported_from_the_build_tree_it_finds_the_trees_library_and_config(self):
        import subprocess
        import sys
        env = {k: v for k, v in os.environ.items() if k not in ("QKEEP_LIBRARY", "QKEEP_CONFIG")}
        env["PYTHONPATH"] = os.path.join(tu.SRC, "python")
        run = subprocess.run([sys.executable, "-c", "import qkeep; print(qkeep.library_path); "
                              "print(qkeep.default_config())"], env=env, cwd="/", check=True,
                             stdout=subprocess.PIPE, universal_newlines=True)
        lib, config = run.stdout.split()
        self.assertTrue(os.path.samefile(lib, os.path.join(tu.BUILD, "libqkeep", ".libs", "libqkeep.so.0")), lib)
        self.assertTrue(os.path.samefile(config, os.path.join(tu.BUILD, "conf", "qkeep.ini")), config)

    def test_every_example_loads_on_the_cpu_chain_with_the_census_of_the_qkeep_command(self):
        names = ["tiny"] + ["tiny-" + s for s in self.schemes] + ["tiny-w1-" + s for s in self.schemes]
        self.assertGreaterEqual(len(self.schemes), 7, self.schemes)
        for name in names:
            with self.subTest(example=name):
                path = tu.example(name)
                with qkeep.load(path, config=self.config) as m:
                    got = m.census()
                    self.assertEqual(got, tu.cli_json(self.config, "census", path))
                    self.assertEqual((got["missing"], got["c1"], got["c2"]), (0, 0, 0))
                    self.assertEqual(len(m.layers()), got["layers"])

    def test_a_chain_string_overrides_the_configs_and_names_each_layers_owner(self):
        m = self.load("tiny-gptq-int4", backend="reference")
        self.assertEqual([b["name"] for b in m.backends()], ["reference"])
        self.assertTrue(all(l.backend == "reference" and l.device == "cpu" for l in m.layers()))
        c = m.census()
        self.assertEqual(c, tu.cli_json(self.ref_config, "census", tu.example("tiny-gptq-int4")))

    def test_layers_carry_name_scheme_kind_and_dims_as_the_cli_prints_them(self):
        m = self.load("tiny-mxfp4")
        owners = tu.cli_json(self.config, "census", tu.example("tiny-mxfp4"))["owners"]
        self.assertEqual([(l.name, l.scheme, l.kind, l.backend) for l in m.layers()],
                         [(o["layer"], o["scheme"], o["kind"], o["backend"]) for o in owners])
        kinds = {l.kind for l in m.layers()}
        self.assertTrue({"linear", "moe", "embedding"} <= kinds, kinds)
        qkv = m.layer("model.layers.0.self_attn.qkv_proj")
        self.assertEqual((qkv.n, qkv.k), (512, 256))
        self.assertEqual(qkv.device, "cpu")
        moe = [l for l in m.layers() if l.kind == "moe"][0]
        self.assertEqual(moe.experts, 4)

    def test_the_config_checkpoint_is_the_default(self):
        os.makedirs(os.path.join(self.dir, "ckpt"), exist_ok=True)
        cfg = tu.write_config(os.path.join(self.dir, "ckpt"), "reference",
                              "[model]\ncheckpoint = %s\n" % tu.example("tiny-awq-int4"))
        with qkeep.load(config=cfg) as m:
            self.assertEqual(m.checkpoint, tu.example("tiny-awq-int4"))
            self.assertEqual(m.census()["digest"], tu.cli_json(cfg, "census")["digest"])

    def test_a_parallel_place_loads_the_ranks_slice(self):
        m = self.load("tiny-gptq-int4", backend="reference", parallel={"tp_size": 2, "tp_rank": 1})
        self.assertEqual(m.layer("model.layers.0.self_attn.qkv_proj").n, 256)
        self.assertEqual(m.layer("model.layers.0.mlp.down_proj").k, 256)
        with self.assertRaises(qkeep.Error) as e:
            qkeep.load(tu.example("tiny"), backend="reference", parallel={"tp_ranks": 2})
        self.assertIn("tp_ranks", str(e.exception))

    def test_a_fusion_map_of_none_keeps_q_k_v_apart(self):
        m = self.load("tiny", backend="reference", fuse="none")
        names = {l.name for l in m.layers()}
        self.assertIn("model.layers.0.self_attn.q_proj", names)
        self.assertNotIn("model.layers.0.self_attn.qkv_proj", names)


class TestLayout(unittest.TestCase):
    def test_every_ctypes_struct_has_the_c_headers_offsets(self):
        import shutil
        import subprocess
        cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
        if not cc:
            self.skipTest("no C compiler")
        structs = {"qkeep_spec": _lib.Spec, "qkeep_view": _lib.View, "qkeep_layer_info": _lib.LayerInfo,
                   "qkeep_chain_info": _lib.ChainInfo, "qkeep_census": _lib.Census, "qkeep_digest": _lib.Digest,
                   "qkeep_parallel": _lib.Parallel, "qkeep_load_stats": _lib.LoadStats,
                   "qkeep_forward_args": _lib.ForwardArgs, "qkeep_layer_device": _lib.LayerDevice}
        lines = ['#include <stddef.h>', '#include <stdio.h>', '#include "qkeep/qkeep.h"', "int main(void) {"]
        for c, py in structs.items():
            for field, _ in py._fields_:
                lines.append('  printf("%s.%s %%zu\\n", offsetof(struct %s, %s));' % (c, field, c, field))
            lines.append('  printf("%s %%zu\\n", sizeof(struct %s));' % (c, c))
        lines.append("  return 0;\n}")
        with tu.TempDir() as d:
            src, exe = os.path.join(d, "layout.c"), os.path.join(d, "layout")
            with open(src, "w") as f:
                f.write("\n".join(lines))
            subprocess.run([cc, "-std=c11", "-I", os.path.join(tu.SRC, "include"), src, "-o", exe], check=True)
            out = subprocess.run([exe], check=True, stdout=subprocess.PIPE, universal_newlines=True).stdout
        want = dict(line.rsplit(" ", 1) for line in out.splitlines())
        for c, py in structs.items():
            for field, _ in py._fields_:
                self.assertEqual(getattr(py, field).offset, int(want["%s.%s" % (c, field)]), (c, field))
            self.assertEqual(ctypes.sizeof(py), int(want[c]), c)


class TestViews(Base):
    def test_a_numpy_view_is_the_params_memory_for_every_param_of_every_scheme(self):
        for name in ["tiny"] + ["tiny-" + s for s in self.schemes]:
            with self.subTest(example=name), qkeep.load(tu.example(name), config=self.config) as m:
                for layer in m.layers():
                    for pname, p in layer.params(buffers=True).items():
                        a = p.numpy()
                        self.assertEqual(a.ctypes.data, p.data_ptr, (layer.name, pname))
                        self.assertEqual(a.nbytes, p.nbytes, (layer.name, pname, p.dtype, p.shape))
                        self.assertEqual(a.__array_interface__["data"][0], p.data_ptr)

    def test_a_write_through_the_view_is_what_the_library_reads(self):
        m = self.load("tiny", backend="reference")
        p = m.lookup("model.norm.weight")
        a = p.numpy()
        self.assertEqual(a.dtype, np.uint16)  # bf16 storage
        before, digest = a.copy(), m.digest()
        a[:] = 0x4040  # 3.0 in bf16
        raw = ctypes.string_at(p.data_ptr, p.nbytes)  # read through the library's own pointer
        self.assertEqual(raw, np.full(a.shape, 0x4040, dtype="<u2").tobytes())
        self.assertNotEqual(m.digest(), digest)
        ctypes.memmove(p.data_ptr, before.ctypes.data, p.nbytes)  # and a write through C is in the view
        np.testing.assert_array_equal(a, before)
        self.assertEqual(m.digest(), digest)

    def test_dlpack_shares_the_memory_and_keeps_the_model_alive(self):
        m = qkeep.load(tu.example("tiny-w8a8-int8"), config=self.config)
        ref = weakref.ref(m)
        p = m.layer("model.layers.0.self_attn.attn").param("k_scale")
        self.assertEqual(p.__dlpack_device__(), (1, 0))
        exports = _dlpack.live_exports()
        a = np.from_dlpack(p)
        self.assertEqual(a.ctypes.data, p.data_ptr)
        self.assertEqual(a.dtype, np.float32)
        self.assertEqual(_dlpack.live_exports(), exports + 1)
        value = float(a)
        del m, p
        gc.collect()
        self.assertIsNotNone(ref(), "a DLPack view must keep its model")
        self.assertEqual(float(a), value)
        del a
        gc.collect()
        self.assertEqual(_dlpack.live_exports(), exports)
        self.assertIsNone(ref(), "the model outlived its last view")

    def test_a_numpy_view_keeps_the_model_alive_until_it_goes(self):
        m = qkeep.load(tu.example("tiny"), backend="reference", config=self.config)
        ref = weakref.ref(m)
        a = m.lookup("model.norm.weight").numpy()
        expect = a.copy()
        del m
        gc.collect()
        self.assertIsNotNone(ref())
        np.testing.assert_array_equal(a, expect)
        del a
        gc.collect()
        self.assertIsNone(ref())

    def test_an_unconsumed_capsule_lets_go_and_a_versioned_one_is_named_so(self):
        m = self.load("tiny", backend="reference")
        p = m.lookup("model.norm.weight")
        exports = _dlpack.live_exports()
        cap = p.__dlpack__()
        self.assertIn('"dltensor"', repr(cap))
        self.assertIn('"dltensor_versioned"', repr(p.__dlpack__(max_version=(1, 0))))  # dropped at once
        del cap
        gc.collect()
        self.assertEqual(_dlpack.live_exports(), exports)

    def test_every_param_lies_in_a_storage_of_the_model(self):
        m = self.load("tiny-ct-nvfp4")
        spans = [(a, c) for _, _, a, c in m.storages()]
        self.assertEqual(len(spans), len(set(spans)))
        for key, p in m.params().items():
            a = p.data_ptr
            self.assertTrue(any(lo <= a and a + p.nbytes <= lo + c for lo, c in spans), key)

    def test_host_params_have_no_cuda_interface(self):
        m = self.load("tiny", backend="reference")
        p = m.lookup("model.norm.weight")
        self.assertFalse(hasattr(p, "__cuda_array_interface__"))
        with self.assertRaises(qkeep.Error):
            p.__cuda_array_interface__


class TestReload(Base):
    def test_reload_keeps_every_pointer_and_equals_a_cold_w1_in_every_scheme(self):
        for scheme in self.schemes:
            with self.subTest(scheme=scheme):
                w0, w1 = tu.example("tiny-" + scheme), tu.example("tiny-w1-" + scheme)
                with qkeep.load(w0, config=self.config) as m, qkeep.load(w1, config=self.config) as cold:
                    params = m.params()
                    before = {k: p.data_ptr for k, p in params.items()}
                    views = {k: p.numpy() for k, p in params.items()}
                    d0 = m.digest()
                    m.reload(w1)
                    self.assertEqual({k: p.data_ptr for k, p in params.items()}, before)
                    self.assertEqual(m.digest(), cold.digest())
                    self.assertNotEqual(m.digest(), d0)
                    cold_params = cold.params()
                    for k, v in views.items():  # views taken on W0 now show W1's bytes
                        self.assertEqual(v.tobytes(), cold_params[k].numpy().tobytes(), k)
                    c, cc = m.census(), cold.census()
                    self.assertEqual(c, cc)

    def test_a_failed_reload_raises_names_the_file_and_keeps_w0(self):
        m = self.load("tiny-mxfp4")
        d0 = m.digest()
        bad = tu.example("tiny-w1-gptq-int4")
        with self.assertRaises(qkeep.Error) as e:
            m.reload(bad)
        self.assertIn("tiny-w1-gptq-int4", str(e.exception))
        self.assertEqual(m.digest(), d0)
        self.assertEqual(m.checkpoint, tu.example("tiny-mxfp4"))


class TestErrors(Base):
    def assertError(self, fn, *needles, code=None):
        with self.assertRaises(qkeep.Error) as e:
            fn()
        for n in needles:
            self.assertIn(n, str(e.exception))
        if code is not None:
            self.assertEqual(e.exception.code, code)
        self.assertLess(e.exception.code, 0)
        return e.exception

    def test_every_failure_is_a_qkeep_error_naming_its_file(self):
        missing = os.path.join(self.dir, "absent.safetensors")
        self.assertError(lambda: qkeep.load(missing, config=self.config), "absent.safetensors")
        self.assertError(lambda: qkeep.load(tu.example("tiny"), backend="no-such-backend", config=self.config),
                         "no-such-backend")
        bad = os.path.join(self.dir, "bad.ini")
        with open(bad, "w") as f:
            f.write("[qkeep]\nbackend = reference\nfrobnicate = 1\n")
        self.assertError(lambda: qkeep.load(tu.example("tiny"), config=bad), "bad.ini:3", code=_lib.E_CONFIG)
        self.assertError(lambda: qkeep.load(tu.example("tiny"), config=os.path.join(self.dir, "none.ini")),
                         "none.ini")
        junk = os.path.join(self.dir, "junk.safetensors")
        with open(junk, "wb") as f:
            f.write(b"\xff" * 64)
        self.assertError(lambda: qkeep.load(junk, backend="reference", config=self.config), "junk.safetensors")

    def test_a_library_others_may_write_is_refused(self):
        import shutil
        import subprocess
        import sys
        lib = os.path.join(self.dir, "libqkeep.so.0")
        shutil.copy(_lib.library_path, lib)
        os.chmod(lib, 0o666)
        env = dict(os.environ, QKEEP_LIBRARY=lib)
        run = subprocess.run([sys.executable, "-c", "import qkeep"], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, universal_newlines=True)
        self.assertNotEqual(run.returncode, 0)
        self.assertIn("QKEEP_LIBRARY=%s refused" % lib, run.stdout)
        self.assertIn("writable by its group or others", run.stdout)
        os.chmod(lib, 0o644)
        run = subprocess.run([sys.executable, "-c", "import qkeep; print(qkeep.library_path)"], env=env,
                             stdout=subprocess.PIPE, universal_newlines=True)
        self.assertEqual(run.stdout.strip(), lib)

    def test_online_quantization_equals_quantize_then_load_and_reloads_from_bf16(self):
        for scheme in ("w8a8-int8", "gptq-int4", "mxfp4", "modelopt-nvfp4"):
            with self.subTest(scheme=scheme):
                options = {"scheme": scheme, "kv_cache_scales": True, "activation_amax": 4.0, "threads": 2}
                with qkeep.load(tu.example("tiny"), config=self.config, quantize=options) as m:
                    self.assertEqual(m.quantize, scheme)
                    got, want = m.census(), tu.cli_json(self.config, "census", tu.example("tiny-" + scheme))
                    self.assertEqual(got["digest"], want["digest"])
                    self.assertEqual((got["quantized_on_load"], got["quantized_on_load_kept_bytes"]), (30, 0))
                    self.assertEqual(want["quantized_on_load"], 0)
                    p = m.lookup("model.layers.0.self_attn.q_proj.weight")
                    self.assertEqual((p.state, p.nbytes), ("quantized on load", 0))
                    m.reload(tu.example("tiny-w1"))
                    w1 = tu.cli_json(self.config, "census", tu.example("tiny-w1-" + scheme))
                    self.assertEqual(m.digest(), w1["digest"])
        self.assertError(lambda: qkeep.load(tu.example("tiny"), config=self.config, quantize="fp8"),
                         "fp8", code=_lib.E_UNSUPPORTED)
        self.assertError(lambda: qkeep.load(tu.example("tiny"), config=self.config,
                                            quantize={"scheme": "mxfp4", "bits": 3}), "bits", code=_lib.E_INVAL)

    def test_a_closed_model_and_unknown_names_raise(self):
        m = qkeep.load(tu.example("tiny"), backend="reference", config=self.config)
        layer = m.layer("model.norm")
        p = layer.param("weight")
        self.assertError(lambda: m.layer("model.nope"), "model.nope", code=_lib.E_NOTFOUND)
        self.assertError(lambda: m.lookup("model.nope.weight"), "model.nope.weight", code=_lib.E_NOTFOUND)
        self.assertError(lambda: layer.param("bias"), "model.norm", "bias")
        self.assertError(lambda: layer.forward(np.zeros((1, 256), np.float32)), "model.norm")
        m.close()
        m.close()  # a second close is nothing
        self.assertError(lambda: m.digest(), "closed", code=_lib.E_STATE)
        self.assertError(lambda: p.data_ptr, "closed", code=_lib.E_STATE)
        self.assertError(lambda: m.reload(tu.example("tiny-w1")), "closed")

    @unittest.skipUnless(HAVE_FORWARD, NEED_FORWARD)
    def test_a_forward_of_the_wrong_shape_or_dtype_names_the_layer(self):
        m = self.load("tiny", backend="reference")
        qkv = m.layer("model.layers.0.self_attn.qkv_proj")
        self.assertError(lambda: qkv.forward(np.zeros((2, 100), np.float32)), qkv.name, "[..., 256]")
        self.assertError(lambda: qkv.forward(np.zeros((2, 256), np.int32)), qkv.name, "int32")
        moe = [l for l in m.layers() if l.kind == "moe"][0]
        self.assertError(lambda: moe.forward(np.zeros((2, 256), np.float32)), moe.name, "matrix")
        self.assertError(lambda: moe.forward(np.zeros((2, 256), np.float32), matrix="w13", expert=99), moe.name)


@unittest.skipUnless(HAVE_FORWARD, NEED_FORWARD)
class TestForward(Base):
    def test_the_reference_forward_is_numpys_matmul_of_the_bf16_weights(self):
        m = self.load("tiny", backend="reference")
        rng = np.random.default_rng(1)
        for layer in m.layers():
            if layer.kind != "linear":
                continue
            with self.subTest(layer=layer.name):
                w = bf16_to_f32(layer.param("weight").numpy()).reshape(layer.n, layer.k)
                x = rng.uniform(-1, 1, (3, 2, layer.k)).astype(np.float32)
                y = layer.forward(x)
                self.assertEqual(y.shape, (3, 2, layer.n))
                self.assertEqual(y.dtype, np.float32)
                self.assertLess(rel_error(y, x @ w.T), 1e-5)
                out = np.empty((3, 2, layer.n), np.float32)
                self.assertIs(layer.forward(x, out=out), out)
                np.testing.assert_array_equal(out, y)

    def test_the_cpu_chain_forward_agrees_with_the_reference_backend_in_every_scheme(self):
        rng = np.random.default_rng(2)
        for scheme in self.schemes:
            with self.subTest(scheme=scheme), \
                    qkeep.load(tu.example("tiny-" + scheme), config=self.config) as m, \
                    qkeep.load(tu.example("tiny-" + scheme), backend="reference", config=self.config) as ref:
                for layer in m.layers():
                    r = ref.layer(layer.name)
                    if layer.kind == "linear" and layer.has_forward:
                        x = rng.uniform(-1, 1, (5, layer.k)).astype(np.float32)
                        self.assertLess(rel_error(layer.forward(x), r.forward(x)), 0.05, layer.name)
                        x16 = x.astype(np.float16)
                        y16 = layer.forward(x16)
                        self.assertEqual(y16.dtype, np.float16)
                        self.assertLess(rel_error(y16, r.forward(x)), 0.05, layer.name)
                    elif layer.kind == "moe" and layer.has_forward:
                        self.check_moe(layer, r, rng)

    def check_moe(self, layer, ref, rng):
        h, i2 = layer.k, layer.n
        for e in range(layer.experts):
            x = rng.uniform(-1, 1, (3, h)).astype(np.float32)
            y = layer.forward(x, matrix="w13", expert=e)
            self.assertEqual(y.shape, (3, i2))
            self.assertLess(rel_error(y, ref.forward(x, matrix="w13", expert=e)), 0.05, (layer.name, e))
            x2 = rng.uniform(-1, 1, (3, i2 // 2)).astype(np.float32)
            self.assertLess(rel_error(layer.forward(x2, matrix="w2", expert=e),
                                      ref.forward(x2, matrix="w2", expert=e)), 0.05, (layer.name, e))
        if layer.routed and ref.routed:
            m, topk = 4, 2
            ids = np.stack([rng.permutation(layer.experts)[:topk] for _ in range(m)]).astype(np.int32)
            weights = rng.uniform(0, 1, (m, topk)).astype(np.float32)
            x = rng.uniform(-1, 1, (m, h)).astype(np.float32)
            y13 = layer.forward(x, matrix="w13", topk_ids=ids)
            self.assertEqual(y13.shape, (m * topk, i2))
            self.assertLess(rel_error(y13, ref.forward(x, matrix="w13", topk_ids=ids)), 0.05)
            # routed w13's row (t, s) is expert ids[t, s]'s w13 on token t
            one = ref.forward(x[1:2], matrix="w13", expert=int(ids[1, 1]))
            self.assertLess(rel_error(y13[1 * topk + 1], one[0]), 0.05)
            x2 = rng.uniform(-1, 1, (m * topk, i2 // 2)).astype(np.float32)
            y2 = layer.forward(x2, matrix="w2", topk_ids=ids, topk_weights=weights)
            self.assertEqual(y2.shape, (m, h))
            self.assertLess(rel_error(y2, ref.forward(x2, matrix="w2", topk_ids=ids, topk_weights=weights)), 0.05)

    def test_after_a_reload_the_same_call_computes_with_w1(self):
        for scheme in self.schemes:
            with self.subTest(scheme=scheme), \
                    qkeep.load(tu.example("tiny-" + scheme), config=self.config) as m, \
                    qkeep.load(tu.example("tiny-w1-" + scheme), config=self.config) as cold:
                layer = m.layer("model.layers.1.mlp.down_proj")
                x = np.random.default_rng(3).uniform(-1, 1, (4, layer.k)).astype(np.float32)
                out = np.empty((4, layer.n), np.float32)
                layer.forward(x, out=out)
                y0 = out.copy()
                m.reload(tu.example("tiny-w1-" + scheme))
                layer.forward(x, out=out)
                np.testing.assert_array_equal(out, cold.layer(layer.name).forward(x))
                self.assertFalse(np.array_equal(out, y0))


class TestLeaks(Base):
    def test_a_thousand_load_close_cycles_leak_nothing(self):
        path = tu.example("tiny-mxfp4")

        def cycle():
            with qkeep.load(path, backend="reference", config=self.config) as m:
                p = m.lookup("model.norm.weight")
                p.numpy()
                m.layers()
                np.from_dlpack(m.layer("model.layers.0.self_attn.attn").param("k_scale"))

        for _ in range(100):  # the allocators' working set first
            cycle()
        gc.collect()
        start = tu.rss_bytes()
        for _ in range(900):
            cycle()
        gc.collect()
        grown = tu.rss_bytes() - start
        # a model holds about 1.5 MB: a leaked model per cycle would be 1.3 GB, a leaked Python
        # object graph per cycle some 900 x 10 KB
        self.assertLess(grown, 4 << 20, "RSS grew by %d bytes over 900 cycles" % grown)
        self.assertEqual(_dlpack.live_exports(), 0)


if __name__ == "__main__":
    unittest.main()
