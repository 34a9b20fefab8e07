/* The copy agent: host-tier experts copied to VRAM by the copy engine, on the device's demand.
 *
 * A decode step captured as a CUDA graph picks its experts on the device, so it cannot aim a copy
 * at them; it reads the host tier in place through the SMs instead (~36-41 GB/s on an H100/H200
 * host), which leaves the copy engine (~52 GB/s) idle. This thread aims it: the device posts a
 * layer's list of host slots to copy (split_publish_kernel, inference/kernels/handoff_triton.py),
 * the agent issues one host-to-device copy per object into a VRAM scratch slot on its own stream,
 * then a 32-bit write of the job's mark into device memory after them on that stream
 * (cuStreamWriteValue32, which by default waits for the copies' writes to be visible); the
 * device's copy_wait_kernel spins until it sees the mark and the GEMVs of those experts then read
 * the scratch slots.
 *
 * Mailbox (int64 words, page-locked and mapped): the ticket (word 0, written last by the device,
 * system-scope release), the copy count (word 16), the host slot of scratch slot i at word 24 + i.
 * Mark (int32 in device memory): (ticket & MARK_MASK) once the copies of that ticket landed,
 * (ticket & MARK_MASK) | MARK_REFUSED when the job was malformed (a slot outside the host tier, a
 * count above the scratch's slots) or a CUDA call failed; the device then counts a miss and the
 * step is redone on the acquire path.
 *
 * Without CUDA (tests, the triton interpreter) the same thread copies with memcpy into a host
 * scratch and stores the mark with a release store: the protocol is the same.
 *
 * libcuda is opened at run time (dlopen): the library builds and loads on machines without it.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "mailbox_wait.h"  /* now_ns, next_ticket */

enum { W_TICKET = 0, W_COUNT = 16, W_SLOTS = 24 };
#define MARK_MASK 0x3FFFFFFF
#define MARK_REFUSED 0x40000000

typedef int (*cu_init_t)(unsigned);
typedef int (*cu_device_get_t)(int *, int);
typedef int (*cu_primary_retain_t)(void **, int);
typedef int (*cu_primary_release_t)(int);
typedef int (*cu_ctx_set_t)(void *);
typedef int (*cu_memcpy_htod_t)(uint64_t, const void *, size_t, void *);
typedef int (*cu_write_value32_t)(void *, uint64_t, uint32_t, unsigned);

typedef struct {
    volatile int64_t *box;
    int64_t max_copies;
    const uint8_t *host;
    int64_t host_slots, slot_bytes;
    uint64_t scratch, mark;  /* device addresses (host addresses without CUDA) */
    int device;              /* CUDA device ordinal, or -1: host memory, memcpy */
    int cu_device;           /* its CUdevice handle */
    void *stream;            /* the CUDA stream the copies and marks go on (the caller's, kept alive) */
    void *libcuda, *context;
    cu_primary_release_t primary_release;
    cu_ctx_set_t ctx_set;
    cu_memcpy_htod_t memcpy_htod;
    cu_write_value32_t write_value32;
    int64_t start_ticket;
    pthread_t thread;
    int started;
    _Atomic int stop;
    _Atomic int64_t jobs, refused, copies, cuda_error;  /* cuda_error: the first failing call's code */
} agent_t;

static int open_cuda(agent_t *a) {
    a->libcuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (a->libcuda == NULL) return -1;
    cu_init_t init = (cu_init_t)dlsym(a->libcuda, "cuInit");
    cu_device_get_t device_get = (cu_device_get_t)dlsym(a->libcuda, "cuDeviceGet");
    cu_primary_retain_t retain = (cu_primary_retain_t)dlsym(a->libcuda, "cuDevicePrimaryCtxRetain");
    a->primary_release = (cu_primary_release_t)dlsym(a->libcuda, "cuDevicePrimaryCtxRelease_v2");
    a->ctx_set = (cu_ctx_set_t)dlsym(a->libcuda, "cuCtxSetCurrent");
    a->memcpy_htod = (cu_memcpy_htod_t)dlsym(a->libcuda, "cuMemcpyHtoDAsync_v2");
    a->write_value32 = (cu_write_value32_t)dlsym(a->libcuda, "cuStreamWriteValue32_v2");
    if (a->write_value32 == NULL) a->write_value32 = (cu_write_value32_t)dlsym(a->libcuda, "cuStreamWriteValue32");
    if (!init || !device_get || !retain || !a->primary_release || !a->ctx_set || !a->memcpy_htod || !a->write_value32)
        return -2;
    int rc;
    if ((rc = init(0)) != 0 || (rc = device_get(&a->cu_device, a->device)) != 0 ||
        (rc = retain(&a->context, a->cu_device)) != 0)
        return rc;
    return 0;
}

