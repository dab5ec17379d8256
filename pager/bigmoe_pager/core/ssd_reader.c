/* The SSD tier's mailbox service without Python (so without the GIL): a poller thread and I/O worker threads.
 *
 * The GPU (ssd_mailbox.py's request and post kernels) publishes requests [seq, layer, expert, RAM slot] into a
 * pinned int64 mailbox, seq stored last; the GPU then spins on the request's done word. This file's poller picks
 * up each new seq, hands the read to a worker, and watches for late ones; a worker reads the record's byte spans
 * with O_DIRECT into its own aligned staging buffer, checks it (crc32 when the plan carries one), copies its
 * pieces into the RAM slot, zeroes the layout's gaps, and stores the seq into the done word (release). Before,
 * Python threads did this, and every read crossed the GIL several times while vLLM's thread held it.
 *
 * The read plan (ssd_reader.py, from the store) says for every record key (layer * experts + expert) which
 * aligned spans to read, back to back into staging, and which pieces of staging make the record; C only executes.
 *
 * Rules kept from the Python service (ssd_service.py): a read lands in staging and is checked before it touches
 * the slot; a newer request for a RAM slot supersedes an unfinished older one (the older one's bytes are thrown
 * away whenever they arrive, and its done word is never written); an attempt not answered within the timeout is
 * issued again on another worker, at most `retries` times, and so is one that fails its checksum; a read error
 * (after the file-level retries) or a bad request fails at once. The first failure is kept (what, where, errno),
 * HOST_ERROR gets the failing seq (the GPU then gives up), and the service serves nothing more.
 *
 * Reads ahead (posted entries) wait behind a step's requests, first in, first out among themselves, except one a step
 * now waits for: the GPU writes its seq into the entry's hurry word and the poller moves it to the requests' queue.
 *
 * Mailbox words (ssd_mailbox.py): [0] HOST_ERROR, [8 + 4 i .. 8 + 4 i + 3] request i, [8 + 4 E + i] done i,
 * [8 + 5 E + i] hurry i.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define ALIGN 4096
#define HOST_ERROR 0
#define REQ 8
#define NAP_NS 20000L         /* 20 us naps while requests came in the last ACTIVE_NS (about a fifth of a core) */
#define ACTIVE_NS 1000000000L /* 1 s: longer than any gap between two decode steps' reads */
#define IDLE_NAP_NS 1000000L  /* then 1 ms naps: an idle poller costs under 1% of a core */
#define MAX_BACKOFF_NS 256000000L /* the longest wait before a file-level retry: under nanosleep's 1 s limit */
#define TIMER_SLACK_NS 1000L  /* the poller's own: the default 50 us would stretch each 20 us nap to about 70 */

/* Failure kinds (ssd_reader.py's FAILURES). */
enum { OK = 0, F_READ = 1, F_SHORT = 2, F_TRUNCATED = 3, F_CHECKSUM = 4, F_TIMEOUT = 5, F_BAD = 6, F_ODIRECT = 7,
       F_SETUP = 8 };
enum { PENDING = 0, DONE = 1, FAILED = 2, SUPERSEDED = 3 };
#define COUNTERS 6 /* per layer: reads, bytes, read_ns, retries, errors, hurried (read_stats.ReadCounters) */

typedef struct { int fd; int64_t size; } file_t;
typedef struct { uint8_t *rows; int64_t slots, row_bytes; } layer_t;

typedef struct {      /* the job of one mailbox entry; a new seq in the entry replaces it */
    int64_t seq, layer, expert, slot;
    int64_t attempts, issued_ns;
    int64_t taken;    /* attempts a worker has taken: a ring may hold a second copy of an attempt (a hurried read
                         ahead, a retry's old copy), and the copy popped later finds it taken */
    int state;
} job_t;

