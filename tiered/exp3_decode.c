/* The CPU decoder of one exp3-bf16 chunk (tiered/expcode.py's layout), built by tiered/native.py on first use.
 *
 * void tiered_exp3_init(void): fills the code table; call once, before any decode (tiered/native.py does).
 * int64_t tiered_exp3_decode(const uint8_t *src, int64_t len, int64_t n, uint16_t *out, int simd)
 *   src: the chunk's coded bytes (len of them, a coded body: not raw), n: its elements, out: n uint16;
 *   simd = 0 forces the scalar path (tests compare the two).
 *   Returns the escape bytes it used (>= 0; the caller checks that it is len minus the fixed sections), or
 *   -1: the codes ask for more escapes than the chunk holds (it stops before reading past src + len),
 *   -2: a block's escape start disagrees with the escapes its codes put before it (what the GPU decoder indexes by).
 *   Reads only src[0 .. len), writes only out[0 .. n). Thread-safe; no allocation.
 *
 * The AVX2 path (x86-64 CPUs that have it, checked at run time) decodes 32 elements a step: three code bit-plane
 * bytes per 8 elements expanded to 8 one-byte codes by a 256-entry table, the 7-entry exponent table applied with
 * one byte shuffle, and the bf16's low and high bytes built from the sign-and-mantissa byte with byte masks; an
 * escape (code 7) is patched afterwards from the escapes section, in order. Elsewhere (and for the last n % 32
 * elements) a scalar loop does the same per element. Both give the bits of tiered.expcode.decode_np. */
#include <stdint.h>
#include <string.h>

#define BLOCK 4096
#define M1 0x0101010101010101ULL

static uint64_t expand_tab[256]; /* byte -> its 8 bits as 8 bytes (bit k in byte k) */
static int avx2_ok;               /* set by tiered_exp3_init */

void tiered_exp3_init(void) {
    for (int b = 0; b < 256; b++) {
        uint64_t v = 0;
        for (int k = 0; k < 8; k++)
            if ((b >> k) & 1) v |= (uint64_t)1 << (8 * k);
        expand_tab[b] = v;
    }
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    avx2_ok = __builtin_cpu_supports("avx2") ? 1 : 0;
#endif
}

static inline uint64_t escapes_of(uint64_t c) { return c & (c >> 1) & (c >> 2) & M1; }

/* scalar decode of elements [i, n); k: escapes used before i. Returns k after n, or a negative error. */
static int64_t tail(const uint8_t *src, int64_t n, int64_t nb8, const uint8_t *p0, const uint8_t *sm,
                    const uint8_t *esc, int64_t n_esc, const uint32_t *starts, const uint8_t *tab, uint16_t *out,
                    int64_t i, int64_t k) {
    (void)src;
    for (; i < n; i++) {
        if ((i & (BLOCK - 1)) == 0) {
            uint32_t st;
            memcpy(&st, starts + i / BLOCK, 4);
            if ((int64_t)st != k) return -2;
        }
        int64_t j = i >> 3;
        int b = (int)(i & 7);
        int c = ((p0[j] >> b) & 1) | (((p0[nb8 + j] >> b) & 1) << 1) | (((p0[2 * nb8 + j] >> b) & 1) << 2);
        unsigned s = sm[i], e;
        if (c == 7) {
            if (k >= n_esc) return -1;
            e = esc[k++];
        } else {
            e = tab[c];
        }
        out[i] = (uint16_t)(((s & 0x80u) << 8) | (e << 7) | (s & 0x7Fu));
    }
    return k;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

__attribute__((target("avx2"))) static int64_t body_avx2(int64_t n, int64_t nb8, const uint8_t *p0,
                                                           const uint8_t *sm, const uint8_t *esc, int64_t n_esc,
                                                           const uint32_t *starts, const uint8_t *tab16,
                                                           uint16_t *out, int64_t *pi) {
    const uint8_t *p1 = p0 + nb8, *p2 = p0 + 2 * nb8;
    __m256i tab = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)tab16));
    __m256i m7f = _mm256_set1_epi8(0x7F), m80 = _mm256_set1_epi8((char)0x80);
    int64_t k = 0, i = 0;
    for (; i + 32 <= n; i += 32) {
        if ((i & (BLOCK - 1)) == 0) {
            uint32_t st;
            memcpy(&st, starts + i / BLOCK, 4);
            if ((int64_t)st != k) return -2;
        }
        int64_t j = i >> 3;
        uint64_t c[4];
        for (int q = 0; q < 4; q++)
            c[q] = expand_tab[p0[j + q]] | (expand_tab[p1[j + q]] << 1) | (expand_tab[p2[j + q]] << 2);
        __m256i cv = _mm256_set_epi64x((long long)c[3], (long long)c[2], (long long)c[1], (long long)c[0]);
        __m256i e = _mm256_shuffle_epi8(tab, cv); /* code 7 -> 0: patched below */
        __m256i s = _mm256_loadu_si256((const __m256i *)(sm + i));
        /* bf16 low byte: mantissa | exponent bit 0 << 7; high byte: sign | exponent >> 1 */
        __m256i lo = _mm256_or_si256(_mm256_and_si256(s, m7f), _mm256_and_si256(_mm256_slli_epi16(e, 7), m80));
        __m256i hi = _mm256_or_si256(_mm256_and_si256(s, m80), _mm256_and_si256(_mm256_srli_epi16(e, 1), m7f));
        __m256i ul = _mm256_unpacklo_epi8(lo, hi), uh = _mm256_unpackhi_epi8(lo, hi);
        _mm256_storeu_si256((__m256i *)(out + i), _mm256_permute2x128_si256(ul, uh, 0x20));
        _mm256_storeu_si256((__m256i *)(out + i + 16), _mm256_permute2x128_si256(ul, uh, 0x31));
        if (escapes_of(c[0]) | escapes_of(c[1]) | escapes_of(c[2]) | escapes_of(c[3])) {
            for (int q = 0; q < 4; q++) {
                for (uint64_t t = escapes_of(c[q]); t; t &= t - 1) {
                    if (k >= n_esc) return -1;
                    out[i + 8 * q + (__builtin_ctzll(t) >> 3)] |= (uint16_t)((unsigned)esc[k++] << 7);
                }
            }
        }
    }
    *pi = i;
    return k;
}

#endif

int64_t tiered_exp3_decode(const uint8_t *src, int64_t len, int64_t n, uint16_t *out, int simd) {
    int64_t nb = (n + BLOCK - 1) / BLOCK, nb8 = (n + 7) / 8;
    int64_t esco = 8 + 4 * nb + 3 * nb8 + n;
    if (n <= 0) return 0;
    if (len < esco) return -1;
    const uint32_t *starts = (const uint32_t *)(src + 8); /* read with memcpy: may be unaligned */
    const uint8_t *p0 = src + 8 + 4 * nb, *sm = p0 + 3 * nb8, *esc = src + esco;
    int64_t n_esc = len - esco;
    uint8_t tab[16] = {0};
    memcpy(tab, src, 7);
    int64_t i = 0, k = 0;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    if (simd && avx2_ok) {
        k = body_avx2(n, nb8, p0, sm, esc, n_esc, starts, tab, out, &i);
        if (k < 0) return k;
    }
#endif
    return tail(src, n, nb8, p0, sm, esc, n_esc, starts, tab, out, i, k);
}

/* 1 where the AVX2 path runs, for tests and benchmarks to say which one they measured */
int tiered_exp3_simd(void) {
    return avx2_ok;
}
