/* A host thread that serves GPU-published copy lists, without Python (so without the GIL).
 *
 * A GPU kernel publishes, per MoE layer, a list of (record row, VRAM slot, goal) entries into a "mailbox" in
 * pinned host memory and stores the mailbox's seq word last. This thread polls the mailboxes; for each new seq
 * it copies every entry's components from the record into the slot, then writes the entry's goal into
 * copied[slot], the word a later GPU kernel polls before it reads the slot.
 *
 * Mailbox of a layer of S slots, int64 words: [0] seq, [1] count, [2] reserved, [3, 3+S) rows,
 * [3+S, 3+2S) slots, [3+2S, 3+3S) goals. Row or slot -1 = skip the entry.
 *
 * CPU mode: memcpy, then a release store of the goal. CUDA mode: cuMemcpyHtoDAsync on the thread's own
 * non-blocking stream (copy engines move the bytes), then an 8-byte copy of the goal from a pinned ring entry
 * on the same stream, so stream order lands it after the data. The driver API is dlopen()ed at start, so this
 * file builds and runs without CUDA headers or libraries.
 *
 * Errors (a failed driver call, a mailbox entry out of range) are recorded once; the thread then issues
 * nothing more and idles, so the GPU's bounded waits time out instead of reading wrong bytes.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MAX_LAYERS 256
#define MAX_COMPONENTS 4
#define NAP_NS 20000L    /* 20 us naps for the first second idle: a round after a pause waits at most this */
#define COLD_NS 1000000000L /* after 1 s idle (no decode under way) ... */
#define COLD_NAP_NS 1000000L /* ... 1 ms naps: 20 us naps cost about a fifth of a core, 1 ms ones under 1% */
#define STREAM_NON_BLOCKING 1u /* CU_STREAM_NON_BLOCKING: no implicit sync with the legacy default stream */
#define CAPTURE_MODE_RELAXED 2 /* CU_STREAM_CAPTURE_MODE_RELAXED: this thread's calls never void another's capture */

/* Error codes of the copier's own (CUDA's are positive CUresult values). */
#define ERR_DRIVER (-1)  /* libcuda.so.1 or one of its symbols is missing */
#define ERR_CONTEXT (-2) /* no CUDA context was current on the thread that started the copier */
#define ERR_MAILBOX (-3) /* a published entry or count is out of the layer's range */
#define ERR_ARGUMENT (-4) /* copier_start in CUDA mode without a ring */

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef void *CUstream;
typedef void *CUcontext;

typedef struct {
    CUresult (*ctx_get_current)(CUcontext *);
    CUresult (*ctx_set_current)(CUcontext);
    CUresult (*stream_create)(CUstream *, unsigned int);
    CUresult (*stream_destroy)(CUstream);
    CUresult (*stream_synchronize)(CUstream);
    CUresult (*memcpy_htod_async)(CUdeviceptr, const void *, size_t, CUstream);
    CUresult (*exchange_capture_mode)(int *);
} cuda_api;

typedef struct {
    int64_t offset, nbytes; /* bytes within a record */
    int64_t dst, stride;    /* address of slot 0, bytes from one slot to the next */
} component;

typedef struct {
    const int64_t *mailbox;
    const uint8_t *records;
    int64_t pitch, nrecords; /* bytes from one record to the next; rows below nrecords are valid */
    int64_t copied;          /* address of the int64 completion words, one per slot */
    int64_t slots, ncomp;
    component comp[MAX_COMPONENTS];
    int64_t last_seen; /* seq of the last round served; only the thread touches it */
} layer;

typedef struct {
    pthread_t thread;
    int cuda, stop, ready;
    int64_t nlayers; /* descriptors below this are complete (release store by add_layer) */
    layer layers[MAX_LAYERS];
    int64_t *ring, ring_words, ring_next; /* pinned goal words the completion copies read from (CUDA) */
    int64_t hot_ns; /* busy-poll this long after the last work, then nap (host_copier.py: HOT_MS) */
    cuda_api api;
    CUcontext ctx;
    CUstream stream;
    int64_t rounds, experts, bytes, passes; /* written by the thread only, read by stats */
    int error;                             /* first error; error_call is written before it (release) */
    char error_call[128];
} copier;

static void fail(copier *h, int code, const char *call) {
    if (__atomic_load_n(&h->error, __ATOMIC_ACQUIRE) != 0) return; /* keep the first */
    snprintf(h->error_call, sizeof h->error_call, "%s", call);
    __atomic_store_n(&h->error, code, __ATOMIC_RELEASE);
}

static int failed(copier *h) { return __atomic_load_n(&h->error, __ATOMIC_ACQUIRE) != 0; }

/* Run a driver call; on failure record it under `name` and return nonzero. */
#define CU(h, call, name) cu_check((h), (h)->api.call, (name))
static int cu_check(copier *h, CUresult r, const char *name) {
    if (r != 0) fail(h, r, name);
    return r != 0;
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000L + t.tv_nsec;
}

static void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static void nap(long ns) {
    struct timespec t = {0, ns};
    nanosleep(&t, NULL);
}