typedef struct {
    int64_t *box;
    int64_t entries;
    int64_t first_posted, end_posted; /* posted reads' entries (scanned first); the rest are blocking requests */
    int64_t timeout_ns;
    int retries, file_retries, nworkers;
    /* the plan (copied in reader_set_plan) */
    int64_t nlayers, nexperts;
    int64_t *key_reads, *reads, *key_pieces, *pieces, *record_bytes, *crc, *zeros, nzeros, staging_bytes;
    file_t *files; int64_t nfiles;
    layer_t *layers;
    uint32_t (*crc32)(uint32_t, const uint8_t *, uint32_t); /* zlib's, dlopen()ed when a plan has checksums */
    /* state */
    job_t *jobs;            /* [entries], under mu */
    int64_t *handled;       /* [entries], the poller's own */
    int64_t *hurried;       /* [entries], the poller's own: the latest hurry seq acted on */
    int64_t *owner;         /* [sum slots]: entry whose job writes the slot (-1 none), under mu */
    int64_t *owner_seq;     /* [sum slots]: that job's seq */
    int64_t *slot_base;     /* [nlayers]: index of the layer's slot 0 in owner */
    pthread_mutex_t *slot_mu; /* [sum slots]: held while a slot's bytes are written */
    pthread_mutex_t mu;
    pthread_cond_t more;
    /* entries to attempt, under mu, in two rings of qcap: a step's requests (queue) are taken before reads ahead
       (ahead), so a wrong read ahead not yet started never delays a read the GPU waits on */
    int64_t *queue, qcap, qhead, qlen;
    int64_t *ahead, ahead_head, ahead_len;
    int stop, started;
    pthread_t poller;
    pthread_t *workers;
    int64_t *counters;      /* [nlayers, COUNTERS], atomics */
    int64_t failure[10];    /* kind, layer, expert, slot, entry, seq, attempts, errno, file, offset; under mu */
} reader;

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000L + t.tv_nsec;
}

static void nap(long ns) {
    struct timespec t = {0, ns};
    nanosleep(&t, NULL);
}

static void count(reader *r, int64_t layer, int which, int64_t n) {
    if (layer >= 0 && layer < r->nlayers) __atomic_fetch_add(&r->counters[layer * COUNTERS + which], n, __ATOMIC_RELAXED);
}

static int64_t *done_word(reader *r, int64_t entry) { return &r->box[REQ + 4 * r->entries + entry]; }
static int64_t *hurry_word(reader *r, int64_t entry) { return &r->box[REQ + 5 * r->entries + entry]; }

/* Record the service's first failure and tell the GPU (HOST_ERROR = seq). Caller holds mu. */
static void fail_locked(reader *r, int64_t entry, int kind, int64_t err, int64_t file, int64_t offset) {
    job_t *j = &r->jobs[entry];
    j->state = FAILED;
    count(r, j->layer, 4, 1);
    if (r->failure[0] != OK) return;
    int64_t f[10] = {kind, j->layer, j->expert, j->slot, entry, j->seq, j->attempts, err, file, offset};
    memcpy(r->failure, f, sizeof f);
    __atomic_store_n(&r->box[HOST_ERROR], j->seq > 0 ? j->seq : 1, __ATOMIC_RELEASE);
}

static int failed(reader *r) { return __atomic_load_n(&r->box[HOST_ERROR], __ATOMIC_ACQUIRE) != 0; }

/* Whether an entry is a posted read (a read ahead) rather than a request a step or a load waits on. */
static int is_ahead(const reader *r, int64_t entry) { return entry >= r->first_posted && entry < r->end_posted; }

static void push_locked(reader *r, int64_t entry, int ahead) {
    if (ahead) {
        r->ahead[(r->ahead_head + r->ahead_len) % r->qcap] = entry;
        r->ahead_len++;
    } else {
        r->queue[(r->qhead + r->qlen) % r->qcap] = entry;
        r->qlen++;
    }
    pthread_cond_signal(&r->more);
}