static void note_error(agent_t *a, int rc) {
    int64_t none = 0;
    atomic_compare_exchange_strong(&a->cuda_error, &none, (int64_t)rc);
}

static void put_mark(agent_t *a, uint32_t value) {
    if (a->device < 0) {
        __atomic_store_n((uint32_t *)(uintptr_t)a->mark, value, __ATOMIC_RELEASE);
        return;
    }
    const int rc = a->write_value32(a->stream, a->mark, value, 0);  /* 0: after the copies' writes */
    if (rc != 0) note_error(a, rc);
}

/* Issue the copies of `ticket`'s job and the mark after them. */
static void serve(agent_t *a, int64_t ticket) {
    const uint32_t mark = (uint32_t)(ticket & MARK_MASK);
    const int64_t count = a->box[W_COUNT];
    int ok = count >= 0 && count <= a->max_copies;
    for (int64_t i = 0; ok && i < count; i++) ok = a->box[W_SLOTS + i] >= 0 && a->box[W_SLOTS + i] < a->host_slots;
    if (!ok) {
        atomic_fetch_add(&a->refused, 1);
        put_mark(a, mark | MARK_REFUSED);
        return;
    }
    for (int64_t i = 0; i < count; i++) {
        const uint8_t *source = a->host + a->box[W_SLOTS + i] * a->slot_bytes;
        const uint64_t target = a->scratch + (uint64_t)(i * a->slot_bytes);
        if (a->device < 0) {
            memcpy((void *)(uintptr_t)target, source, (size_t)a->slot_bytes);
            continue;
        }
        const int rc = a->memcpy_htod(target, source, (size_t)a->slot_bytes, a->stream);
        if (rc != 0) {
            note_error(a, rc);
            atomic_fetch_add(&a->refused, 1);
            put_mark(a, mark | MARK_REFUSED);
            return;
        }
    }
    /* counted before the mark: a caller that has seen the mark reads the job counted */
    atomic_fetch_add(&a->jobs, 1);
    atomic_fetch_add(&a->copies, count);
    put_mark(a, mark);
}

static void *agent_main(void *arg) {
    agent_t *a = arg;
    if (a->device >= 0) {
        const int rc = a->ctx_set(a->context);
        if (rc != 0) {
            note_error(a, rc);
            return NULL;  /* no job is served: the device's waits time out, the steps are redone */
        }
    }
    int64_t last = a->start_ticket, idle_since = now_ns();
    for (;;) {
        const int64_t ticket = next_ticket(&a->box[W_TICKET], last, idle_since, &a->stop);
        if (ticket == last) return NULL;  /* stopped */
        last = ticket;
        serve(a, ticket);
        idle_since = now_ns();
    }
}

/* device: a CUDA ordinal (scratch and mark device addresses, stream a CUstream of that device), or
 * -1 (host addresses, memcpy). NULL when an argument is malformed or libcuda cannot be used. */
agent_t *copy_agent_create(int64_t *box, int64_t max_copies, const uint8_t *host, int64_t host_slots,
                           int64_t slot_bytes, uint64_t scratch, uint64_t mark, int device, void *stream,
                           int *error) {
    *error = 0;
    if (max_copies < 1 || host_slots < 1 || slot_bytes < 1 || box == NULL || host == NULL) {
        *error = -3;
        return NULL;
    }
    agent_t *a = calloc(1, sizeof(agent_t));
    if (a == NULL) return NULL;
    *a = (agent_t){.box = box, .max_copies = max_copies, .host = host, .host_slots = host_slots,
                   .slot_bytes = slot_bytes, .scratch = scratch, .mark = mark, .device = device, .stream = stream};
    if (device >= 0 && (*error = open_cuda(a)) != 0) {
        if (a->libcuda != NULL) dlclose(a->libcuda);
        free(a);
        return NULL;
    }
    return a;
}

int copy_agent_start(agent_t *a) {
    if (a->started) return -1;
    /* read here, not by the thread once it runs: a job posted before that must still be served */
    a->start_ticket = __atomic_load_n(&a->box[W_TICKET], __ATOMIC_ACQUIRE);
    if (pthread_create(&a->thread, NULL, agent_main, a) != 0) return -1;
    a->started = 1;
    return 0;
}

/* jobs served, jobs refused, objects copied, the first CUDA error (0: none) */
void copy_agent_stats(agent_t *a, int64_t *out) {
    out[0] = atomic_load(&a->jobs);
    out[1] = atomic_load(&a->refused);
    out[2] = atomic_load(&a->copies);
    out[3] = atomic_load(&a->cuda_error);
}

void copy_agent_destroy(agent_t *a) {
    if (a == NULL) return;
    atomic_store(&a->stop, 1);
    if (a->started) pthread_join(a->thread, NULL);
    if (a->context != NULL) a->primary_release(a->cu_device);
    if (a->libcuda != NULL) dlclose(a->libcuda);
    free(a);
}
