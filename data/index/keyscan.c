/* The semantic key's query path in one call (data/index/keyscan.py builds and loads it; data/index/pruner.py owns the
 * index it reads and holds the numpy reference of every step below, which the tests compare it with).
 *
 * keyscan_query: a raw state in, the k nearest pool rows by exact cosine out:
 *   1. q = state / |state|; p = (q - mean) PCA-projected (float16 matrix, float32 sums in the axpy form);
 *   2. coarse scores of the inverted lists (float16 centroids, transposed, same form); the `nprobe` best
 *      lists, ties to the lower list number;
 *   3. a listed row's approximate score: its list's coarse score plus its residual's, the int16-quantised
 *      weights w = scale * p (largest |w| -> 32767) against its int8 codes (an integer dot, then / the
 *      quantisation step); the `width` best rows kept, by (score desc, id asc), skipping rows of the excluded prompt group (filed with each row); while fewer than k were kept and lists
 *      remain, the next list in coarse order is visited too;
 *   4. the kept rows re-scored exactly from their float16 rows (accumulated in double), the k best
 *      returned by (cosine desc, id asc), as local row numbers.
 * keyscan_chains: eq. (2)'s chains of those neighbours (decoder/drafters/semantic.py semantic_chains);
 * keyscan_key: both in one call (the drafter's key pass); keyscan_run: the same, its arguments in one KeyJob.
 * No allocation: one query is tens of microseconds of work on one core. keyscan_submit / keyscan_collect (at the
 * end) run keyscan_key on a worker thread, so that the caller's own work overlaps it.
 *
 * Arithmetic the reference repeats exactly (so the tests compare candidate sets, not just recall): sums of
 * float32 products accumulate in index order, each product and each sum rounded (no FMA: built with
 * -ffp-contract=off, and the vector loops multiply then add); norms are double sums, the inverse rounded to
 * float32 once. Only the exact re-score (double sums, lanes in another order) differs, in its last bits. */
#define _POSIX_C_SOURCE 200809L /* clock_gettime, getpid with -std=c11 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#define KEYSCAN_SIMD 1
#else
#define KEYSCAN_SIMD 0
#endif

typedef struct {
    int32_t d, dims, nlist, nprobe, width, pad;
    const float *mean;      /* [d] */
    const uint16_t *proj;   /* float16 [d, dims] */
    const float *scale;     /* [dims] code step per projected dimension */
    const uint16_t *cent;   /* float16 [dims, nlist], the centroids transposed */
    const int64_t *codes_ptr, *ids_ptr, *groups_ptr, *sizes; /* per list: int8 [size, dims] codes, int64 [size]
                                                                * global ids, int32 [size] prompt groups */
    const uint16_t *matrix; /* [n, d] float16 unit rows, local numbering */
    int64_t row_base, n;
    float *fwork;           /* d + dims + nlist + width floats */
    int32_t *iwork;         /* 2 * nlist ints */
    int64_t *lwork;         /* width ids */
    int16_t *wq;            /* dims */
} KeyScan;

int32_t keyscan_simd(void) { return KEYSCAN_SIMD; }

static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(mant & 0x400)) { mant <<= 1; exp--; }
            bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* sum_i row[i] * q[i], the float16 row widened exactly, products and sum in double */
static double dot_half(const uint16_t *row, const float *q, int32_t d) {
    int32_t i = 0;
    double acc = 0.0;
#if KEYSCAN_SIMD
    __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
    for (; i + 8 <= d; i += 8) {
        __m256 r = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + i)));
        __m256 x = _mm256_loadu_ps(q + i);
        a0 = _mm256_fmadd_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(r)), _mm256_cvtps_pd(_mm256_castps256_ps128(x)), a0);
        a1 = _mm256_fmadd_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(r, 1)), _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1)), a1);
    }
    double lanes[4];
    _mm256_storeu_pd(lanes, _mm256_add_pd(a0, a1));
    acc = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
#endif
    for (; i < d; i++) acc += (double)half_to_float(row[i]) * (double)q[i];
    return acc;
}

