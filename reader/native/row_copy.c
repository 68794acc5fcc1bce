/* The stream's copy of tokens into batches (reader._row_copy, reader.streaming.stream).

   actx_copy_rows: for i in [0, n), copy row_bytes bytes from src + src_rows[i] * row_bytes
   to the address dst[i]. The stream calls it with src_rows ascending (a buffer read in
   order) and dst scattered over the buffer's batches: the reads stream through memory and
   the hardware prefetches them, while the writes go out as non-temporal stores, which need
   not read the destination line first (no read-for-ownership). A gather (random reads,
   ordered writes) waits on memory for every row instead; measured on the development
   machine, 1,792-byte rows of a mapped buffer: 13-14 GB/s on one core against 5 GB/s for
   numpy's take, 19-20 GB/s on two against 9.5.

   Where the CPU has no SSE2 (not x86-64) or a row or its target is not 16-byte aligned,
   rows are copied with memcpy. The stores are fenced before returning, so the rows are
   visible to any thread that learns the call returned. */

#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define ACTX_ROW_COPY_VERSION 2

int actx_row_copy_version(void) { return ACTX_ROW_COPY_VERSION; }

void actx_copy_rows(const char *src, const int64_t *src_rows, const int64_t *dst,
                    int64_t n, int64_t row_bytes) {
#if defined(__SSE2__)
  const int streaming = row_bytes % 16 == 0;
#endif
  for (int64_t i = 0; i < n; i++) {
    const char *from = src + src_rows[i] * row_bytes;
    char *to = (char *)(intptr_t)dst[i];
#if defined(__SSE2__)
    if (streaming && ((uintptr_t)to % 16) == 0) {
      const __m128i *s = (const __m128i *)from;
      __m128i *d = (__m128i *)to;
      for (int64_t k = 0; k < row_bytes / 16; k++)
        _mm_stream_si128(d + k, _mm_loadu_si128(s + k));
      continue;
    }
#endif
    memcpy(to, from, (size_t)row_bytes);
  }
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

/* actx_dequantise_rows: the copy above for a float8 hook, dequantised on the way
   (schemas/quantised.py's rule): for i in [0, n), the hidden bytes of row src_rows[i] of
   src, each looked up in table (float32 [256]: the value of each float8 byte) and times the
   token's scale scales[scale_rows[i]], to the address dst[i] as float32 (bfloat16 == 0) or
   bfloat16 (rounded once from the float32 product, to nearest even: ml_dtypes' cast). One
   pass over the bytes, on the thread that would have copied them: the host-side
   dequantisation of a whole batch afterwards (numpy's take, then a multiply) cost more
   than the copy itself.

   Rows whose target is 16-byte aligned and whose width is a multiple of 8 values go out
   as non-temporal stores, as above; others through plain stores. The products are the
   same float32 multiplications either way: bit for bit numpy's table[b] * scale. */

static inline uint16_t actx_bfloat16_bits(float value) {
  uint32_t bits;
  memcpy(&bits, &value, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u); /* NaN */
  return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

void actx_dequantise_rows(const uint8_t *src, const int64_t *src_rows, const float *scales,
                          const int64_t *scale_rows, const int64_t *dst, int64_t n,
                          int64_t hidden, const float *table, int bfloat16) {
  for (int64_t i = 0; i < n; i++) {
    const uint8_t *from = src + src_rows[i] * hidden;
    const float scale = scales[scale_rows[i]];
    char *to = (char *)(intptr_t)dst[i];
    int64_t k = 0;
#if defined(__SSE2__)
    if (((uintptr_t)to % 16) == 0 && hidden % 8 == 0) {
      const __m128 s = _mm_set1_ps(scale);
      for (; k < hidden; k += 8) {
        const uint8_t *b = from + k;
        __m128 lo = _mm_mul_ps(_mm_setr_ps(table[b[0]], table[b[1]], table[b[2]], table[b[3]]), s);
        __m128 hi = _mm_mul_ps(_mm_setr_ps(table[b[4]], table[b[5]], table[b[6]], table[b[7]]), s);
        if (!bfloat16) {
          _mm_stream_ps((float *)to + k, lo);
          _mm_stream_ps((float *)to + k + 4, hi);
          continue;
        }
        /* Round to nearest even, then keep the top 16 bits. No NaN test (it cost 70 % more
           time): a NaN here is the table's, 0x7fc00000 with its sign (e4m3fn bytes 0x7f,
           0xff), whose payload the multiplication keeps; rounding leaves it 0x7fc0, what
           ml_dtypes gives (the self-check on load covers those bytes). */
        const __m128i one = _mm_set1_epi32(1), half = _mm_set1_epi32(0x7fff);
        __m128i l = _mm_castps_si128(lo), h = _mm_castps_si128(hi);
        __m128i rl = _mm_add_epi32(_mm_add_epi32(l, half), _mm_and_si128(_mm_srli_epi32(l, 16), one));
        __m128i rh = _mm_add_epi32(_mm_add_epi32(h, half), _mm_and_si128(_mm_srli_epi32(h, 16), one));
        /* The top halves, sign-extended so that the signed saturating pack keeps them. */
        rl = _mm_srai_epi32(rl, 16);
        rh = _mm_srai_epi32(rh, 16);
        _mm_stream_si128((__m128i *)(to + 2 * k), _mm_packs_epi32(rl, rh));
      }
      continue;
    }
#endif
    if (!bfloat16) {
      for (; k < hidden; k++) {
        const float v = table[from[k]] * scale;
        memcpy(to + 4 * k, &v, 4);
      }
    } else {
      for (; k < hidden; k++) {
        const uint16_t v = actx_bfloat16_bits(table[from[k]] * scale);
        memcpy(to + 2 * k, &v, 2);
      }
    }
  }
#if defined(__SSE2__)
  _mm_sfence();
#endif
}