/* Issue one more attempt of the entry's job (caller holds mu). */
static void issue_locked(reader *r, int64_t entry) {
    job_t *j = &r->jobs[entry];
    j->attempts++;
    j->issued_ns = now_ns();
    if (j->attempts > 1) count(r, j->layer, 3, 1);
    int ahead = is_ahead(r, entry);
    if ((ahead ? r->ahead_len : r->qlen) < r->qcap) push_locked(r, entry, ahead);
}

/* ---- the worker: one attempt -------------------------------------------------------------------------------- */

/* Read `length` bytes (aligned) from `offset` into dst, of which the first `need` must arrive (the rest may lie past
 * the file's end), with the file-level retries of EIO and short reads; 0 or a failure kind (err: errno or bytes). */
static int read_span(reader *r, const file_t *f, int64_t offset, int64_t length, int64_t need, uint8_t *dst,
                     int64_t *err) {
    if (offset < 0 || offset + need > f->size) return F_TRUNCATED;
    int kind = OK;
    for (int attempt = 0; attempt <= r->file_retries; attempt++) {
        if (attempt) {
            /* 1, 2, 4 ms ... to give a flaky device a moment, at most MAX_BACKOFF_NS (odirect.py's MAX_BACKOFF_S) */
            nap(attempt > 9 ? MAX_BACKOFF_NS : 1000000L << (attempt - 1)); /* attempt 9: 256 ms */
        }
        int64_t got = 0;
        kind = OK;
        while (got < length) {
            ssize_t n = pread(f->fd, dst + got, (size_t)(length - got), offset + got);
            if (n < 0 && errno == EINTR) continue;
            if (n < 0) {
                *err = errno;
                kind = errno == EINVAL ? F_ODIRECT : F_READ;
                break;
            }
            if (n == 0) break; /* the file's end */
            got += n;
        }
        if (kind == OK && got >= need) return OK;
        if (kind == OK) {
            *err = got;
            kind = F_SHORT;
        }
        if (kind == F_ODIRECT || (kind == F_READ && *err != EIO)) return kind;
    }
    return kind;
}

static uint32_t pieces_crc(reader *r, int64_t key, const uint8_t *staging) {
    uint32_t c = 0;
    for (int64_t p = r->key_pieces[key]; p < r->key_pieces[key + 1]; p++)
        c = r->crc32(c, staging + r->pieces[3 * p], (uint32_t)r->pieces[3 * p + 2]);
    return c;
}

static void attempt(reader *r, int64_t entry, uint8_t *staging) {
    pthread_mutex_lock(&r->mu);
    job_t j = r->jobs[entry]; /* a snapshot: the entry may get a new job meanwhile */
    pthread_mutex_unlock(&r->mu);
    if (j.state != PENDING) return;
    int64_t t0 = now_ns(), key = j.layer * r->nexperts + j.expert, err = 0, at = 0, pos = 0, file = -1;
    int kind = OK;
    for (int64_t i = r->key_reads[key]; i < r->key_reads[key + 1] && kind == OK; i++) {
        const int64_t *rd = &r->reads[4 * i];
        file = rd[0];
        at = rd[1];
        kind = read_span(r, &r->files[file], at, rd[2], rd[3], staging + pos, &err);
        pos += rd[2];
    }
    if (kind == OK && r->crc[key] >= 0 && pieces_crc(r, key, staging) != (uint32_t)r->crc[key]) kind = F_CHECKSUM;
    int64_t s = r->slot_base[j.layer] + j.slot;
    pthread_mutex_lock(&r->slot_mu[s]);
    pthread_mutex_lock(&r->mu);
    job_t *now = &r->jobs[entry];
    int mine = now->seq == j.seq && now->state == PENDING;
    int owner = r->owner[s] == entry && r->owner_seq[s] == j.seq;
    if (mine && kind != OK) {
        if (kind == F_CHECKSUM && now->attempts <= r->retries) issue_locked(r, entry); /* maybe a glitch on the way */
        else fail_locked(r, entry, kind, err, file, at);
    }
    int write = mine && kind == OK && owner && !failed(r);
    pthread_mutex_unlock(&r->mu);
    if (write) { /* under the slot's lock: a newer job's bytes cannot interleave with these */
        uint8_t *row = r->layers[j.layer].rows + j.slot * r->layers[j.layer].row_bytes;
        for (int64_t p = r->key_pieces[key]; p < r->key_pieces[key + 1]; p++)
            memcpy(row + r->pieces[3 * p + 1], staging + r->pieces[3 * p], (size_t)r->pieces[3 * p + 2]);
        for (int64_t z = 0; z < r->nzeros; z++) memset(row + r->zeros[2 * z], 0, (size_t)(r->zeros[2 * z + 1] - r->zeros[2 * z]));
        pthread_mutex_lock(&r->mu);
        if (r->jobs[entry].seq == j.seq && r->jobs[entry].state == PENDING) {
            r->jobs[entry].state = DONE;
            __atomic_store_n(done_word(r, entry), j.seq, __ATOMIC_RELEASE); /* after the slot's bytes */
            count(r, j.layer, 0, 1);
            count(r, j.layer, 1, r->record_bytes[key]);
            count(r, j.layer, 2, now_ns() - t0);
        }
        pthread_mutex_unlock(&r->mu);
    }
    pthread_mutex_unlock(&r->slot_mu[s]);
}