static void widen_half(const uint16_t *h, float *x, int32_t d) {
    int32_t i = 0;
#if KEYSCAN_SIMD
    for (; i + 8 <= d; i += 8) _mm256_storeu_ps(x + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
#endif
    for (; i < d; i++) x[i] = half_to_float(h[i]);
}

static void prefetch_span(const char *p, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 1);
}

static int32_t dot_codes(const int8_t *c, const int16_t *w, int32_t dims) {
    int32_t j = 0, acc = 0;
#if KEYSCAN_SIMD
    __m256i a = _mm256_setzero_si256();
    for (; j + 16 <= dims; j += 16)
        a = _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(c + j))),
                                                  _mm256_loadu_si256((const __m256i *)(w + j))));
    __m128i h = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4e));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xb1));
    acc = _mm_cvtsi128_si32(h);
#endif
    for (; j < dims; j++) acc += (int32_t)c[j] * (int32_t)w[j];
    return acc;
}

#if KEYSCAN_SIMD
/* dot_codes of 8 consecutive rows (dims a multiple of 16), the 8 sums in one vector; the horizontal adds are
 * shared by the 8 rows (integer sums: any order gives dot_codes' values) */
static __m256i dot_codes8(const int8_t *c, const int16_t *w, int32_t dims) {
    __m256i a[8];
    for (int32_t b = 0; b < 8; b++) a[b] = _mm256_setzero_si256();
    for (int32_t j = 0; j < dims; j += 16) {
        const __m256i wj = _mm256_loadu_si256((const __m256i *)(w + j));
        for (int32_t b = 0; b < 8; b++)
            a[b] = _mm256_add_epi32(a[b], _mm256_madd_epi16(
                _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(c + (int64_t)b * dims + j))), wj));
    }
    const __m256i q0 = _mm256_hadd_epi32(_mm256_hadd_epi32(a[0], a[1]), _mm256_hadd_epi32(a[2], a[3]));
    const __m256i q1 = _mm256_hadd_epi32(_mm256_hadd_epi32(a[4], a[5]), _mm256_hadd_epi32(a[6], a[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(q0, q1, 0x20), _mm256_permute2x128_si256(q0, q1, 0x31));
}
#endif

/* (score desc, id asc): a is better than b */
static int better(float sa, int64_t ia, float sb, int64_t ib) { return sa > sb || (sa == sb && ia < ib); }

/* min-heap of the `cap` best (root = the worst kept) */
static void heap_push(float *hs, int64_t *hi, int32_t *size, int32_t cap, float s, int64_t id) {
    int32_t j;
    if (*size < cap) {
        j = (*size)++;
        while (j > 0) {
            int32_t p = (j - 1) / 2;
            if (!better(hs[p], hi[p], s, id)) break;
            hs[j] = hs[p]; hi[j] = hi[p]; j = p;
        }
        hs[j] = s; hi[j] = id;
        return;
    }
    if (!better(s, id, hs[0], hi[0])) return;
    j = 0;
    for (;;) {
        int32_t l = 2 * j + 1, r = l + 1, m = j;
        float ms = s; int64_t mi = id;
        if (l < cap && better(ms, mi, hs[l], hi[l])) { m = l; ms = hs[l]; mi = hi[l]; }
        if (r < cap && better(ms, mi, hs[r], hi[r])) { m = r; }
        if (m == j) break;
        hs[j] = hs[m]; hi[j] = hi[m]; j = m;
    }
    hs[j] = s; hi[j] = id;
}

/* p = (x - mean) @ proj, proj float16 [d, dims] (half the bytes: a query runs with cold caches); the axpy
 * form, blocks of 64 outputs held in registers */
static void project(const KeyScan *ks, const float *x, float *p) {
    const int32_t d = ks->d, dims = ks->dims;
    int32_t j0 = 0;
#if KEYSCAN_SIMD
    for (; j0 + 8 <= dims; j0 += 64) {
        const int32_t blocks = (dims - j0 >= 64 ? 64 : (dims - j0) / 8 * 8) / 8;
        __m256 acc[8];
        for (int32_t b = 0; b < 8; b++) acc[b] = _mm256_setzero_ps();
        for (int32_t i = 0; i < d; i++) {
            const __m256 xi = _mm256_set1_ps(x[i] - ks->mean[i]);
            const uint16_t *row = ks->proj + (int64_t)i * dims + j0;
            for (int32_t b = 0; b < blocks; b++)
                acc[b] = _mm256_add_ps(acc[b], _mm256_mul_ps(xi, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 8 * b)))));
        }
        for (int32_t b = 0; b < blocks; b++) _mm256_storeu_ps(p + j0 + 8 * b, acc[b]);
        if (blocks < 8) { j0 += 8 * blocks; break; }
    }
