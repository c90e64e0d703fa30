#!/usr/bin/env python3
"""Draws the plots of docs/PERFORMANCE.md from the benchmarks' JSON lines in docs/results/.

    python3 docs/plot.py [RESULTS_DIR [OUT_DIR]]     (default: docs/results, docs)

Needs matplotlib (Debian 12: apt-get install python3-matplotlib). Writes three PNGs:
  perf-gemm-speedup.png  kernel time of each peer over qkeep's, against M (tokens), per kernel
  perf-reload.png        cold start and reload against a raw read of the same checkpoint
  perf-quantize.png      qkeep quantize's input rate against a raw read + write, per scheme
Every number comes from one JSON line of a file named below; nothing is typed in by hand.
"""
import json
import os
import statistics
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RESULTS = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "results")
OUT = sys.argv[2] if len(sys.argv) > 2 else os.path.dirname(os.path.abspath(__file__))

# The runs each plot shows: the latest complete run of each benchmark.
GPU_RUN = "bench-gpu-h200-2026-12-01-final.jsonl"  # make bench-gpu on one H200
NVFP4_H100_RUN = "nvfp4-h100-2026-12-07-dense.jsonl"  # bench_nvfp4 (dense part) on one H100, the latest kernels
INT8_RUN = "int8-container-2026-11-29-d.jsonl"  # bench_int8, 2-core AVX2 container, 2 threads
INT4_RUN = "int4-epyc-2026-12-07-t1-w4a16-permute.jsonl"  # bench_int4, AVX-512 VNNI EPYC, 1 thread
LOAD_H100_RUN = "load-h100-2026-12-07-e.jsonl"  # bench_load on one H100: 4 GB from page cache
RELOAD_CPU_RUN = "reload-container-2026-12-01.jsonl"  # bench_reload, reference backend
RELOAD_ONEDNN_RUN = "reload-onednn-colsums-2026-12-01.jsonl"  # bench_reload, cpu-onednn
SCALE_RUN = "scale-container-2026-12-01-b.jsonl"  # bench_scale, reference backend
QUANTIZE_RUNS = [("disk", "quantize-container-2026-12-01-disk.jsonl"),
                 ("tmpfs", "quantize-container-2026-12-01-tmpfs.jsonl")]


def lines(name, bench=None):
    """The JSON objects of one results file, those of one bench only when given."""
    out = []
    with open(os.path.join(RESULTS, name)) as f:
        for text in f:
            text = text.strip()
            if text.startswith("{"):
                d = json.loads(text)
                if bench is None or d.get("bench") == bench:
                    out.append(d)
    return out


def series(rows, key, value):
    """{M: [values]} over the rows for which key(row) is true."""
    by_m = {}
    for r in rows:
        if key(r):
            by_m.setdefault(r["M"], []).append(value(r))
    return by_m


def plot_band(ax, by_m, label, marker, color):
    """The median over shapes at each M, the range as a band."""
    ms = sorted(by_m)
    med = [statistics.median(by_m[m]) for m in ms]
    ax.plot(ms, med, marker=marker, color=color, label=label)
    ax.fill_between(ms, [min(by_m[m]) for m in ms], [max(by_m[m]) for m in ms], color=color, alpha=0.15)


def gemm_speedup():
    fig, (gpu, cpu) = plt.subplots(1, 2, figsize=(12, 4.6))
    nv = lines(GPU_RUN, "nvfp4_w4a16")
    mx = lines(GPU_RUN, "mxfp4_w4a16")
    fp8 = lines(GPU_RUN, "fp8_scaled_mm")
    plot_band(gpu, series(nv, lambda r: r["kernel"] == "stream", lambda r: r["ratio"]),
              "NVFP4, streaming kernel (cuda-nvfp4)", "o", "tab:blue")
    plot_band(gpu, series(nv, lambda r: r["kernel"] == "wgmma", lambda r: r["ratio"]),
              "NVFP4, wgmma kernel (cuda-nvfp4)", "s", "tab:purple")
    plot_band(gpu, series(mx, lambda r: True, lambda r: r["ratio"]), "MXFP4 (plugins/gpu, CUDA build)", "^",
              "tab:orange")
    h100 = lines(NVFP4_H100_RUN, "nvfp4_w4a16")
    plot_band(gpu, series(h100, lambda r: True, lambda r: r["ratio"]),
              "NVFP4 on an H100, later kernels (against its own cuBLAS)", "D", "tab:cyan")
    # torch's fp8 GEMM against the same run's cuBLAS bf16: the peer's own speed-up, for scale.
    cublas = {(r["M"], r["N"], r["K"]): r["peer_us"] for r in nv}
    plot_band(gpu, series(fp8, lambda r: (r["M"], r["N"], r["K"]) in cublas and "fp8_us" in r,
                          lambda r: cublas[(r["M"], r["N"], r["K"])] / r["fp8_us"]),
              "torch fp8 _scaled_mm (peer, W8A8)", "x", "tab:gray")
    gpu.axhline(1.0, color="black", linewidth=0.8)
    gpu.set_xscale("log", base=2)
    gpu.set_xlabel("M (tokens)")
    gpu.set_ylabel("cuBLAS bf16 time / kernel time")
    gpu.set_title("H200 and H100, W4A16 GEMM vs cuBLAS bf16\n(median of 3 shapes, band: min-max)")
    gpu.legend(fontsize=8)

    int8 = lines(INT8_RUN, "int8_linear")
    int4 = lines(INT4_RUN, "int4_linear")
    plot_band(cpu, series(int8, lambda r: True, lambda r: r["ratio"]),
              "cpu-onednn W8A8 int8 (AVX2, 2 threads)", "o", "tab:green")
    plot_band(cpu, series(int4, lambda r: r["mode"] == "da8w4", lambda r: r["dequant_f32_ratio"]),
              "cpu-zentorch GPTQ int4, da8w4 (AVX-512 VNNI, 1 thread)", "s", "tab:red")
    plot_band(cpu, series(int4, lambda r: r["mode"] == "w4a16", lambda r: r["dequant_f32_ratio"]),
              "cpu-zentorch GPTQ int4, w4a16 (AVX-512 VNNI, 1 thread)", "^", "tab:brown")
    cpu.axhline(1.0, color="black", linewidth=0.8)
    cpu.set_xscale("log", base=2)
    cpu.set_xlabel("M (tokens)")
    cpu.set_ylabel("oneDNN f32 time / kernel time")
    cpu.set_title("CPU linear layers vs oneDNN f32 (packed weights)\n(median of 3 shapes, band: min-max)")
    cpu.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(OUT, "perf-gemm-speedup.png"), dpi=100)
    plt.close(fig)


