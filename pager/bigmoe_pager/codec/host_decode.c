/* The codec's decoder on the CPU: one compressed record -> the raw expert record, every structure checked.
 *
 * Same bytes as reference.py (numpy) and triton_decode.py (GPU); docs/codec.md has the record layout. Called
 * through ctypes, which lets go of the GIL for the call, so SSD reader threads expand records side by side.
 * Every call checks the header, directory, sections and every chunk
 * header; a lane that does not end exactly at its declared length fails the call. The crc32 is the caller's
 * (the paging file checks its own per record, reference.verify_record checks the header's).
 *
 * Returns 0, or -1 with one line in err. On failure out holds garbage and must not be used.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

#define HEADER_BYTES 32
#define DIR_BYTES 24
#define CHUNK_FIXED 8 /* word offset u32, table u8, flags u8, base bits u16; then one u8 delta per lane */
#define LUT_ENTRIES 256
#define MAX_TABLES 16
#define MAX_CODE_BITS 8
#define STEP_SYMBOLS 4
#define PAD_WORDS 2
#define FLAG_VERBATIM 1
#define VERBATIM_BITS 4
#define KIND_RAW 0
#define KIND_FP8 1
#define CODEC_VERSION 1
#define MAX_LANES 128

typedef struct {
    const uint8_t *rec;
    int64_t len;
    char *err;
    int errlen;
} ctx_t;

static int fail(ctx_t *c, const char *what, const char *name) {
    snprintf(c->err, (size_t)c->errlen, "%s%s%s", name ? name : "", name ? ": " : "", what);
    return -1;
}

static uint32_t u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v; /* little-endian host (x86_64, aarch64) */
}

static uint16_t u16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

/* 64 stream bits from bit p on (each u32 word is read most significant bit first), of which the first
 * 64 - p % 32 >= 33 are the stream's: enough for one step's 4 codes of at most 8 bits. */
static uint64_t window_at(const uint8_t *words, int64_t p) {
    int64_t w = p >> 5;
    uint64_t two = (uint64_t)u32(words + 4 * w) << 32 | u32(words + 4 * (w + 1));
    return two << (p & 31);
}

/* One step of one lane: its 4 codes from the window at bit p; returns the 4 exponents packed in a u32 (symbol t
 * in byte t) and moves p past the codes. */
static inline uint32_t lane_step(const uint8_t *words, const uint8_t *lut, int64_t *p) {
    uint64_t w = window_at(words, *p);
    uint32_t e0 = lut[w >> 56];
    w <<= e0 >> 4;
    uint32_t e1 = lut[w >> 56];
    w <<= e1 >> 4;
    uint32_t e2 = lut[w >> 56];
    w <<= e2 >> 4;
    uint32_t e3 = lut[w >> 56];
    *p += (e0 >> 4) + (e1 >> 4) + (e2 >> 4) + (e3 >> 4);
    return (e0 & 15) | (e1 & 15) << 8 | (e2 & 15) << 16 | (e3 & 15) << 24;
}

#define PAIR_BITS 12
#define PAIR_ENTRIES (1 << PAIR_BITS)
#define PAIR_FITS (1u << 24)

/* Two codes a lookup: for each value of the next 12 stream bits, the exponents of the first two codes (bytes 0 and
 * 1), the bits both take (byte 2) and PAIR_FITS; 0 where the two codes do not fit in 12 bits, or where the second
 * code's 8-bit peek reaches past them and the table answers differently for the bits it cannot see (never, for the
 * prefix codes the encoder writes; a damaged table may). So a pair is exactly what two single lookups would give. */
static void build_pairs(const uint8_t *lut, uint32_t *pairs) {
    for (uint32_t v = 0; v < PAIR_ENTRIES; v++) {
        uint32_t e0 = lut[v >> (PAIR_BITS - MAX_CODE_BITS)], l0 = e0 >> 4;
        uint32_t rest = (v << l0) & (PAIR_ENTRIES - 1), peek = rest >> (PAIR_BITS - MAX_CODE_BITS);
        uint32_t e1 = lut[peek], l1 = e1 >> 4, unseen = l0 > 4 ? l0 - 4 : 0; /* peek bits past the twelve */
        int same = l0 + l1 <= PAIR_BITS;
        for (uint32_t tail = 1; same && tail < (1u << unseen); tail++) same = lut[peek | tail] == e1;
        pairs[v] = same ? PAIR_FITS | (l0 + l1) << 16 | (e1 & 15) << 8 | (e0 & 15) : 0;
    }
}