#endif
    for (int32_t j = j0; j < dims; j++) p[j] = 0.0f;
    for (int32_t i = 0; i < d && j0 < dims; i++) {
        const float xi = x[i] - ks->mean[i];
        const uint16_t *row = ks->proj + (int64_t)i * dims;
        for (int32_t j = j0; j < dims; j++) p[j] += xi * half_to_float(row[j]);
    }
}

/* the inner product of p with every centroid (float16 [dims, nlist]), blocks of 64 lists in registers */
static void coarse(const KeyScan *ks, const float *p, float *cs) {
    const int32_t dims = ks->dims, nlist = ks->nlist;
    int32_t l0 = 0;
#if KEYSCAN_SIMD
    for (; l0 + 64 <= nlist; l0 += 64) {
        __m256 acc[8];
        for (int32_t b = 0; b < 8; b++) acc[b] = _mm256_setzero_ps();
        for (int32_t j = 0; j < dims; j++) {
            const __m256 pj = _mm256_set1_ps(p[j]);
            const uint16_t *row = ks->cent + (int64_t)j * nlist + l0;
            for (int32_t b = 0; b < 8; b++)
                acc[b] = _mm256_add_ps(acc[b], _mm256_mul_ps(pj, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 8 * b)))));
        }
        for (int32_t b = 0; b < 8; b++) _mm256_storeu_ps(cs + l0 + 8 * b, acc[b]);
    }
#endif
    for (int32_t l = l0; l < nlist; l++) cs[l] = 0.0f;
    for (int32_t j = 0; j < dims && l0 < nlist; j++) {
        const float pj = p[j];
        const uint16_t *row = ks->cent + (int64_t)j * nlist;
        for (int32_t l = l0; l < nlist; l++) cs[l] += pj * half_to_float(row[l]);
    }
}

/* keyscan_encode: m float16 rows (the pool's, [m, d]) filed: each projected, scaled to unit length, its
 * list the nearest centroid by inner product (ties to the lower list), its codes its residual from that
 * centroid, rint((y - c) / scale) clipped to +-127. Single-threaded on purpose: a BLAS thread pool left spinning after an append stole the
 * serving thread's core (2-core machine: 3-4 ms stalls in later drafting passes). */
void keyscan_encode(const KeyScan *ks, const uint16_t *rows, int64_t m, int32_t *out_list, int8_t *out_codes) {
    const int32_t d = ks->d, dims = ks->dims, nlist = ks->nlist;
    float *x = ks->fwork, *p = x + d, *cs = p + dims;
    for (int64_t r = 0; r < m; r++) {
        widen_half(rows + r * d, x, d);
        project(ks, x, p);
        double norm = 0.0;
        for (int32_t j = 0; j < dims; j++) norm += (double)p[j] * (double)p[j];
        float inv = norm > 0.0 ? (float)(1.0 / sqrt(norm)) : 0.0f;
        for (int32_t j = 0; j < dims; j++) p[j] *= inv;
        coarse(ks, p, cs);
        int32_t best = 0;
        for (int32_t l = 1; l < nlist; l++)
            if (cs[l] > cs[best]) best = l;
        out_list[r] = best;
        for (int32_t j = 0; j < dims; j++) {
            float c = rintf((p[j] - half_to_float(ks->cent[(int64_t)j * nlist + best])) / ks->scale[j]);
            out_codes[r * dims + j] = (int8_t)(c > 127.0f ? 127.0f : (c < -127.0f ? -127.0f : c));
        }
    }
}

