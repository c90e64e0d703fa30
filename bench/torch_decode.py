"""torch_decode: a transformers Llama-3-8B-shaped model (random bf16 weights, LAYERS decoder layers,
8 by default) quantized to NVFP4 by `qkeep quantize` and patched with qkeep.torch, against the same
model in bf16 in transformers, in the same run: one decode step (one new token per sequence, no KV
context: the linears' share of a decode step, which the weights' format changes) at batch 1, 8 and
64, eager and as a replayed CUDA graph. Prints one JSON line per (batch, mode) with tokens/s of both
and their ratio; never fails on a timing. Exits 0 with a "skipped" line where torch, transformers, a
CUDA device or the cuda-nvfp4 plugin is missing.

    torch_decode.py [LAYERS] [SCHEME]      (make bench-gpu runs it with the defaults)
"""

import json
import os
import subprocess
import sys
import tempfile
import time


def main():
    layers = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    scheme = sys.argv[2] if len(sys.argv) > 2 else "modelopt-nvfp4"
    try:
        import torch
        import transformers
        import qkeep
        import qkeep.torch
    except ImportError as e:
        print(json.dumps({"bench": "torch", "skipped": str(e)}))
        return 0
    if not torch.cuda.is_available():
        print(json.dumps({"bench": "torch", "skipped": "no CUDA device"}))
        return 0
    build = os.environ.get("QKEEP_TEST_BUILDDIR", ".")
    cli = os.path.join(build, "cli", "qkeep")
    config = transformers.LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                      num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8,
                                      head_dim=128, max_position_embeddings=8192, tie_word_embeddings=False)
    with tempfile.TemporaryDirectory(prefix="qkeep-bench-") as tmp:
        bf16_dir, q_dir = os.path.join(tmp, "bf16"), os.path.join(tmp, scheme)
        torch.manual_seed(0)
        with torch.device("cuda"):
            ref = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16,
                                                                attn_implementation="eager").eval()
        ref.save_pretrained(bf16_dir)
        t0 = time.perf_counter()
        subprocess.run([cli, "quantize", bf16_dir, q_dir, "--scheme", scheme], check=True, stdout=subprocess.DEVNULL)
        quantize_s = time.perf_counter() - t0
        model = qkeep.load(q_dir, backend="cuda-nvfp4")
        with torch.device("cuda"):  # its weights are replaced by qkeep's; its rotary buffers stay
            patched = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16,
                                                                    attn_implementation="eager").eval()
        qkeep.torch.patch(patched, model)
        print(json.dumps({"bench": "torch", "model": "llama-3-8b-shaped", "layers": layers, "scheme": scheme,
                          "quantize_seconds": round(quantize_s, 2), "device": torch.cuda.get_device_name()}))
        for batch in (1, 8, 64):
            ids = torch.randint(0, config.vocab_size, (batch, 1), device="cuda")
            for mode in ("eager", "graph"):
                t_ref = step_seconds(ref, ids, mode)
                t_q = step_seconds(patched, ids, mode)
                print(json.dumps({"bench": "torch", "batch": batch, "mode": mode,
                                  "bf16_tokens_per_s": round(batch / t_ref, 1),
                                  "qkeep_tokens_per_s": round(batch / t_q, 1),
                                  "ratio": round(t_ref / t_q, 3)}))
        model.close()
    return 0


def step_seconds(model, ids, mode, runs=20):
    import torch

    pos = torch.zeros_like(ids)
    # one position per sequence: nothing to mask; a 4-D mask made here keeps transformers from
    # building its own, which copies a host scalar (refused inside a graph capture)
    mask = torch.zeros((ids.shape[0], 1, ids.shape[1], ids.shape[1]), dtype=torch.bfloat16, device=ids.device)

    def step():
        return model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits

    with torch.no_grad():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(stream)
        run = step
        if mode == "graph":
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            run = graph.replay
        run()
        torch.cuda.synchronize()
        times = []
        for _ in range(runs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return times[len(times) // 2]


if __name__ == "__main__":
    sys.exit(main())