/* lane_step through the pair table: two lookups for the step's four codes when each pair fits, else lane_step. */
static inline uint32_t lane_step_pairs(const uint8_t *words, const uint32_t *pairs, const uint8_t *lut, int64_t *p) {
    uint64_t w = window_at(words, *p);
    uint32_t a = pairs[w >> (64 - PAIR_BITS)];
    uint32_t la = (a >> 16) & 0xFF;
    uint32_t b = pairs[(w << la) >> (64 - PAIR_BITS)];
    if (__builtin_expect((a & b & PAIR_FITS) != 0, 1)) {
        *p += la + ((b >> 16) & 0xFF);
        return (a & 0xFFFF) | (b & 0xFFFF) << 16;
    }
    return lane_step(words, lut, p);
}

/* Every step of a chunk's lanes, four lanes side by side (independent chains of dependent table loads, which is
 * what bounds a Huffman decoder); lane j's step s lands at exps[4 * (s * lanes + j)]. */
static void lanes_unchecked(const uint8_t *words, const uint32_t *pairs, const uint8_t *lut, int64_t *pos, int lanes,
                            int lane_steps, uint8_t *exps) {
    for (int j = 0; j < lanes; j += 4) {
        int64_t p0 = pos[j], p1 = pos[j + 1], p2 = pos[j + 2], p3 = pos[j + 3];
        for (int s = 0; s < lane_steps; s++) {
            uint32_t a = lane_step_pairs(words, pairs, lut, &p0), b = lane_step_pairs(words, pairs, lut, &p1);
            uint32_t c = lane_step_pairs(words, pairs, lut, &p2), d = lane_step_pairs(words, pairs, lut, &p3);
            uint8_t *dst = exps + 4 * ((int64_t)s * lanes + j);
            memcpy(dst, &a, 4);
            memcpy(dst + 4, &b, 4);
            memcpy(dst + 8, &c, 4);
            memcpy(dst + 12, &d, 4);
        }
        pos[j] = p0, pos[j + 1] = p1, pos[j + 2] = p2, pos[j + 3] = p3;
    }
}

/* The same with a bound check before every window; -1 when a lane would read past the stream's pad words. */
static int lanes_checked(const uint8_t *words, int64_t stream_words, const uint8_t *lut, int64_t *pos, int lanes,
                         int lane_steps, uint8_t *exps) {
    for (int j = 0; j < lanes; j++)
        for (int s = 0; s < lane_steps; s++) {
            if ((pos[j] >> 5) > stream_words) return -1;
            uint32_t e = lane_step(words, lut, &pos[j]);
            memcpy(exps + 4 * ((int64_t)s * lanes + j), &e, 4);
        }
    return 0;
}

/* FP8 bytes from exponents and their sign | mantissa nibbles (two a byte, the even byte's low): sign to bit 7,
 * exponent to bits 6..3, mantissa to bits 2..0; eight bytes at a time. */