/* a scanned row's approximate score s offered to the heap of the `width` best: rows outside the pool's local
 * range or of the excluded prompt group never enter */
static void consider(const KeyScan *ks, float *hs, int64_t *hi, int32_t *size, float s, int64_t id, int32_t group,
                     int32_t excluded) {
    if (*size == ks->width && !better(s, id, hs[0], hi[0])) return;
    const int64_t local = id - ks->row_base;
    if (local < 0 || local >= ks->n || group == excluded) return;
    heap_push(hs, hi, size, ks->width, s, id);
}

/* list order: coarse desc, list number asc */
static int list_before(const float *cs, int32_t a, int32_t b) { return cs[a] > cs[b] || (cs[a] == cs[b] && a < b); }

int64_t keyscan_query(const KeyScan *ks, const float *state, int32_t excluded, int32_t k,
                      float *out_scores, int64_t *out_rows) {
    const int32_t d = ks->d, dims = ks->dims, nlist = ks->nlist;
    float *q = ks->fwork, *p = q + d, *cs = p + dims, *hs = cs + nlist;
    int32_t *order = ks->iwork, *visited = order + nlist;
    int64_t *hi = ks->lwork;
    if (k <= 0 || k > ks->width || ks->n <= 0) return 0;
    double norm = 0.0;
    for (int32_t i = 0; i < d; i++) norm += (double)state[i] * (double)state[i];
    float inv = norm > 0.0 ? (float)(1.0 / sqrt(norm)) : 0.0f;
    for (int32_t i = 0; i < d; i++) q[i] = state[i] * inv;
    project(ks, q, p);
    coarse(ks, p, cs);
    float wmax = 0.0f;
    for (int32_t j = 0; j < dims; j++) {
        float w = ks->scale[j] * p[j];
        if (fabsf(w) > wmax) wmax = fabsf(w);
    }
    const float to_q = wmax > 0.0f ? 32767.0f / wmax : 0.0f;
    for (int32_t j = 0; j < dims; j++) ks->wq[j] = (int16_t)lrintf((ks->scale[j] * p[j]) * to_q);
    /* the nprobe best lists by insertion; more, one at a time, only while fewer than k rows were kept */
    int32_t size = 0, nvisit = 0; /* the caller keeps k <= ks->width */
    for (int32_t l = 0; l < nlist; l++) visited[l] = 0;
    for (;;) {
        int32_t want = nvisit < ks->nprobe ? ks->nprobe : nvisit + 1;
        if (want > nlist) want = nlist;
        int32_t have = 0;
        for (int32_t l = 0; l < nlist; l++) { /* the `want` best lists, sorted */
            if (have == want && !list_before(cs, l, order[want - 1])) continue;
            int32_t j = have < want ? have++ : want - 1;
            while (j > 0 && list_before(cs, l, order[j - 1])) { order[j] = order[j - 1]; j--; }
            order[j] = l;
        }
        for (int32_t t = 0; t < want; t++) /* the lists' first lines: each list is its own stream */
            if (!visited[order[t]]) prefetch_span((const char *)(intptr_t)ks->codes_ptr[order[t]], 4 * 64);
        for (int32_t t = 0; t < want; t++) {
            int32_t l = order[t];
            if (visited[l]) continue;
            visited[l] = 1;
            nvisit++;
            const int8_t *codes = (const int8_t *)(intptr_t)ks->codes_ptr[l];
            const int64_t *ids = (const int64_t *)(intptr_t)ks->ids_ptr[l];
            const int32_t *groups = (const int32_t *)(intptr_t)ks->groups_ptr[l]; /* beside the codes: a random
                                                  lookup per heap candidate cost more than the scan itself */
            const float base = cs[l]; /* a row's code is its residual from its list's centroid */
            const int64_t rows = ks->sizes[l];
            int64_t r = 0;
#if KEYSCAN_SIMD
            /* 8 rows at a time, the scalar loop's float steps on 8 lanes (the same values); a block none of whose
             * scores reaches the heap's worst is passed over whole (the scan's integer work halves) */
            if (to_q > 0.0f && dims % 16 == 0) {
                const __m256 vbase = _mm256_set1_ps(base), vq = _mm256_set1_ps(to_q);
                float s8[8];
                for (; r + 8 <= rows; r += 8) {
                    const __m256 v = _mm256_add_ps(vbase, _mm256_div_ps(_mm256_cvtepi32_ps(
                        dot_codes8(codes + r * dims, ks->wq, dims)), vq));
                    if (size == ks->width && !_mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(hs[0]), _CMP_GE_OQ)))
                        continue;
                    _mm256_storeu_ps(s8, v);
                    for (int32_t b = 0; b < 8; b++)
                        consider(ks, hs, hi, &size, s8[b], ids[r + b], groups[r + b], excluded);
                }
            }
#endif
            for (; r < rows; r++)
                consider(ks, hs, hi, &size,
                         base + (to_q > 0.0f ? (float)dot_codes(codes + r * dims, ks->wq, dims) / to_q : 0.0f),
                         ids[r], groups[r], excluded);
        }
        if (size >= k || nvisit >= nlist) break;
    }
    /* exact re-score of the kept rows (all their lines requested first: random rows of a large matrix
     * are memory latency, overlapped this way); the k best by insertion */
    for (int32_t t = 0; t < size; t++) prefetch_span((const char *)(ks->matrix + (hi[t] - ks->row_base) * d), 2 * d);
    int32_t found = 0;
    for (int32_t t = 0; t < size; t++) {
        int64_t local = hi[t] - ks->row_base;
        float s = (float)dot_half(ks->matrix + local * d, q, d);
        if (found == k && !(s > out_scores[k - 1] || (s == out_scores[k - 1] && local < out_rows[k - 1]))) continue;
        int32_t j = found < k ? found++ : k - 1;
        while (j > 0 && (s > out_scores[j - 1] || (s == out_scores[j - 1] && local < out_rows[j - 1]))) {
            out_scores[j] = out_scores[j - 1]; out_rows[j] = out_rows[j - 1]; j--;
        }
        out_scores[j] = s; out_rows[j] = local;
    }
    return found;
}