static void add(int64_t *counter, int64_t n) { __atomic_fetch_add(counter, n, __ATOMIC_RELAXED); }

/* Copy one entry's components into `slot`, then publish `goal` in copied[slot]. Nonzero on a driver error. */
static int serve_entry(copier *h, const layer *l, int64_t row, int64_t slot, int64_t goal) {
    const uint8_t *record = l->records + row * l->pitch;
    int64_t done = 0;
    for (int64_t c = 0; c < l->ncomp; c++) {
        const component *p = &l->comp[c];
        void *dst = (void *)(uintptr_t)(p->dst + slot * p->stride);
        if (!h->cuda)
            memcpy(dst, record + p->offset, (size_t)p->nbytes);
        else if (CU(h, memcpy_htod_async((CUdeviceptr)(uintptr_t)dst, record + p->offset, (size_t)p->nbytes,
                                         h->stream), "cuMemcpyHtoDAsync_v2"))
            return 1;
        done += p->nbytes;
    }
    int64_t word = l->copied + slot * (int64_t)sizeof(int64_t);
    if (!h->cuda) {
        __atomic_store_n((int64_t *)(uintptr_t)word, goal, __ATOMIC_RELEASE);
    } else {
        int64_t *src = &h->ring[h->ring_next++ % h->ring_words]; /* a DMA reads it later: never a stack word */
        *src = goal;
        if (CU(h, memcpy_htod_async((CUdeviceptr)word, src, sizeof(int64_t), h->stream), "cuMemcpyHtoDAsync_v2"))
            return 1;
    }
    add(&h->experts, 1);
    add(&h->bytes, done);
    return 0;
}

/* Serve the layer's round if its seq moved. Returns 1 if there was a round (served or failed), else 0. */
static int serve_layer(copier *h, layer *l, int64_t index) {
    int64_t seq = __atomic_load_n(&l->mailbox[0], __ATOMIC_ACQUIRE);
    if (seq == l->last_seen) return 0;
    const int64_t s = l->slots, n = l->mailbox[1]; /* the lists are complete: read after the acquire */
    const int64_t *rows = l->mailbox + 3, *slots = rows + s, *goals = slots + s;
    char where[128];
    if (n < 0 || n > s) {
        snprintf(where, sizeof where, "mailbox of layer %lld: count %lld of %lld slots", (long long)index,
                 (long long)n, (long long)s);
        fail(h, ERR_MAILBOX, where);
        return 1;
    }
    for (int64_t i = 0; i < n; i++) {
        int64_t row = rows[i], slot = slots[i];
        if (row < 0 || slot < 0) continue;
        if (row >= l->nrecords || slot >= s) {
            snprintf(where, sizeof where, "mailbox of layer %lld: row %lld, slot %lld out of range", (long long)index,
                     (long long)row, (long long)slot);
            fail(h, ERR_MAILBOX, where);
            return 1;
        }
        if (serve_entry(h, l, row, slot, goals[i])) return 1;
    }
    l->last_seen = seq;
    add(&h->rounds, 1);
    return 1;
}

static void *run(void *arg) {
    copier *h = arg;
    /* Relaxed: the thread never captures, and in the default (global) mode its stream's creation, sync and
     * destruction would void a CUDA graph that another thread is capturing at that moment (a copier closed or
     * collected while vLLM captures). */
    int mode = CAPTURE_MODE_RELAXED;
    if (h->cuda && !failed(h) && !CU(h, ctx_set_current(h->ctx), "cuCtxSetCurrent") &&
        !CU(h, exchange_capture_mode(&mode), "cuThreadExchangeStreamCaptureMode"))
        CU(h, stream_create(&h->stream, STREAM_NON_BLOCKING), "cuStreamCreate");
    __atomic_store_n(&h->ready, 1, __ATOMIC_RELEASE);

    int64_t idle_since = -1; /* -1: hot, the last pass had work */
    while (!__atomic_load_n(&h->stop, __ATOMIC_ACQUIRE)) {
        int busy = 0;
        int64_t n = __atomic_load_n(&h->nlayers, __ATOMIC_ACQUIRE);
        for (int64_t i = 0; i < n && !failed(h); i++) busy |= serve_layer(h, &h->layers[i], i);
        add(&h->passes, 1);
        if (busy) {
            idle_since = -1;
            continue;
        }
        int64_t t = now_ns();
        if (idle_since < 0) idle_since = t;
        if (t - idle_since < h->hot_ns)
            cpu_relax();
        else
            nap(t - idle_since < COLD_NS ? NAP_NS : COLD_NAP_NS);
    }
    if (h->stream) { /* copies still in flight read the records and the ring: let them land first */
        CU(h, stream_synchronize(h->stream), "cuStreamSynchronize");
        CU(h, stream_destroy(h->stream), "cuStreamDestroy");
    }
    return NULL;
}