static void join_nibbles(const uint8_t *exps, const uint8_t *nibs, uint8_t *out, int64_t n) {
    int64_t i = 0;
#ifdef __SSE2__
    /* Sixteen bytes at a time (SSE2 is in every x86-64): bytes stay under 128 before the sign's shift, so 16-bit
     * shifts never carry between bytes. */
    const __m128i low4 = _mm_set1_epi8(0x0F), low3 = _mm_set1_epi8(0x07), bit3 = _mm_set1_epi8(0x08);
    for (; i + 16 <= n; i += 16) {
        __m128i packed = _mm_loadl_epi64((const __m128i *)(nibs + i / 2));
        __m128i x = _mm_unpacklo_epi8(_mm_and_si128(packed, low4), _mm_and_si128(_mm_srli_epi16(packed, 4), low4));
        __m128i e = _mm_slli_epi16(_mm_loadu_si128((const __m128i *)(exps + i)), 3);
        __m128i sign = _mm_slli_epi16(_mm_and_si128(x, bit3), 4);
        _mm_storeu_si128((__m128i *)(out + i), _mm_or_si128(_mm_or_si128(sign, e), _mm_and_si128(x, low3)));
    }
#endif
    for (; i + 8 <= n; i += 8) {
        uint32_t packed;
        uint64_t e;
        memcpy(&packed, nibs + i / 2, 4);
        memcpy(&e, exps + i, 8);
        uint64_t x = packed;
        x = (x | x << 16) & 0x0000FFFF0000FFFFull;
        x = (x | x << 8) & 0x00FF00FF00FF00FFull;
        x = (x | x << 4) & 0x0F0F0F0F0F0F0F0Full; /* nibble t of `packed` in byte t */
        uint64_t v = (x & 0x0808080808080808ull) << 4 | e << 3 | (x & 0x0707070707070707ull);
        memcpy(out + i, &v, 8);
    }
    for (; i < n; i++) {
        uint8_t nib = (nibs[i >> 1] >> ((i & 1) * 4)) & 0xF;
        out[i] = (uint8_t)(((nib & 8) << 4) | (exps[i] << 3) | (nib & 7));
    }
}

/* Section [off, off + size) must lie inside the record after the header and start on 4 bytes. */
static int section(ctx_t *c, int64_t off, int64_t size, const char *name) {
    if (off % 4 || off < HEADER_BYTES || size < 0 || off + size > c->len) {
        char msg[160];
        snprintf(msg, sizeof msg, "section [%lld, %lld) lies outside the %lld-byte record or is misaligned",
                 (long long)off, (long long)(off + size), (long long)c->len);
        return fail(c, msg, name);
    }
    return 0;
}