/* eq. (2)'s chains (decoder/drafters/semantic.py semantic_chains): the schedule, the pool's arrays and the
 * output buffers, set once by the caller (data/index/keyscan.py ChainSpec) */
typedef struct {
    const double *thresholds; /* D(s): the first threshold the similarity reaches gives its depth */
    const int32_t *depths;
    int32_t n_sched, n_rank;  /* n_rank > 0: depth by neighbour rank instead (rank_depths) */
    const int32_t *rank_depths;
    int32_t offset, min_len, max_len, pad;
    const int64_t *row_flat, *row_end; /* per pool row: the flat index of its token, its trace's end */
    const int32_t *tokens;             /* every trace's tokens, back to back */
    int32_t *out_tokens, *out_lens;    /* the chains back to back [m * max_len], their lengths [m] */
} ChainSpec;

/* neighbour j (decreasing similarity) at flat token row_flat[rows[j]] of a trace ending at row_end[rows[j]]
 * gives tokens[flat + offset : flat + offset + D], cut at the trace end, kept when at least min_len long and
 * not a repeat; returns the number of chains */
int32_t keyscan_chains(const ChainSpec *cs, const float *scores, const int64_t *rows, int32_t m) {
    int32_t count = 0, max_len = cs->max_len, used = 0;
    /* the neighbours' pointers, then their tokens, requested before use: each is a cold random line */
    for (int32_t j = 0; j < m; j++) {
        __builtin_prefetch(cs->row_flat + rows[j], 0, 1);
        __builtin_prefetch(cs->row_end + rows[j], 0, 1);
    }
    for (int32_t j = 0; j < m; j++) prefetch_span((const char *)(cs->tokens + cs->row_flat[rows[j]] + cs->offset), 4 * max_len);
    for (int32_t j = 0; j < m; j++) {
        int32_t depth = 0;
        if (cs->n_rank > 0) {
            depth = j < cs->n_rank ? cs->rank_depths[j] : 0;
        } else {
            for (int32_t t = 0; t < cs->n_sched; t++)
                if ((double)scores[j] >= cs->thresholds[t]) { depth = cs->depths[t]; break; }
        }
        if (depth <= 0) continue;
        if (depth > max_len) depth = max_len;
        int64_t lo = cs->row_flat[rows[j]] + cs->offset, hi = lo + depth;
        if (hi > cs->row_end[rows[j]]) hi = cs->row_end[rows[j]];
        int32_t len = (int32_t)(hi - lo);
        if (len < cs->min_len) continue;
        const int32_t *chain = cs->tokens + lo;
        int repeat = 0;
        for (int32_t c = 0, at = 0; c < count && !repeat; at += cs->out_lens[c++])
            repeat = cs->out_lens[c] == len && memcmp(cs->out_tokens + at, chain, (size_t)len * 4) == 0;
        if (repeat) continue;
        memcpy(cs->out_tokens + used, chain, (size_t)len * 4);
        used += len;
        cs->out_lens[count++] = len;
    }
    return count;
}

