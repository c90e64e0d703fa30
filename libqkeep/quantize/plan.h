/*
 * quantize/plan.h: the offline quantizer's plan, kept past its checkpoint, and its one
 * quantization step, for loads that quantize as they go (online quantization, load/online.c).
 * The same code writes `qkeep quantize`'s files (quantize_model.c), so a model quantized on load
 * holds the bytes that quantizing to files and loading them gives.
 *
 * A plan is made from an unquantized checkpoint's header alone: every output tensor the
 * offline quantizer would write (name, spec; constants with their bytes), the units of work
 * (one quantized weight, or one NVFP4 fusion group whose members share a global scale), and
 * the config files it would write. A unit's run quantizes its members' source bytes into the
 * caller's destination buffers: the seam where a device kernel can take a scheme's unit later.
 */
#ifndef QKEEP_QUANT_PLAN_H
#define QKEEP_QUANT_PLAN_H

#include "format/checkpoint.h"

struct quant_plan;

/* The options a plan takes, checked as qkeep_quantize checks them (scheme, group size, activation amax,
 * threads), before any checkpoint is read. */
int quant_options_check(const struct qkeep_quantize_options *opts);

/* One output tensor of a plan. */
struct quant_output {
  const char *name; /* borrowed from the plan */
  struct qkeep_spec spec;
  size_t nbytes;
  const char *input;          /* the input it is made from (copied or quantized); NULL: a kv-cache scale */
  bool copied;                /* the input copied unchanged (same name, spec and bytes) */
  bool constant;              /* its bytes are known from the plan: value */
  const unsigned char *value; /* a constant's bytes (nbytes of them) */
  size_t unit;                /* a quantized output: its unit; SIZE_MAX otherwise */
  int member, slot;           /* its member in the unit and its place among the member's outputs */
};

/* One input of a unit: a 2-D float weight [n, k]. */
struct quant_member {
  const char *input; /* its checkpoint name, borrowed from the plan */
  enum qkeep_dtype dtype;
  int64_t n, k;
  size_t nbytes;
  int n_out;     /* its outputs, constants included */
  size_t out[4]; /* their indices in the plan */
};

/*
 * Plans the quantization of checkpoint ck (unquantized) with opts, as qkeep_quantize would
 * (the same checks and errors; out_dir-only fields are not read). The plan keeps no pointer into
 * ck. QKEEP_E_UNSUPPORTED for a scheme qkeep quantize does not write, QKEEP_E_INVAL for bad
 * options or an already quantized input, QKEEP_E_FORMAT for shapes the scheme cannot take.
 */
int quant_plan_new(const struct ckpt *ck, const struct qkeep_quantize_options *opts, struct quant_plan **out);
void quant_plan_free(struct quant_plan *p);
/* The plan's outputs, in the order qkeep quantize writes them. */
size_t quant_plan_outputs(const struct quant_plan *p);
void quant_plan_output(const struct quant_plan *p, size_t index, struct quant_output *out);
/* Quantized units (copies are not units here) and their members (1 to 3). */
size_t quant_plan_units(const struct quant_plan *p);
int quant_plan_members(const struct quant_plan *p, size_t unit);
void quant_plan_member(const struct quant_plan *p, size_t unit, int member, struct quant_member *out);
/* The config.json and hf_quant_config.json (NULL when the scheme writes none) texts qkeep quantize
 * writes for this plan (malloc'd). */
int quant_plan_configs(const struct quant_plan *p, char **config_json, char **hf_quant_json);
/* The threads a unit's run uses (the options' threads, or every online core). */
int quant_plan_threads(const struct quant_plan *p);
/*
 * A pool of threads that quantizes a plan's units for one load: the plan's threads less one, started
 * once (quant_pool_new) and stopped when the load ends (quant_pool_free), so that no unit pays for
 * starting threads. One thread (the load's) starts units and waits for them; several may be in flight
 * at once, their row blocks handed out in the order they were started, so the load can read the next
 * unit's bytes and land the last one's while the pool quantizes. The bytes do not depend on the number
 * of threads nor on which thread ran which block.
 */
struct quant_pool;
struct quant_job;
/* QKEEP_E_NOMEM. Fewer threads than asked when the system gives fewer (the waiting thread works too). */
int quant_pool_new(const struct quant_plan *p, struct quant_pool **out);
/* Stops the threads and frees the pool. Every job started must have been waited for. NULL: nothing. */
void quant_pool_free(struct quant_pool *pool);
/*
 * Starts quantizing one unit: src[m] holds member m's input bytes (host memory, its nbytes), dst[m][s]
 * gets the bytes of the member's slot-s output (host memory, its nbytes; NULL for a constant, whose
 * bytes the plan holds). Both stay the caller's and must stay valid, untouched, until quant_pool_wait
 * returns for *job. Returns QKEEP_E_NOMEM only when no job could be made (*job NULL); any other error,
 * of the setting up or of the run, comes from quant_pool_wait.
 */
int quant_pool_start(struct quant_pool *pool, size_t unit, const void *const *src, void *const (*dst)[4],
                     struct quant_job **job);
/*
 * Waits for a job to end (working on the pool's blocks meanwhile) and frees it; NULL: 0. QKEEP_E_INVAL
 * naming the input tensor, element, row and column for a NaN or Inf (nothing useful is in dst then);
 * QKEEP_E_NOMEM; the error detail is the calling thread's afterwards.
 */
int quant_pool_wait(struct quant_pool *pool, struct quant_job *job);
/* Waits for a job to end and frees it, its outcome dropped (a load giving up on a unit it read ahead):
 * the calling thread's error detail stays as it was. NULL: nothing. */
void quant_pool_discard(struct quant_pool *pool, struct quant_job *job);

/*
 * Quantizes one unit on a pool of its own (started and stopped here), for a caller outside a load (a
 * test checking a device's outputs against the host's): src and dst as quant_pool_start; QKEEP_E_INVAL
 * naming the input tensor, element, row and column for a NaN or Inf (nothing useful is in dst then);
 * QKEEP_E_NOMEM.
 */
int quant_plan_run(const struct quant_plan *p, size_t unit, const void *const *src, void *const (*dst)[4]);
/*
 * A device's share of a unit (the backend's quantize slot, ABI 1.5). The plan's scheme when a
 * device may quantize its units: "modelopt-nvfp4", "ct-nvfp4" or "mxfp4", whose members' slot 0
 * (codes) and slot 1 (block scales) a device writes; NULL for the other schemes.
 */
const char *quant_plan_device_scheme(const struct quant_plan *p);
/*
 * The rest of a unit whose codes and block scales a device wrote, from the amax of all its members
 * (as the device found it): NVFP4's global scale of each member into dst[m][2] (host memory),
 * exactly as quant_plan_run writes it; nothing for MXFP4. QKEEP_E_INVAL as quant_plan_run gives
 * for an amax whose global scale would be subnormal.
 */
int quant_plan_finish(const struct quant_plan *p, size_t unit, float amax, void *const (*dst)[4]);

#endif
