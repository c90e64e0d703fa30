#!/usr/bin/env python3
"""peer_torch.py: PyTorch's int8 dynamic-quantized linear, the peer of bench/bench_int8.

bench_int8 runs it (with the system's /usr/bin/python3, where Debian's
python3-torch lives) for one K x N after measuring qkeep on the same shape.
Weights: `copies` quantized nn.Linear modules, cycled so that together they
exceed the last-level cache (as decode reads every weight once per token).
Prints one JSON object per M: the median of the timed runs after warm-up;
or a single {"skipped": reason} line when torch cannot be imported.
"""
import argparse
import json
import math
import statistics
import sys
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, required=True)
    ap.add_argument("--n", type=int, required=True)
    ap.add_argument("--ms", default="1,16,128,512")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--min-bytes", type=int, default=64 << 20, help="int8 weight bytes to cycle through")
    ap.add_argument("--seconds", type=float, default=1.0, help="time budget per M after warm-up")
    a = ap.parse_args()
    try:
        import torch
        from torch.ao.quantization import quantize_dynamic
    except Exception as e:  # the column is reported as skipped, never a failure
        print(json.dumps({"peer": "torch_int8_dynamic", "skipped": "import torch failed: %s" % e}))
        return 0
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    copies = max(2, math.ceil(a.min_bytes / (a.k * a.n)))
    mods = []
    with torch.inference_mode():
        for _ in range(copies):
            lin = torch.nn.Sequential(torch.nn.Linear(a.k, a.n, bias=False))
            mods.append(quantize_dynamic(lin, {torch.nn.Linear}, dtype=torch.qint8))
        for m in [int(v) for v in a.ms.split(",")]:
            x = torch.rand(m, a.k) * 2 - 1
            for i in range(3):
                mods[i % copies](x)
            t0 = time.perf_counter()
            mods[0](x)
            estimate = time.perf_counter() - t0
            runs = max(5, min(200, int(a.seconds / max(estimate, 1e-6))))
            times = []
            for i in range(runs):
                t0 = time.perf_counter()
                mods[i % copies](x)
                times.append(time.perf_counter() - t0)
            print(json.dumps({"peer": "torch_int8_dynamic", "M": m, "K": a.k, "N": a.n,
                              "torch_us": round(statistics.median(times) * 1e6, 1), "runs": runs,
                              "copies": copies, "threads": a.threads, "torch": torch.__version__,
                              "engine": torch.backends.quantized.engine}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
