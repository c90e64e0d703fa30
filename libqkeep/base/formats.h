/*
 * formats.h: the core's spellings of the decoders of the quantized element and scale formats
 * (docs/FORMATS.md). The one definition of each is in qkeep_backend_util.h, which backends
 * include; the core's encoders are in quant.h.
 */
#ifndef QKEEP_FORMATS_H
#define QKEEP_FORMATS_H

#include "base/numeric.h"
#include "qkeep/qkeep_backend_util.h"

#define qk_e2m1_decode qkeep_e2m1_to_f32
#define qk_fp4_code qkeep_fp4_code
#define qk_e4m3_decode qkeep_e4m3_to_f32
#define qk_e8m0_decode qkeep_e8m0_to_f32
#define qk_load_float qkeep_load_float
#define qk_nibble qkeep_int4_nibble
#define qk_gptq_zero qkeep_gptq_zero

#endif