static void *work(void *arg) {
    reader *r = arg;
    uint8_t *staging = NULL;
    if (posix_memalign((void **)&staging, ALIGN, (size_t)r->staging_bytes) != 0) staging = NULL;
    pthread_mutex_lock(&r->mu);
    for (;;) {
        /* stop is stored without mu (the poller reads it lock-free); the broadcast after it takes mu */
        while (!__atomic_load_n(&r->stop, __ATOMIC_ACQUIRE) && r->qlen == 0 && r->ahead_len == 0)
            pthread_cond_wait(&r->more, &r->mu);
        if (__atomic_load_n(&r->stop, __ATOMIC_ACQUIRE)) break;
        int64_t entry;
        if (r->qlen > 0) {
            entry = r->queue[r->qhead];
            r->qhead = (r->qhead + 1) % r->qcap;
            r->qlen--;
        } else {
            entry = r->ahead[r->ahead_head];
            r->ahead_head = (r->ahead_head + 1) % r->qcap;
            r->ahead_len--;
        }
        job_t *j = &r->jobs[entry];
        if (j->taken >= j->attempts) continue; /* this attempt's other copy came first */
        j->taken = j->attempts;
        if (staging == NULL) {
            fail_locked(r, entry, F_SETUP, ENOMEM, -1, 0);
            continue;
        }
        pthread_mutex_unlock(&r->mu);
        attempt(r, entry, staging);
        pthread_mutex_lock(&r->mu);
    }
    pthread_mutex_unlock(&r->mu);
    free(staging);
    return NULL;
}

/* ---- the poller ---------------------------------------------------------------------------------------------- */

/* A new request in `entry`: validate, make it its slot's writer (superseding an unfinished older one), queue it. */
static void take(reader *r, int64_t entry, int64_t seq) {
    const int64_t *q = &r->box[REQ + 4 * entry];
    int64_t layer = q[1], expert = q[2], slot = q[3];
    pthread_mutex_lock(&r->mu);
    job_t *j = &r->jobs[entry];
    *j = (job_t){seq, layer, expert, slot, 0, now_ns(), 0, PENDING};
    if (failed(r)) {
        j->state = FAILED;
    } else if (layer < 0 || layer >= r->nlayers || expert < 0 || expert >= r->nexperts || slot < 0 ||
               slot >= r->layers[layer].slots) {
        fail_locked(r, entry, F_BAD, 0, -1, 0);
    } else {
        int64_t s = r->slot_base[layer] + slot, earlier = r->owner[s];
        if (earlier >= 0 && earlier != entry && r->jobs[earlier].seq == r->owner_seq[s] &&
            r->jobs[earlier].state == PENDING)
            r->jobs[earlier].state = SUPERSEDED;
        r->owner[s] = entry;
        r->owner_seq[s] = seq;
        issue_locked(r, entry);
    }
    pthread_mutex_unlock(&r->mu);
}

