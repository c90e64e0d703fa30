/*
 * nccl.c: the NCCL broadcast transport for weight sync. libnccl is dlopened at run time
 * (the caller's path, else $QKEEP_NCCL_LIBRARY, else libnccl.so.2 through ld.so's search), so
 * qkeep links no CUDA library and builds everywhere; the few entry points and types used are
 * declared here from NCCL's documented C API (nccl.h): ncclGetUniqueId, ncclCommInitRank,
 * ncclBroadcast, ncclCommDestroy, ncclGetErrorString. A path is trusted as a plugin's is
 * (check_trusted: owner and write bits of the resolved file and of every directory above it), and the
 * environment's is ignored in a set-id process.
 *
 * NCCL's configuration is the caller's: the library never sets an environment variable. Where
 * NVLink multicast (NVLS) must stay off, the caller sets NCCL_NVLS_ENABLE=0 before its first
 * NCCL call (NCCL reads its environment once). ncclConfig_t (ncclCommInitRankConfig) has no
 * switch for it before NCCL 2.31's nvlsHostMode, and this transport takes whichever libnccl.so.2
 * the caller has (it declares only what every NCCL 2 has), so there is no other way to pass it.
 *
 * Once opened, libnccl stays loaded until the process ends (RTLD_NODELETE): NCCL runs code of
 * its own after the call that started it returns (ncclGetUniqueId's bootstrap root thread waits
 * for the ranks to join; its static CUDA runtime leaves handlers with the driver), so a dlclose
 * that unmapped it - after the unique id, or after the last communicator - left that code
 * running in unmapped memory, and a later sync in the same process crashed.
 */
#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "reload/reload.h"

/* From nccl.h: the result codes are an int enum (ncclSuccess 0), the unique id is 128 bytes
 * passed by value, ncclUint8 is 1, a communicator and a CUDA stream are opaque pointers. */
#define NCCL_UNIQUE_ID_BYTES 128
typedef struct {
  char internal[NCCL_UNIQUE_ID_BYTES];
} nccl_unique_id;
typedef int nccl_result;
typedef void *nccl_comm;
enum { NCCL_SUCCESS = 0, NCCL_UINT8 = 1 };

struct nccl_api {
  void *handle;
  const char *path;
  nccl_result (*get_unique_id)(nccl_unique_id *id);
  nccl_result (*comm_init_rank)(nccl_comm *comm, int nranks, nccl_unique_id id, int rank);
  nccl_result (*broadcast)(const void *send, void *recv, size_t count, int datatype, int root, nccl_comm comm,
                           void *stream);
  nccl_result (*comm_destroy)(nccl_comm comm);
  const char *(*error_string)(nccl_result result);
};

/* Whether the file at path exists (a missing one is dlopen's to report, as "cannot load"). */
static bool file_exists(const char *path) {
  struct stat sb;
  return stat(path, &sb) == 0;
}

/* Loads libnccl and its entry points. */
static int nccl_open(const char *library, struct nccl_api *api) {
  const char *env = library || environment_untrusted() ? NULL : getenv("QKEEP_NCCL_LIBRARY");
  const char *path = library ? library : env && *env ? env : "libnccl.so.2";
  /* A bare name is ld.so's to find (its own trusted search); a path is checked as a plugin's. */
  if (strchr(path, '/') && file_exists(path)) {
    int rc = check_trusted(path, "NCCL library");
    if (rc)
      return add_error_context(rc, "NCCL transport%s",
                               library       ? ""
                               : env && *env ? " (QKEEP_NCCL_LIBRARY)"
                                             : "");
  }
  *api = (struct nccl_api){.handle = dlopen(path, RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE), .path = path};
  if (!api->handle)
    return set_error(QKEEP_E_NOTFOUND,
                     "NCCL transport: cannot load %s: %s (install NCCL, or point QKEEP_NCCL_LIBRARY or "
                     "LD_LIBRARY_PATH at PyTorch's nvidia/nccl/lib)",
                     path, dlerror());
  static const char *const names[] = {"ncclGetUniqueId", "ncclCommInitRank", "ncclBroadcast",
                                      "ncclCommDestroy", "ncclGetErrorString"};
  void *syms[5];
  for (int i = 0; i < 5; i++)
    if (!(syms[i] = dlsym(api->handle, names[i]))) {
      int rc = set_error(QKEEP_E_PLUGIN, "NCCL transport: %s has no %s: %s", path, names[i], dlerror());
      dlclose(api->handle);
      api->handle = NULL;
      return rc;
    }
  /* POSIX: a dlsym result converts to a function pointer through memcpy of the same size. */
  memcpy(&api->get_unique_id, &syms[0], sizeof syms[0]);
  memcpy(&api->comm_init_rank, &syms[1], sizeof syms[1]);
  memcpy(&api->broadcast, &syms[2], sizeof syms[2]);
  memcpy(&api->comm_destroy, &syms[3], sizeof syms[3]);
  memcpy(&api->error_string, &syms[4], sizeof syms[4]);
  return 0;
}

