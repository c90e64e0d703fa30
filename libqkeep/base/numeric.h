/*
 * numeric.h: the core's spellings of the conversions between f32 and the 16-bit float
 * formats. The one definition of each is in qkeep_backend_util.h, which backends include.
 */
#ifndef QKEEP_NUMERIC_H
#define QKEEP_NUMERIC_H

#include "qkeep/qkeep_backend_util.h"

#define qk_f32_bits qkeep_f32_bits
#define qk_bits_f32 qkeep_bits_f32
#define qk_bf16_to_f32 qkeep_bf16_to_f32
#define qk_f32_to_bf16 qkeep_f32_to_bf16
#define qk_f16_to_f32 qkeep_f16_to_f32
#define qk_f32_to_f16 qkeep_f32_to_f16

#endif