/* keyscan_query, then (when the best similarity reaches theta) keyscan_chains of its neighbours into the
 * spec's buffers (*n_chains; -1 when the key did not fire): the key's whole pass in one call */
int64_t keyscan_key(const KeyScan *ks, const ChainSpec *cs, const float *state, int32_t excluded, int32_t k,
                    double theta, float *out_scores, int64_t *out_rows, int32_t *n_chains) {
    int64_t found = keyscan_query(ks, state, excluded, k, out_scores, out_rows);
    *n_chains = found > 0 && (double)out_scores[0] >= theta ? keyscan_chains(cs, out_scores, out_rows, (int32_t)found) : -1;
    return found;
}

/* The key's pass on a second core (data/index/pruner.py `submit_key` / `collect_key`): `keyscan_submit` hands
 * keyscan_key's arguments to one worker thread per process and returns at once, so the drafter builds its
 * lexical tree meanwhile; `keyscan_collect` waits for the answer. One job at a time: a submit while a job is
 * out first waits for it (its answer is dropped). After an answer the worker polls for the next job for
 * WORKER_POLL_S, then sleeps on a condition variable (no core spent while idle); a process forked while it
 * existed starts its own. The caller keeps every array the
 * job reads alive and unchanged until the collect (`keyscan_drain` before changing them). */
#include <pthread.h>
#include <stdatomic.h>
#include <time.h>
#include <unistd.h>

/* keyscan_key's arguments, as one struct (data/index/keyscan.py KeyJob): one pointer to pass per submit */
typedef struct {
    const KeyScan *ks;
    const ChainSpec *cs;
    const float *state;   /* read by the worker: unchanged until the collect */
    float *out_scores;
    int64_t *out_rows;
    int32_t *n_chains;
    int32_t excluded, k;
    double theta;
} KeyJob;

/* keyscan_key on a job, here (the drafter's inline key pass) */
int64_t keyscan_run(const KeyJob *j) {
    return keyscan_key(j->ks, j->cs, j->state, j->excluded, j->k, j->theta, j->out_scores, j->out_rows, j->n_chains);
}

static struct {
    pid_t pid;            /* the process that started the worker (0: none) */
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    atomic_int phase;     /* 0 idle, 1 submitted, 2 answered */
    atomic_int sleeping;  /* the worker waits on cv (a submit must signal it) */
    KeyJob job;           /* a copy: the caller may change its own once the submit returns */
    int64_t found;
    double busy_s;        /* seconds the worker spent answering (it runs beside the caller) */
    int64_t jobs;
    int64_t wakes;        /* submits that found it asleep (and paid the wake-up) */
} worker;

/* how long the worker polls after an answer: over the whole API-Bank store (replay), 9% of the gaps between
 * two queries were 2 ms or more and 2% 5 ms or more (a request's end, its trace's append, the next one's first
 * passes); a gap past the poll costs the next submit a wake-up */
#define WORKER_POLL_S 0.005

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void relax(void) {
#if KEYSCAN_SIMD
    _mm_pause();
#endif
}