static int nccl_fail(const struct nccl_api *api, nccl_result r, const char *what) {
  return set_error(QKEEP_E_DEVICE, "NCCL transport: %s failed: %s (%d; %s)", what, api->error_string(r), r,
                   api->path);
}

int qkeep_nccl_unique_id(const char *library, unsigned char unique_id[128]) {
  if (!unique_id)
    return set_error(QKEEP_E_INVAL, "qkeep_nccl_unique_id: NULL argument");
  struct nccl_api api;
  int rc = nccl_open(library, &api);
  if (rc)
    return rc;
  nccl_unique_id id;
  nccl_result r = api.get_unique_id(&id);
  if (r == NCCL_SUCCESS)
    memcpy(unique_id, id.internal, NCCL_UNIQUE_ID_BYTES);
  else
    rc = nccl_fail(&api, r, "ncclGetUniqueId");
  dlclose(api.handle);
  return rc;
}

struct nccl_transport {
  struct nccl_api api;
  nccl_comm comm;
  int ranks, rank;
  struct qkeep_transport tr;
};

static int nccl_bcast(void *ctx, void *buf, size_t nbytes, int root) {
  struct nccl_transport *t = ctx;
  if (root < 0 || root >= t->ranks)
    return set_error(QKEEP_E_INVAL, "NCCL broadcast: root %d of %d ranks", root, t->ranks);
  /* In place (send == recv on the root), bytes as uint8, on the default stream: the caller
   * synchronises the device before it reads the buffer (qkeep_sync_receive does). */
  nccl_result r = t->api.broadcast(buf, buf, nbytes, NCCL_UINT8, root, t->comm, NULL);
  return r == NCCL_SUCCESS ? 0 : nccl_fail(&t->api, r, "ncclBroadcast");
}

static void nccl_close(void *ctx) {
  struct nccl_transport *t = ctx;
  if (t->comm)
    t->api.comm_destroy(t->comm);
  dlclose(t->api.handle);
  free(t);
}

int qkeep_transport_nccl(const char *library, int ranks, int rank, const unsigned char unique_id[128],
                         struct qkeep_transport **out) {
  if (!unique_id || !out || ranks < 1 || rank < 0 || rank >= ranks)
    return set_error(QKEEP_E_INVAL, "qkeep_transport_nccl: rank %d of %d, or a NULL argument", rank, ranks);
  struct nccl_transport *t = calloc(1, sizeof *t);
  if (!t)
    return set_error(QKEEP_E_NOMEM, "out of memory");
  int rc = nccl_open(library, &t->api);
  if (rc) {
    free(t);
    return rc;
  }
  nccl_unique_id id;
  memcpy(id.internal, unique_id, NCCL_UNIQUE_ID_BYTES);
  nccl_result r = t->api.comm_init_rank(&t->comm, ranks, id, rank);
  if (r != NCCL_SUCCESS) {
    rc = nccl_fail(&t->api, r, "ncclCommInitRank");
    t->comm = NULL;
    nccl_close(t);
    return rc;
  }
  t->ranks = ranks, t->rank = rank;
  t->tr = (struct qkeep_transport){sizeof t->tr, "nccl", t, nccl_bcast, nccl_close};
  *out = &t->tr;
  return 0;
}