/* Attempts older than the timeout are issued again; a job out of attempts fails. */
static void watch_late(reader *r, int64_t now) {
    pthread_mutex_lock(&r->mu);
    for (int64_t e = 0; e < r->entries; e++) {
        job_t *j = &r->jobs[e];
        if (j->state != PENDING || j->seq == 0 || now - j->issued_ns <= r->timeout_ns) continue;
        if (j->attempts <= r->retries) issue_locked(r, e);
        else fail_locked(r, e, F_TIMEOUT, 0, -1, 0);
    }
    pthread_mutex_unlock(&r->mu);
}

static void scan(reader *r, int64_t from, int64_t to, int *fresh) {
    for (int64_t e = from; e < to; e++) {
        int64_t seq = __atomic_load_n(&r->box[REQ + 4 * e], __ATOMIC_ACQUIRE); /* the payload was stored before */
        if (seq > r->handled[e]) {
            r->handled[e] = seq;
            take(r, e, seq);
            *fresh = 1;
        }
    }
}

/* Reads ahead a step now waits for (their hurry words) go to the requests' queue, unless a worker has them already. */
static void hurry(reader *r) {
    for (int64_t e = r->first_posted; e < r->end_posted; e++) {
        int64_t seq = __atomic_load_n(hurry_word(r, e), __ATOMIC_ACQUIRE);
        if (seq <= r->hurried[e] || seq > r->handled[e]) continue; /* acted on, or its post not taken yet */
        r->hurried[e] = seq;
        pthread_mutex_lock(&r->mu);
        job_t *j = &r->jobs[e];
        if (j->seq == seq && j->state == PENDING && j->taken < j->attempts && r->qlen < r->qcap) {
            push_locked(r, e, 0);
            count(r, j->layer, 5, 1);
        }
        pthread_mutex_unlock(&r->mu);
    }
}

static void *poll_box(void *arg) {
    reader *r = arg;
    int64_t last_work = now_ns(), last_watch = 0;
    prctl(PR_SET_TIMERSLACK, TIMER_SLACK_NS, 0, 0, 0); /* this thread only; a failure leaves the default */
    while (!__atomic_load_n(&r->stop, __ATOMIC_ACQUIRE)) {
        int fresh = 0;
        /* posted reads (entries >= first_posted) before blocking requests: a step's request for a slot is always
           published after the posted read it supersedes, so within one scan this is the GPU's order */
        scan(r, r->first_posted, r->end_posted, &fresh);
        scan(r, 0, r->first_posted, &fresh);
        scan(r, r->end_posted, r->entries, &fresh);
        hurry(r);
        int64_t now = now_ns();
        if (now - last_watch > 1000000L) { /* every millisecond is plenty for timeouts of seconds */
            watch_late(r, now);
            last_watch = now;
        }
        if (fresh) last_work = now;
        nap(now - last_work < ACTIVE_NS ? NAP_NS : IDLE_NAP_NS);
    }
    return NULL;
}

/* ---- the library's calls (ssd_reader.py) ---------------------------------------------------------------------- */

static void *copy_of(const int64_t *src, int64_t words) {
    int64_t *dst = malloc((size_t)(words > 0 ? words : 1) * sizeof(int64_t));
    if (dst && words > 0) memcpy(dst, src, (size_t)words * sizeof(int64_t));
    return dst;
}

static void release(reader *r) {
    if (r->slot_mu) { /* before slot_base, which counts them (slot_mu exists only once slot_base is filled) */
        for (int64_t s = 0; s < r->slot_base[r->nlayers]; s++) pthread_mutex_destroy(&r->slot_mu[s]);
        free(r->slot_mu);
    }
    free(r->key_reads); free(r->reads); free(r->key_pieces); free(r->pieces); free(r->record_bytes); free(r->crc);
    free(r->zeros); free(r->files); free(r->layers); free(r->jobs); free(r->handled); free(r->hurried);
    free(r->owner); free(r->owner_seq); free(r->slot_base); free(r->queue); free(r->ahead); free(r->workers); free(r->counters);
    pthread_mutex_destroy(&r->mu);
    pthread_cond_destroy(&r->more);
    free(r);
}