def reload_plot():
    groups = []  # (label, cold, reload, raw) in ms
    gpu = lines(GPU_RUN, "reload")[-1]
    groups.append(("cuda-nvfp4, H200\nNVFP4, %d layers, %.0f MB" % (gpu["layers"], gpu["checkpoint_bytes"] / 1e6),
                   gpu["cold_ms"], gpu["reload_ms"], gpu["raw_read_ms"]))
    h100 = lines(LOAD_H100_RUN, "load")[-1]
    groups.append(("cuda-nvfp4, H100\nNVFP4, %.1f GB" % (h100["bytes"] / 1e9), h100["cold_s"] * 1e3,
                   h100["reload_s"] * 1e3, h100["raw_read_s"] * 1e3))
    for r in lines(RELOAD_CPU_RUN, "reload"):
        if r["backend"] == "reference":
            groups.append(("reference, CPU\n%s, %.0f MB" % (r["scheme"], r["checkpoint_bytes"] / 1e6), r["cold_ms"],
                           r["reload_ms"], r["raw_read_ms"]))
    onednn = lines(RELOAD_ONEDNN_RUN, "reload")[-1]
    groups.append(("cpu-onednn, CPU\n%s, %.0f MB" % (onednn["scheme"], onednn["checkpoint_bytes"] / 1e6),
                   onednn["cold_ms"], onednn["reload_ms"], onednn["raw_read_ms"]))
    for r in lines(SCALE_RUN, "scale"):
        groups.append(("reference, CPU\n%s tensors (MoE)" % format(r["tensors"], ","), r["cold_s"] * 1e3,
                       r["reload_s"] * 1e3, r["raw_read_s"] * 1e3))
    fig, ax = plt.subplots(figsize=(13.5, 4.6))
    width = 0.27
    for i, (label, cold, reload, raw) in enumerate(groups):
        for j, (value, name, color) in enumerate([(raw, "raw read of W1 (peer)", "tab:gray"),
                                                  (cold, "cold start on W1", "tab:blue"),
                                                  (reload, "reload W0 -> W1 in place", "tab:green")]):
            bar = ax.bar(i + (j - 1) * width, value / raw, width, color=color, label=name if i == 0 else None)
            ax.bar_label(bar, labels=["%.0f ms" % value if value >= 10 else "%.1f ms" % value], fontsize=7)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([g[0] for g in groups], fontsize=8)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_ylabel("time / raw read of the same checkpoint")
    ax.set_title("Reload vs cold start vs a raw read of W1 (labels: medians in ms)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(OUT, "perf-reload.png"), dpi=100)
    plt.close(fig)


def quantize_plot():
    fig, axes = plt.subplots(1, len(QUANTIZE_RUNS), figsize=(12, 4.2), sharey=True)
    for ax, (medium, name) in zip(axes, QUANTIZE_RUNS):
        raw = lines(name, "quantize_raw")[0]["mb_per_s"] / 1e3
        rows = lines(name, "quantize")
        schemes = []
        for r in rows:
            if r["scheme"] not in schemes:
                schemes.append(r["scheme"])
        threads = sorted({r["threads"] for r in rows})
        width = 0.8 / len(threads)
        for j, t in enumerate(threads):
            rate = {r["scheme"]: r["mb_per_s"] / 1e3 for r in rows if r["threads"] == t}
            ax.bar([i + (j - (len(threads) - 1) / 2) * width for i in range(len(schemes))],
                   [rate[s] for s in schemes], width, label="%d thread%s" % (t, "s" if t > 1 else ""))
        ax.axhline(raw, color="black", linestyle="--", linewidth=1, label="raw read + write (peer)")
        ax.set_xticks(range(len(schemes)))
        ax.set_xticklabels(schemes, fontsize=8, rotation=15)
        ax.set_title("qkeep quantize, 1.16 GB bf16 model, %s" % medium)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("input GB/s")
    fig.tight_layout()
    fig.savefig(os.path.join(OUT, "perf-quantize.png"), dpi=100)
    plt.close(fig)


def main():
    gemm_speedup()
    reload_plot()
    quantize_plot()


if __name__ == "__main__":
    main()
