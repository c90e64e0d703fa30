#!/usr/bin/env python3
"""peer_fp8.py: torch's fp8 GEMM, torch._scaled_mm, the second peer of bench/bench_nvfp4.

bench_nvfp4 runs it (with $QKEEP_BENCH_PYTHON) after timing qkeep on the same dense shapes.
W8A8 fp8 with per-tensor scales: e4m3 weights [N, K] (column-major operand, as _scaled_mm
wants it) and e4m3 activations [M, K], quantized once before timing (the activation's own
quantization is not timed), f32 scales, bf16 output. Timing as bench_nvfp4's: a CUDA graph of
back-to-back launches cycling through enough weight copies (>= --min-bytes) to stay out of
L2, the median of 7 graph replays after a warm-up. Prints one JSON object per shape and M,
or a single {"skipped": reason} line when torch, CUDA or fp8 is missing; an M that
_scaled_mm refuses is retried padded to a multiple of 16 ("padded_m").
"""
import argparse
import json
import math
import statistics
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="8192x8192", help="NxK,... (output features x input features)")
    ap.add_argument("--ms", default="1,16,64,256")
    ap.add_argument("--min-bytes", type=int, default=512 << 20, help="fp8 weight bytes to cycle through")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--min-launches", type=int, default=200)
    a = ap.parse_args()
    try:
        import torch
    except Exception as e:  # the column is reported as skipped, never a failure
        print(json.dumps({"bench": "fp8_scaled_mm", "skipped": "import torch failed: %s" % e}))
        return 0
    if not torch.cuda.is_available() or not hasattr(torch, "float8_e4m3fn"):
        print(json.dumps({"bench": "fp8_scaled_mm", "skipped": "torch %s: no CUDA device or no float8_e4m3fn"
                          % torch.__version__}))
        return 0
    torch.manual_seed(0)
    dev = torch.device("cuda")
    fp8 = torch.float8_e4m3fn
    fp8_max = torch.finfo(fp8).max
    for shape in a.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        copies = max(2, math.ceil(a.min_bytes / (n * k)))
        w_bf16 = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.05
        w_scale = (w_bf16.abs().max().float() / fp8_max).reshape(())
        w_fp8 = (w_bf16.float() / w_scale).clamp(-fp8_max, fp8_max).to(fp8)
        ws = [w_fp8.clone() for _ in range(copies)]
        del w_bf16
        for m in [int(v) for v in a.ms.split(",")]:
            x = torch.rand(m, k, device=dev, dtype=torch.bfloat16) * 2 - 1
            x_scale = (x.abs().max().float() / fp8_max).reshape(())
            x_fp8 = (x.float() / x_scale).clamp(-fp8_max, fp8_max).to(fp8)
            padded = None

            def gemm(c, xq):
                return torch._scaled_mm(xq, ws[c].t(), scale_a=x_scale, scale_b=w_scale, out_dtype=torch.bfloat16)

            try:
                y = gemm(0, x_fp8)
            except RuntimeError as e:
                padded = (m + 15) // 16 * 16
                xp = torch.cat([x, torch.zeros(padded - m, k, device=dev, dtype=torch.bfloat16)])
                x_fp8 = (xp.float() / x_scale).clamp(-fp8_max, fp8_max).to(fp8)
                try:
                    y = gemm(0, x_fp8)
                except RuntimeError as e2:
                    print(json.dumps({"bench": "fp8_scaled_mm", "M": m, "N": n, "K": k,
                                      "skipped": "%s; padded: %s" % (str(e).splitlines()[0],
                                                                     str(e2).splitlines()[0])}))
                    continue
            # Correctness against the bf16 product of the dequantised operands.
            ref = (x_fp8.float() * x_scale) @ (w_fp8.float() * w_scale).t()
            err = ((y.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
            passes = max(1, math.ceil(a.min_launches / copies))
            torch.cuda.synchronize()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for c in range(copies):  # warm-up outside the graph
                    gemm(c, x_fp8)
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(passes):
                    for c in range(copies):
                        gemm(c, x_fp8)
            graph.replay()
            torch.cuda.synchronize()
            times = []
            for _ in range(a.runs):
                start = torch.cuda.Event(enable_timing=True)
                stop = torch.cuda.Event(enable_timing=True)
                start.record()
                graph.replay()
                stop.record()
                stop.synchronize()
                times.append(start.elapsed_time(stop) * 1000.0 / (passes * copies))
            line = {"bench": "fp8_scaled_mm", "peer": "torch_scaled_mm_fp8", "M": m, "N": n, "K": k,
                    "fp8_us": round(statistics.median(times), 2), "max_rel_err": float("%.2e" % err),
                    "runs": a.runs, "launches": passes * copies, "copies": copies, "torch": torch.__version__,
                    "scales": "per-tensor", "method": "graph"}
            if padded:
                line["padded_m"] = padded
            print(json.dumps(line), flush=True)
            del graph
        del ws
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
