#!/bin/sh
# check_rocm_codeobj.sh: what CI can check of rocm-mxfp4 without an AMD GPU.
#   - the gfx942 code object is there, for gfx942, and holds every kernel by name;
#   - its metadata: every kernel at most 64 KiB of LDS per workgroup, wavefront size 64, no
#     scratch (private segment 0, no VGPR or SGPR spills); the counts are printed;
#   - its disassembly: every GEMM kernel issues MFMA (bf16 kernels v_mfma_f32_16x16x16_bf16,
#     f16 kernels v_mfma_f32_16x16x16_f16) and no kernel has a scratch instruction;
#   - the plugin links no HIP library (libamdhip64 is dlopened at run time), holds the code
#     object, loads, and without an AMD GPU its probe says "no device".
set -eu
build=${QKEEP_TEST_BUILDDIR:?}
co=$build/plugins/rocm/mxfp4-gfx942.hsaco
so=$build/plugins/rocm/.libs/backend-rocm-mxfp4.so
readobj=${LLVM_READOBJ:?}
objdump=${LLVM_OBJDUMP:?}
fail() { echo "check_rocm_codeobj: $*" >&2; exit 1; }
test -s "$co" || fail "no code object at $co"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

"$readobj" --file-headers "$co" > "$tmp/headers"
grep -q 'EF_AMDGPU_MACH_AMDGCN_GFX942' "$tmp/headers" || fail "$co is not a gfx942 code object"
"$readobj" --notes "$co" > "$tmp/notes"
grep -q 'amdgcn-amd-amdhsa--gfx942' "$tmp/notes" || fail "no gfx942 target in the metadata"

kernels="mxfp4_k_gemm_bf16_t16 mxfp4_k_gemm_bf16_t32 mxfp4_k_gemm_bf16_t64 mxfp4_k_gemm_f16_t16
  mxfp4_k_gemm_f16_t32 mxfp4_k_gemm_f16_t64 mxfp4_k_reduce mxfp4_k_combine mxfp4_k_convert
  mxfp4_k_tile_codes mxfp4_k_tile_scales"
# One line per kernel from the metadata: name and the fields checked.
awk '
  /^ *- \.agpr_count:/ || /^ *- \.args:/ { if (name) print name, lds, priv, wave, vgpr, sgpr, agpr, vspill, sspill; name = ""; lds = priv = wave = vgpr = sgpr = agpr = vspill = sspill = "?" }
  /^ *-? *\.agpr_count:/ { agpr = $NF }
  /^ *\.group_segment_fixed_size:/ { lds = $NF }
  /^ *\.private_segment_fixed_size:/ { priv = $NF }
  /^ *\.wavefront_size:/ { wave = $NF }
  /^ *\.vgpr_count:/ { vgpr = $NF }
  /^ *\.sgpr_count:/ { sgpr = $NF }
  /^ *\.vgpr_spill_count:/ { vspill = $NF }
  /^ *\.sgpr_spill_count:/ { sspill = $NF }
  /^ *\.name:/ && $NF ~ /^mxfp4_k_/ { name = $NF }
  END { if (name) print name, lds, priv, wave, vgpr, sgpr, agpr, vspill, sspill }
' "$tmp/notes" > "$tmp/kernels"
"$objdump" -d "$co" > "$tmp/disasm"
for k in $kernels; do
  line=$(grep "^$k " "$tmp/kernels" || true)
  test -n "$line" || fail "kernel $k is not in the code object"
  set -- $line
  echo "$k: LDS $2 bytes, private $3, wave $4, VGPRs $5, SGPRs $6, AGPRs $7, spills $8 / $9"
  test "$2" -le 65536 || fail "$k: LDS $2 bytes > 64 KiB"
  test "$3" -eq 0 || fail "$k: private segment $3 bytes (scratch)"
  test "$4" -eq 64 || fail "$k: wavefront size $4"
  test "$8" -eq 0 && test "$9" -eq 0 || fail "$k: register spills ($8 VGPR, $9 SGPR)"
  awk -v f="<$k>:" '$2 == f { p = 1; next } /^[0-9a-f]+ <.*>:$/ { p = 0 } p' "$tmp/disasm" > "$tmp/$k.s"
  test -s "$tmp/$k.s" || fail "$k: no disassembly"
  if grep -q 'scratch_\|buffer_store' "$tmp/$k.s"; then fail "$k: scratch instructions"; fi
  case $k in
  *gemm_bf16*) n=$(grep -c 'v_mfma_f32_16x16x16_bf16' "$tmp/$k.s" || true) ;;
  *gemm_f16*) n=$(grep -c 'v_mfma_f32_16x16x16_f16' "$tmp/$k.s" || true) ;;
  *) n=- ;;
  esac
  if test "$n" != -; then
    test "$n" -gt 0 || fail "$k: no MFMA instruction"
    echo "$k: $n MFMA instructions"
  fi
done

test -f "$so" || fail "no plugin at $so"
if readelf -d "$so" | grep NEEDED | grep -q amdhip; then fail "$so links libamdhip64"; fi
size=$(stat -c %s "$co")
test "$(stat -c %s "$so")" -gt "$size" || fail "$so is smaller than the code object it embeds"
out=$(QKEEP_PLUGIN_PATH="$build/plugins/rocm/.libs" "$build/cli/qkeep" plugins 2>&1) || fail "qkeep plugins: $out"
echo "$out" | grep '^rocm-mxfp4 ' || fail "qkeep plugins does not list rocm-mxfp4: $out"
if ! ls /dev/kfd >/dev/null 2>&1; then
  echo "$out" | grep '^rocm-mxfp4 .*no device' >/dev/null || fail "no AMD GPU here, but the probe does not say no device: $out"
fi
echo "check_rocm_codeobj: code object and plugin checked"