static int decode_coded(ctx_t *c, const uint8_t *dir, uint8_t *out, int64_t nbytes, int lanes, int lane_steps,
                        const uint8_t *verbatim_lut, const char *name) {
    const int64_t lane_symbols = (int64_t)STEP_SYMBOLS * lane_steps;
    const int64_t chunk_symbols = lanes * lane_symbols;
    const int64_t chunks = (nbytes + chunk_symbols - 1) / chunk_symbols;
    const int64_t header_bytes = CHUNK_FIXED + lanes;
    int tables = dir[1];
    int64_t chunks_off = u32(dir + 4), luts_off = u32(dir + 8), nib_off = u32(dir + 12), stream_off = u32(dir + 16);
    int64_t stream_words = u32(dir + 20);
    int64_t nib_bytes = ((nbytes + 1) / 2 + 7) / 8 * 8;
    int64_t stream_bytes = 4 * (stream_words + PAD_WORDS);
    char msg[160];

    if (section(c, chunks_off, chunks * header_bytes, name)) return -1;
    if (tables < 1 || tables > MAX_TABLES) {
        snprintf(msg, sizeof msg, "%d code tables (1..%d allowed)", tables, MAX_TABLES);
        return fail(c, msg, name);
    }
    if (section(c, luts_off, (int64_t)tables * LUT_ENTRIES, name) || section(c, nib_off, nib_bytes, name) ||
        section(c, stream_off, stream_bytes, name))
        return -1;
    const uint8_t *heads = c->rec + chunks_off, *luts = c->rec + luts_off, *nibs = c->rec + nib_off;
    const uint8_t *words = c->rec + stream_off;
    for (int64_t i = 0; i < (int64_t)tables * LUT_ENTRIES; i++)
        if (luts[i] >> 4 > MAX_CODE_BITS) return fail(c, "a code table has a code longer than 8 bits", name);

    /* Every chunk header, whichever share this call expands: the chunks must partition the stream exactly. */
    int64_t expect_offset = 0;
    int partitioned = 1;
    for (int64_t k = 0; k < chunks; k++) {
        const uint8_t *h = heads + k * header_bytes;
        int table = h[4], flags = h[5];
        int64_t base = u16(h + 6), bits = 0;
        if (table >= tables) {
            snprintf(msg, sizeof msg, "chunk refers to table %d of %d", table, tables);
            return fail(c, msg, name);
        }
        if (flags & ~FLAG_VERBATIM) return fail(c, "unknown chunk flags", name);
        int verbatim = flags & FLAG_VERBATIM;
        if (verbatim && memcmp(luts + (int64_t)table * LUT_ENTRIES, verbatim_lut, LUT_ENTRIES))
            return fail(c, "a verbatim chunk's table is not the 4-bit identity code", name);
        for (int j = 0; j < lanes; j++) {
            int64_t lb = base + h[CHUNK_FIXED + j];
            if (verbatim && lb != lane_symbols * VERBATIM_BITS) {
                snprintf(msg, sizeof msg, "a verbatim chunk's lanes are not %lld bits each",
                         (long long)(lane_symbols * VERBATIM_BITS));
                return fail(c, msg, name);
            }
            bits += lb;
        }
        partitioned &= u32(h) == expect_offset;
        expect_offset += (bits + 31) / 32;
    }
    if (!partitioned || expect_offset != stream_words) {
        snprintf(msg, sizeof msg, "chunk word offsets do not partition the %lld-word stream", (long long)stream_words);
        return fail(c, msg, name);
    }

    /* A step's window reads words pos / 32 and the next: inside the stream and its pad words while
     * pos / 32 <= stream_words (a well-formed lane never passes the end of the coded words). */
    int64_t pos[MAX_LANES], end[MAX_LANES];
    uint8_t exps[MAX_LANES * 4 * 64 + 8]; /* one chunk's exponents, in component order (at most 32768) */
    if (chunk_symbols > (int64_t)sizeof exps - 8) return fail(c, "chunk geometry larger than this decoder's", name);
    uint32_t *pairs = malloc((size_t)tables * PAIR_ENTRIES * sizeof *pairs); /* 16 KiB a table, built on use */
    uint32_t built = 0;
    if (!pairs) return fail(c, "out of memory for the decoder's tables", name);
    int rc = 0;
    for (int64_t k = 0; k < chunks; k++) {
        const uint8_t *h = heads + k * header_bytes;
        const uint8_t *lut = luts + (int64_t)h[4] * LUT_ENTRIES;
        int64_t base = u16(h + 6), at = (int64_t)u32(h) * 32, reach = 0;
        for (int j = 0; j < lanes; j++) {
            pos[j] = at;
            reach = at + MAX_CODE_BITS * lane_symbols > reach ? at + MAX_CODE_BITS * lane_symbols : reach;
            at += base + h[CHUNK_FIXED + j];
            end[j] = at;
        }
        /* A lane moves at most 8 bits a symbol, so when no lane can reach past the coded words whatever its bits
         * say, the windows need no bound checks (every chunk but the last few of a component). */
        const char *why = NULL;
        if (reach <= 32 * stream_words) {
            uint32_t *pair = pairs + (int64_t)h[4] * PAIR_ENTRIES;
            if (!(built >> h[4] & 1)) build_pairs(lut, pair), built |= 1u << h[4];
            lanes_unchecked(words, pair, lut, pos, lanes, lane_steps, exps);
        } else if (lanes_checked(words, stream_words, lut, pos, lanes, lane_steps, exps)) {
            why = "a lane's codes run past the stream: malformed stream";
        }
        for (int j = 0; j < lanes && !why; j++)
            if (pos[j] != end[j]) why = "a lane's codes do not end where its length says: malformed stream";
        if (why) {
            rc = fail(c, why, name);
            break;
        }
        int64_t first = k * chunk_symbols, n = nbytes - first < chunk_symbols ? nbytes - first : chunk_symbols;
        join_nibbles(exps, nibs + first / 2, out + first, n);
    }
    free(pairs);
    return rc;
}

/* comps: ncomp rows of (offset in the raw record, bytes, coded 0/1); gaps: ngaps rows of (start, end) of the
 * raw record to zero (the layout's alignment gaps); names: ncomp NUL-terminated names, end to end. */
