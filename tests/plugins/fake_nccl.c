/*
 * fake_nccl.c: a stand-in for libnccl.so.2 with NCCL's C entry points (as nccl.h declares
 * them), for testing qkeep's NCCL transport on machines without a GPU. Communicators of one
 * process share a hub; a broadcast on the root publishes its buffer and every other rank's
 * broadcast copies it (host memory), so ranks run one after another in one thread. It
 * records NCCL_NVLS_ENABLE as ncclCommInitRank saw it (fake_nccl_nvls).
 *
 * As NCCL's does, ncclGetUniqueId starts a "bootstrap root" thread that runs this library's
 * code until the ranks have joined (ncclCommInitRank), polling every millisecond (at most 5 s):
 * a caller that unloads the library while it runs crashes, as it would with the real one.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct {
  char internal[128];
} ncclUniqueId;
typedef int ncclResult_t;
enum { ncclSuccess = 0, ncclInvalidArgument = 4, ncclInvalidUsage = 5 };

struct comm {
  int rank, nranks;
};

static const void *published;
static size_t published_count;
static int open_comms;
static char nvls_seen[16] = "unset";

#define EXPORT __attribute__((visibility("default")))

/* nccl.h's declarations (and the test's probe) */
EXPORT const char *fake_nccl_nvls(void);
EXPORT ncclResult_t ncclGetUniqueId(ncclUniqueId *id);
EXPORT ncclResult_t ncclCommInitRank(void **comm, int nranks, ncclUniqueId id, int rank);
EXPORT ncclResult_t ncclBroadcast(const void *send, void *recv, size_t count, int datatype, int root,
                                  void *comm, void *stream);
EXPORT ncclResult_t ncclCommDestroy(void *comm);
EXPORT const char *ncclGetErrorString(ncclResult_t r);

EXPORT const char *fake_nccl_nvls(void) { return nvls_seen; }

static atomic_int joined; /* ranks that joined since the last unique id */

/* The bootstrap root: runs here until a rank has joined (NCCL's waits for every rank). */
static void *bootstrap_root(void *arg) {
  (void)arg;
  for (int ms = 0; ms < 5000 && atomic_load(&joined) == 0; ms++)
    nanosleep(&(struct timespec){0, 1000000}, NULL);
  return NULL;
}

EXPORT ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
  memset(id, 0, sizeof *id);
  memcpy(id->internal, "fake-nccl", 9);
  atomic_store(&joined, 0);
  pthread_t root;
  if (pthread_create(&root, NULL, bootstrap_root, NULL) != 0)
    return ncclInvalidUsage;
  pthread_detach(root);
  return ncclSuccess;
}

EXPORT ncclResult_t ncclCommInitRank(void **comm, int nranks, ncclUniqueId id, int rank) {
  if (memcmp(id.internal, "fake-nccl", 9) != 0 || rank < 0 || rank >= nranks)
    return ncclInvalidArgument;
  const char *v = getenv("NCCL_NVLS_ENABLE");
  strncpy(nvls_seen, v ? v : "unset", sizeof nvls_seen - 1);
  struct comm *c = malloc(sizeof *c);
  if (!c)
    return ncclInvalidUsage;
  c->rank = rank, c->nranks = nranks;
  open_comms++;
  atomic_fetch_add(&joined, 1);
  *comm = c;
  return ncclSuccess;
}

EXPORT ncclResult_t ncclBroadcast(const void *send, void *recv, size_t count, int datatype, int root,
                                  void *comm, void *stream) {
  struct comm *c = comm;
  (void)stream;
  if (datatype != 1 || root < 0 || root >= c->nranks)
    return ncclInvalidArgument;
  if (c->rank == root) {
    published = send, published_count = count;
    return ncclSuccess;
  }
  if (!published || published_count != count)
    return ncclInvalidUsage;
  memcpy(recv, published, count);
  return ncclSuccess;
}

EXPORT ncclResult_t ncclCommDestroy(void *comm) {
  free(comm);
  if (--open_comms == 0)
    published = NULL;
  return ncclSuccess;
}

EXPORT const char *ncclGetErrorString(ncclResult_t r) {
  return r == ncclSuccess ? "no error" : r == ncclInvalidArgument ? "invalid argument" : "invalid usage";
}