/* Stop the threads and wait for them (a read in progress finishes first). */
static void join_all(reader *r) {
    __atomic_store_n(&r->stop, 1, __ATOMIC_RELEASE);
    pthread_mutex_lock(&r->mu);
    pthread_cond_broadcast(&r->more);
    pthread_mutex_unlock(&r->mu);
    if (r->started) pthread_join(r->poller, NULL);
    for (int i = 0; i < r->nworkers; i++) pthread_join(r->workers[i], NULL);
}

/* Start the poller and `workers` I/O threads over a mailbox of `entries` entries. Every array is copied.
 *   files: fds [nfiles] (open with O_DIRECT; the caller keeps them open until reader_stop), sizes [nfiles]
 *   layers: rows [nlayers] (address of RAM slot 0), slots [nlayers], row_bytes [nlayers]
 *   plan: key_reads [K+1] -> reads [., 4] (file, offset, length, bytes that must arrive; record_reads.py), key_pieces [K+1] -> pieces [., 3]
 *         (staging offset, record offset, bytes), record_bytes [K], crc [K] (-1: none), zeros [nzeros, 2],
 *         staging_bytes (the most any key reads), K = nlayers * nexperts
 * Returns NULL on a bad argument or when threads or memory cannot be had (*why says which: 1 arguments, 2 memory,
 * 3 zlib for checksums, 4 threads). */