int bxf8_decode(const uint8_t *rec, int64_t len, uint8_t *out, int64_t out_len, const int64_t *comps,
                int32_t ncomp, const int64_t *gaps, int32_t ngaps, const char *names, uint32_t layout_crc,
                int64_t raw_bytes, int32_t lanes, int32_t lane_steps, const uint8_t *verbatim_lut, char *err,
                int32_t errlen) {
    ctx_t c = {rec, len, err, errlen};
    char msg[200];
    if (lanes < 4 || lanes > MAX_LANES || lanes % 4)
        return fail(&c, "geometry lanes not a multiple of 4 in 4..128", NULL);
    if (len < HEADER_BYTES) {
        snprintf(msg, sizeof msg, "record is %lld bytes, shorter than its %d-byte header", (long long)len,
                 HEADER_BYTES);
        return fail(&c, msg, NULL);
    }
    if (memcmp(rec, "BXF8", 4)) return fail(&c, "not an fp8-exp-huff record (bad magic)", NULL);
    if (u16(rec + 4) != CODEC_VERSION) {
        snprintf(msg, sizeof msg, "record is fp8-exp-huff version %d; this build reads version %d: "
                 "re-prepare the paging file", u16(rec + 4), CODEC_VERSION);
        return fail(&c, msg, NULL);
    }
    int64_t chunk_symbols = (int64_t)lanes * lane_steps * STEP_SYMBOLS;
    if (u16(rec + 24) != chunk_symbols || rec[26] != lanes || rec[27] != MAX_CODE_BITS) {
        snprintf(msg, sizeof msg, "record geometry chunk=%d lanes=%d bits=%d differs from the expected %dx%d",
                 u16(rec + 24), rec[26], rec[27], lanes, lane_steps);
        return fail(&c, msg, NULL);
    }
    if (u16(rec + 6) != ncomp || u32(rec + 8) != layout_crc || u32(rec + 12) != raw_bytes)
        return fail(&c, "record was made for another expert layout: re-prepare the paging file", NULL);
    if (u32(rec + 16) != len) {
        snprintf(msg, sizeof msg, "record says it is %u bytes but %lld were given (cut short or padded)",
                 u32(rec + 16), (long long)len);
        return fail(&c, msg, NULL);
    }
    if (out_len < raw_bytes) return fail(&c, "destination is smaller than the raw record", NULL);
    if (HEADER_BYTES + (int64_t)ncomp * DIR_BYTES > len) return fail(&c, "directory runs past the record", NULL);

    const char *name = names;
    for (int i = 0; i < ncomp; i++, name += strlen(name) + 1) {
        const uint8_t *dir = rec + HEADER_BYTES + (int64_t)i * DIR_BYTES;
        int64_t offset = comps[3 * i], nbytes = comps[3 * i + 1];
        int coded = (int)comps[3 * i + 2], kind = dir[0];
        if (offset < 0 || nbytes < 0 || offset + nbytes > raw_bytes)
            return fail(&c, "component outside the record", name);
        if (!(kind == KIND_RAW || (coded && kind == KIND_FP8))) {
            snprintf(msg, sizeof msg, "directory kind %d, layout allows %s", kind, coded ? "(1, 0)" : "(0,)");
            return fail(&c, msg, name);
        }
        if (kind == KIND_RAW) {
            int64_t src = u32(dir + 4);
            if (section(&c, src, nbytes, name)) return -1;
            memcpy(out + offset, rec + src, (size_t)nbytes);
        } else if (decode_coded(&c, dir, out + offset, nbytes, lanes, lane_steps, verbatim_lut, name)) {
            return -1;
        }
    }
    for (int g = 0; g < ngaps; g++)
        if (gaps[2 * g] >= 0 && gaps[2 * g] <= gaps[2 * g + 1] && gaps[2 * g + 1] <= raw_bytes)
            memset(out + gaps[2 * g], 0, (size_t)(gaps[2 * g + 1] - gaps[2 * g]));
    return 0;
}