static void *worker_main(void *unused) {
    (void)unused;
    for (;;) {
        /* poll for the next job for WORKER_POLL_S, then sleep: a wake-up is a system call on the submitting
         * thread (27 us a submit on a 2-vCPU virtual machine, more than the query), a poll is a load */
        const double until = now_s() + WORKER_POLL_S;
        for (int spin = 1; atomic_load(&worker.phase) != 1; spin++) {
            relax();
            if (spin % 256 == 0 && now_s() > until) break;
        }
        if (atomic_load(&worker.phase) != 1) { /* the poll ran out: sleep until a submit signals */
            pthread_mutex_lock(&worker.mu);
            atomic_store(&worker.sleeping, 1);
            while (atomic_load(&worker.phase) != 1) pthread_cond_wait(&worker.cv, &worker.mu);
            atomic_store(&worker.sleeping, 0);
            pthread_mutex_unlock(&worker.mu);
        }
        const double t0 = now_s();
        worker.found = keyscan_run(&worker.job);
        worker.busy_s += now_s() - t0;
        worker.jobs++;
        pthread_mutex_lock(&worker.mu);
        atomic_store_explicit(&worker.phase, 2, memory_order_release);
        pthread_cond_broadcast(&worker.cv);
        pthread_mutex_unlock(&worker.mu);
    }
    return NULL;
}

/* the answer of the job out (waits for it): spins briefly (a query is tens of microseconds), then sleeps */
int64_t keyscan_collect(void) {
    if (worker.pid != getpid()) return -1;
    int phase = atomic_load_explicit(&worker.phase, memory_order_acquire);
    if (phase == 0) return -1;
    for (int spin = 0; phase == 1 && spin < 20000; spin++) {
        relax();
        phase = atomic_load_explicit(&worker.phase, memory_order_acquire);
    }
    if (phase == 1) {
        pthread_mutex_lock(&worker.mu);
        while (atomic_load_explicit(&worker.phase, memory_order_acquire) == 1)
            pthread_cond_wait(&worker.cv, &worker.mu);
        pthread_mutex_unlock(&worker.mu);
    }
    const int64_t found = worker.found;
    atomic_store_explicit(&worker.phase, 0, memory_order_release);
    return found;
}

/* no job out once it returns (before the caller changes an array a job reads) */
void keyscan_drain(void) {
    if (worker.pid == getpid() && atomic_load_explicit(&worker.phase, memory_order_acquire) != 0) keyscan_collect();
}

/* the job to the worker; 0 when it took it, -1 when no worker could be started (the caller then runs
 * keyscan_key itself) */
int32_t keyscan_submit(const KeyJob *job) {
    if (worker.pid != getpid()) {
        pthread_mutex_init(&worker.mu, NULL);
        pthread_cond_init(&worker.cv, NULL);
        atomic_store(&worker.phase, 0);
        atomic_store(&worker.sleeping, 0);
        worker.busy_s = 0.0;
        worker.jobs = 0;
        worker.wakes = 0;
        if (pthread_create(&worker.thread, NULL, worker_main, NULL) != 0) return -1;
        pthread_detach(worker.thread);
        worker.pid = getpid();
    }
    keyscan_drain();
    worker.job = *job;
    atomic_store(&worker.phase, 1); /* sequentially consistent with `sleeping`: either the worker sees the job
                                      * before it sleeps, or this sees it asleep and wakes it */
    if (atomic_load(&worker.sleeping)) {
        worker.wakes++;
        pthread_mutex_lock(&worker.mu);
        pthread_cond_signal(&worker.cv);
        pthread_mutex_unlock(&worker.mu);
    }
    return 0;
}

/* [seconds the worker spent answering, jobs answered, submits that woke it] in this process */
void keyscan_worker_stats(double *out) {
    const int mine = worker.pid == getpid();
    out[0] = mine ? worker.busy_s : 0.0;
    out[1] = mine ? (double)worker.jobs : 0.0;
    out[2] = mine ? (double)worker.wakes : 0.0;
}