/* Resolve the driver symbols; 0 on success. */
static int load_driver(copier *h) {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL); /* never dlclose()d: torch holds it anyway */
    if (!lib) {
        fail(h, ERR_DRIVER, "dlopen(libcuda.so.1)");
        return 1;
    }
    struct { void **fn; const char *name, *fallback; } syms[] = {
        {(void **)&h->api.ctx_get_current, "cuCtxGetCurrent", NULL},
        {(void **)&h->api.ctx_set_current, "cuCtxSetCurrent", NULL},
        {(void **)&h->api.stream_create, "cuStreamCreate", NULL},
        {(void **)&h->api.stream_destroy, "cuStreamDestroy_v2", "cuStreamDestroy"},
        {(void **)&h->api.stream_synchronize, "cuStreamSynchronize", NULL},
        {(void **)&h->api.memcpy_htod_async, "cuMemcpyHtoDAsync_v2", NULL},
        {(void **)&h->api.exchange_capture_mode, "cuThreadExchangeStreamCaptureMode", NULL},
    };
    for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++) {
        *syms[i].fn = dlsym(lib, syms[i].name);
        if (!*syms[i].fn && syms[i].fallback) *syms[i].fn = dlsym(lib, syms[i].fallback);
        if (!*syms[i].fn) {
            char what[96];
            snprintf(what, sizeof what, "dlsym(%s)", syms[i].name);
            fail(h, ERR_DRIVER, what);
            return 1;
        }
    }
    return 0;
}

/* Start the thread. CUDA mode captures the calling thread's current context. NULL only if out of memory or
 * threads; any other failure is recorded in the handle (copier_stats) and leaves the thread idle. */
void *copier_start(int cuda, int64_t *ring, int64_t ring_words, int64_t hot_ns) {
    copier *h = calloc(1, sizeof *h);
    if (!h) return NULL;
    h->hot_ns = hot_ns;
    h->cuda = cuda != 0;
    h->ring = ring;
    h->ring_words = ring_words;
    if (h->cuda && (!ring || ring_words < 1))
        fail(h, ERR_ARGUMENT, "copier_start (no ring for the completion words)");
    else if (h->cuda && !load_driver(h) && !CU(h, ctx_get_current(&h->ctx), "cuCtxGetCurrent") && !h->ctx)
        fail(h, ERR_CONTEXT, "cuCtxGetCurrent (no current context)");
    if (pthread_create(&h->thread, NULL, run, h) != 0) {
        free(h);
        return NULL;
    }
    while (!__atomic_load_n(&h->ready, __ATOMIC_ACQUIRE)) nap(NAP_NS); /* so start's caller sees setup errors */
    return h;
}

/* desc: mailbox, records, pitch, nrecords, copied, slots, ncomp, then ncomp x (offset, nbytes, dst, stride).
 * Returns the layer's index, or -1 if the descriptor is malformed or the table is full. Callers serialize. */
int copier_add_layer(void *handle, const int64_t *desc, int64_t n) {
    copier *h = handle;
    int64_t count = h->nlayers; /* only add_layer writes it */
    if (count >= MAX_LAYERS || n < 7 || desc[6] < 1 || desc[6] > MAX_COMPONENTS || n != 7 + 4 * desc[6]) return -1;
    layer *l = &h->layers[count];
    l->mailbox = (const int64_t *)(uintptr_t)desc[0];
    l->records = (const uint8_t *)(uintptr_t)desc[1];
    l->pitch = desc[2];
    l->nrecords = desc[3];
    l->copied = desc[4];
    l->slots = desc[5];
    l->ncomp = desc[6];
    for (int64_t c = 0; c < l->ncomp; c++) {
        const int64_t *d = desc + 7 + 4 * c;
        l->comp[c] = (component){d[0], d[1], d[2], d[3]};
    }
    l->last_seen = 0; /* a fresh mailbox's seq: its first round is any other value */
    __atomic_store_n(&h->nlayers, count + 1, __ATOMIC_RELEASE);
    return (int)count;
}

/* out: rounds, experts, bytes, error, layers, passes (full polls of all layers). */
void copier_stats(void *handle, int64_t *out) {
    copier *h = handle;
    out[0] = __atomic_load_n(&h->rounds, __ATOMIC_RELAXED);
    out[1] = __atomic_load_n(&h->experts, __ATOMIC_RELAXED);
    out[2] = __atomic_load_n(&h->bytes, __ATOMIC_RELAXED);
    out[3] = __atomic_load_n(&h->error, __ATOMIC_ACQUIRE);
    out[4] = __atomic_load_n(&h->nlayers, __ATOMIC_ACQUIRE);
    out[5] = __atomic_load_n(&h->passes, __ATOMIC_RELAXED);
}

/* The failing call's name; valid once copier_stats reported an error, until copier_stop. */
const char *copier_error_call(void *handle) {
    copier *h = handle;
    return failed(h) ? h->error_call : "";
}

/* Stop and join the thread (it drains and destroys its stream first), then free the handle. */
void copier_stop(void *handle) {
    copier *h = handle;
    __atomic_store_n(&h->stop, 1, __ATOMIC_RELEASE);
    pthread_join(h->thread, NULL);
    free(h);
}
