/*
 * synth_moe.h: synthetic ModelOpt NVFP4 checkpoints with Qwen3-MoE naming at
 * toy dimensions, for tests and benchmarks that need many tensors.
 */
#ifndef QKEEP_SYNTH_MOE_H
#define QKEEP_SYNTH_MOE_H

#include <stddef.h>
#include <stdint.h>

/* Tensors a checkpoint of `layers` decoder layers with `experts` experts each holds. */
size_t synth_moe_tensors(int layers, int experts);
/*
 * Writes DIR/model.safetensors, DIR/config.json and DIR/hf_quant_config.json (DIR must
 * exist): embed_tokens, norm and an unquantized lm_head (excluded), and per decoder layer
 * q/k/v/o_proj, q_norm, k_norm, the two layer norms, the router mlp.gate (excluded by a
 * glob) and per expert gate/up/down_proj, each NVFP4 linear as weight, weight_scale,
 * weight_scale_2 and input_scale (hidden 32, expert intermediate 16). `seed` picks the
 * values (valid scales). shards > 1 splits the layers over that many files with a
 * model.safetensors.index.json (a safetensors header may not pass 100 MB: 10^6 tensors
 * need several). 0, or a negative QKEEP_E_* code with the detail set.
 */
int synth_moe_write(const char *dir, int layers, int experts, int shards, uint64_t seed);

#endif