void *reader_start(int64_t *box, int64_t entries, int64_t first_posted, int64_t end_posted, int64_t timeout_ns,
                   int retries, int file_retries, int workers, int64_t nfiles, const int64_t *fds,
                   const int64_t *sizes, int64_t nlayers, const int64_t *rows, const int64_t *slots,
                   const int64_t *row_bytes, int64_t nexperts, const int64_t *key_reads, const int64_t *reads,
                   const int64_t *key_pieces, const int64_t *pieces, const int64_t *record_bytes, const int64_t *crc,
                   int64_t nzeros, const int64_t *zeros, int64_t staging_bytes, int *why) {
    *why = 1;
    if (!box || entries <= 0 || workers <= 0 || nlayers <= 0 || nexperts <= 0 || staging_bytes <= 0 ||
        first_posted < 0 || end_posted < first_posted || end_posted > entries)
        return NULL;
    reader *r = calloc(1, sizeof *r);
    if (!r) { *why = 2; return NULL; }
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->more, NULL);
    int64_t keys = nlayers * nexperts;
    r->box = box; r->entries = entries; r->first_posted = first_posted; r->end_posted = end_posted;
    r->timeout_ns = timeout_ns; r->retries = retries; r->file_retries = file_retries; r->nworkers = workers;
    r->nlayers = nlayers; r->nexperts = nexperts; r->nzeros = nzeros; r->nfiles = nfiles;
    r->staging_bytes = (staging_bytes + ALIGN - 1) / ALIGN * ALIGN;
    r->key_reads = copy_of(key_reads, keys + 1);
    r->reads = copy_of(reads, 4 * key_reads[keys]);
    r->key_pieces = copy_of(key_pieces, keys + 1);
    r->pieces = copy_of(pieces, 3 * key_pieces[keys]);
    r->record_bytes = copy_of(record_bytes, keys);
    r->crc = copy_of(crc, keys);
    r->zeros = copy_of(zeros, 2 * nzeros);
    r->files = calloc((size_t)(nfiles > 0 ? nfiles : 1), sizeof *r->files);
    r->layers = calloc((size_t)nlayers, sizeof *r->layers);
    r->slot_base = calloc((size_t)nlayers + 1, sizeof *r->slot_base);
    r->jobs = calloc((size_t)entries, sizeof *r->jobs);
    r->handled = calloc((size_t)entries, sizeof *r->handled);
    r->hurried = calloc((size_t)entries, sizeof *r->hurried);
    r->qcap = entries * (retries + 2);
    r->queue = calloc((size_t)r->qcap, sizeof *r->queue);
    r->ahead = calloc((size_t)r->qcap, sizeof *r->ahead);
    r->workers = calloc((size_t)workers, sizeof *r->workers);
    r->counters = calloc((size_t)(nlayers * COUNTERS), sizeof *r->counters);
    if (!r->key_reads || !r->reads || !r->key_pieces || !r->pieces || !r->record_bytes || !r->crc || !r->zeros ||
        !r->files || !r->layers || !r->slot_base || !r->jobs || !r->handled || !r->hurried || !r->queue || !r->ahead ||
        !r->workers || !r->counters) {
        *why = 2; release(r); return NULL;
    }
    for (int64_t f = 0; f < nfiles; f++) r->files[f] = (file_t){(int)fds[f], sizes[f]};
    for (int64_t l = 0; l < nlayers; l++) {
        r->layers[l] = (layer_t){(uint8_t *)(uintptr_t)rows[l], slots[l], row_bytes[l]};
        r->slot_base[l + 1] = r->slot_base[l] + slots[l];
    }
    int64_t total = r->slot_base[nlayers];
    r->owner = malloc((size_t)(total > 0 ? total : 1) * sizeof *r->owner);
    r->owner_seq = calloc((size_t)(total > 0 ? total : 1), sizeof *r->owner_seq);
    r->slot_mu = calloc((size_t)(total > 0 ? total : 1), sizeof *r->slot_mu);
    if (!r->owner || !r->owner_seq || !r->slot_mu) { *why = 2; release(r); return NULL; }
    for (int64_t s = 0; s < total; s++) { r->owner[s] = -1; pthread_mutex_init(&r->slot_mu[s], NULL); }
    int checked = 0;
    for (int64_t k = 0; k < keys; k++) checked |= crc[k] >= 0;
    if (checked) {
        void *z = dlopen("libz.so.1", RTLD_NOW | RTLD_LOCAL);
        if (z) r->crc32 = (uint32_t (*)(uint32_t, const uint8_t *, uint32_t))dlsym(z, "crc32");
        if (!r->crc32) { *why = 3; release(r); return NULL; }
    }
    int ok = 1;
    for (int w = 0; w < workers && ok; w++) {
        ok = pthread_create(&r->workers[w], NULL, work, r) == 0;
        r->nworkers = ok ? w + 1 : w;
    }
    r->started = ok && pthread_create(&r->poller, NULL, poll_box, r) == 0;
    if (!r->started) {
        join_all(r);
        *why = 4;
        release(r);
        return NULL;
    }
    *why = 0;
    return r;
}

/* Per layer: reads, bytes, read_ns, retries, errors, hurried, added since the start (out: [nlayers, 6]). */
void reader_counters(void *handle, int64_t *out) {
    reader *r = handle;
    for (int64_t i = 0; i < r->nlayers * COUNTERS; i++) out[i] = __atomic_load_n(&r->counters[i], __ATOMIC_RELAXED);
}

/* The first failure (out: kind, layer, expert, RAM slot, entry, seq, attempts, errno or bytes got, file, offset);
 * kind 0: none. */
void reader_failure(void *handle, int64_t *out) {
    reader *r = handle;
    pthread_mutex_lock(&r->mu);
    memcpy(out, r->failure, sizeof r->failure);
    pthread_mutex_unlock(&r->mu);
}

/* Stop and join every thread (a read in progress finishes first), write the final counters and failure where asked
 * (NULL: not wanted; the layouts of reader_counters and reader_failure), then free everything. */
void reader_stop(void *handle, int64_t *counters, int64_t *failure) {
    reader *r = handle;
    join_all(r);
    if (counters) reader_counters(r, counters);
    if (failure) reader_failure(r, failure);
    release(r);
}
