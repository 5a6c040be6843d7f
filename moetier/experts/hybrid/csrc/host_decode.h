// What a weight is, per row kind, for the compiled host expert kernel (host_experts.cpp includes this after
// its SIMD width VW and vector types): bf16 and fp32 rows as stored; FP8 rows' e4m3 bytes times their
// float32 128 x 128 block scales; 4-bit rows (NVFP4, INT4) with codes two per byte, the even element in the
// LOW nibble (quant/packed4.py), and one group scale per row and group along K:
//     FP8    float32(e4m3) * block scale                        (quant/fp8_block.dequantize)
//     NVFP4  e2m1(code) * (float32(e4m3 scale) * scale_2)       (quant/nvfp4.dequantize's two products)
//     INT4   (code - 8) * float32(bf16 scale)                   (quant/int4.dequantize's, exact in fp32)
//            (code - zcode) * float32(bf16 scale)               asymmetric INT4: the group's zero code
// each rounded once to bf16 for the rounded kinds (a bf16 model), as the GPU kernels and RowLayout.weights.
// Groups run along K (16 for NVFP4, 128 or 32 for INT4); the kernel reads VW weights at k a multiple of VW,
// and VW divides every group and block size, so a chunk never straddles two scales.
#pragma once

// FP8R, NV4R, ...: the same weights rounded to bf16 (a bf16 model; see load_w). NV4: NVFP4 rows, I4 / I4S:
// INT4 rows in groups of 128 / 32, I4Z / I4ZS: asymmetric INT4 (zero codes) in groups of 128 / 32
// (host_ext.KINDS and QUANT_KINDS have the same codes).
enum Kind { BF16 = 0, F32 = 1, FP8 = 2, FP8R = 3, NV4 = 4, NV4R = 5, I4 = 6, I4R = 7, I4S = 8, I4SR = 9,
            I4Z = 10, I4ZR = 11, I4ZS = 12, I4ZSR = 13, LAST_KIND = I4ZSR };
constexpr bool is4(int k) { return k >= NV4; }
constexpr bool asym(int k) { return k >= I4Z; }  // rows with a zero code per group (after the scales)
constexpr bool rounded(int k) { return k == FP8R || k == NV4R || k == I4R || k == I4SR || k == I4ZR || k == I4ZSR; }
constexpr int group_of(int k) {  // 4-bit kinds' group size
  return k <= NV4R ? 16 : (k == I4 || k == I4R || k == I4Z || k == I4ZR) ? 128 : 32;
}
constexpr int64_t half_bytes(int k) { return k == BF16 ? 4 : k == F32 ? 8 : k <= FP8R ? 2 : 1; }  // per weight

// fp32 -> the nearest bf16 (ties to even), kept as fp32; finite inputs (weights, activations)
static inline vf round_bf16(vf v) {
  vu32 b = (vu32)v;
  b = (b + 0x7fffu + ((b >> 16) & 1u)) & 0xffff0000u;
  return (vf)b;
}
static inline float round_bf16_1(float v) {
  uint32_t b; std::memcpy(&b, &v, 4);
  b = (b + 0x7fffu + ((b >> 16) & 1u)) & 0xffff0000u;
  std::memcpy(&v, &b, 4);
  return v;
}

// e4m3 byte -> fp32, exact: sign to bit 31, exponent+mantissa (7 bits) to bits 20..26 is the fp32 number
// 2^(e-127) (1 + m/8) (denormal when e = 0), and 2^120 moves the bias from 127 to e4m3's 7 (denormals
// included, which is why the region clears DAZ/FTZ). 0x7f / 0xff (NaN in e4m3fn) decode to +-480: weights
// are never NaN.
static inline vu32 widen_u8(const uint8_t* p) {  // VW bytes -> VW uint32 (GCC's convertvector goes through GPRs)
#if defined(__AVX512F__)
  return (vu32)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
#elif defined(__AVX2__)
  return (vu32)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
#else
  return __builtin_convertvector(loadu<vu8>(p), vu32);
#endif
}
static inline vf fp8_decode(const uint8_t* p) {
  vu32 t = widen_u8(p) << 24;
  vu32 bits = (t & 0x80000000u) | ((t & 0x7f000000u) >> 4);
  return (vf)bits * 0x1p120f;
}
static inline float fp8_decode1(uint8_t b) {
  uint32_t t = (uint32_t)b << 24, bits = (t & 0x80000000u) | ((t & 0x7f000000u) >> 4);
  float f; std::memcpy(&f, &bits, 4);
  return f * 0x1p120f;
}

typedef int32_t vi32 __attribute__((vector_size(VW * 4)));

static inline vu32 odd_shift() {  // lane l -> 4 * (l & 1): the high nibble for odd elements
  vu32 s;
  for (int l = 0; l < VW; l++) s[l] = (uint32_t)(l & 1) * 4u;
  return s;
}

// VW codes (0..15) from the VW/2 bytes at p: every byte twice, then each lane shifted to its nibble.
static inline vu32 nibbles(const uint8_t* p) {
#if defined(__AVX512F__)
  const __m128i b = _mm_loadl_epi64((const __m128i*)p);  // 8 bytes
  vu32 t = (vu32)_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(b, b));
#elif defined(__AVX2__)
  const __m128i b = _mm_cvtsi32_si128(loadu<int32_t>(p));  // 4 bytes
  vu32 t = (vu32)_mm256_cvtepu8_epi32(_mm_unpacklo_epi8(b, b));
#else
  vu32 t;
  for (int l = 0; l < VW; l++) t[l] = p[l >> 1];
#endif
  return (t >> odd_shift()) & 0xFu;
}
static inline uint32_t nibble1(const uint8_t* p, int64_t k) { return (p[k >> 1] >> ((k & 1) * 4)) & 0xFu; }

// E2M1 code -> fp32, exact: the sign to bit 31 and exponent+mantissa (3 bits) to bits 22..24 is the fp32
// number 2^(e-127) (1 + m/2) (denormal when e = 0: 0 or 2^-127), and 2^126 moves the bias from 127 to
// E2M1's 1: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives (code 8 is -0.0). Needs fp32 denormals, which
// the kernel's region keeps (it clears DAZ/FTZ for FP8 already).
static inline vf e2m1_decode(vu32 c) { return (vf)(((c & 8u) << 28) | ((c & 7u) << 22)) * 0x1p126f; }
static inline float e2m1_decode1(uint32_t c) {
  const uint32_t bits = ((c & 8u) << 28) | ((c & 7u) << 22);
  float f;
  std::memcpy(&f, &bits, 4);
  return f * 0x1p126f;
}

// INT4 code -> code - zero (8, or the group's zero code), exact
static inline vf int4_decode(vu32 c, int32_t zero) { return __builtin_convertvector((vi32)c - zero, vf); }
static inline float int4_decode1(uint32_t c, int32_t zero) { return (float)((int32_t)c - zero); }

static inline float bf16_to_f32(uint16_t b) {
  const uint32_t u = (uint32_t)b << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Byte offset of the float32 tensor scales in an NVFP4 row (gate's, up's, down's): after the down group
// scales (s2 + H * ceil(I / 16) e4m3 bytes), 4-byte aligned, as quant/packed4.row_offsets places them.
static inline int64_t nvfp4_globals(int64_t s2, int64_t H, int64_t I) { return (s2 + H * ((I + 15) / 16) + 3) & ~3LL; }

// The zero code of the weights from element k of a row whose zero codes start at z (asymmetric INT4, one
// byte per group); the symmetric INT4 rows' offset 8 otherwise (unused by the other kinds).
template <int KIND> static inline int32_t zero_at(const uint8_t* z, int64_t k) {
  if (asym(KIND)) return z[k / group_of(KIND)];
  return 8;
}

// Byte offset of an asymmetric INT4 row's zero codes, gate_up's [2I, groups(H)] then down's [H, groups(I)]:
// right after the down group scales (s2 + H * groups(I) bf16), as quant/packed4.zero_offsets places them.
template <int KIND> static inline int64_t zeros13(int64_t s2, int64_t H, int64_t I) {
  return s2 + 2 * H * ((I + group_of(KIND) - 1) / group_of(KIND));
}

// The scale of the VW weights from element k of a row whose scales start at s: FP8's float32 block scale
// (one per 128 columns); NVFP4's e4m3 group scale times the row's tensor scale t (one fp32 product, as
// nvfp4.dequantize takes it); INT4's bf16 group scale. bf16 / fp32 rows: 1.
template <int KIND> static inline float scale_at(const uint8_t* s, int64_t k, float t) {
  if (KIND == FP8 || KIND == FP8R) return ((const float*)s)[k >> 7];
  if (KIND == NV4 || KIND == NV4R) return fp8_decode1(s[k >> 4]) * t;
  if (is4(KIND)) return bf16_to_f32(loadu<uint16_t>(s + 2 * (k / group_of(KIND))));
  return 1.0f;
}

// VW weights of a row from element k (k a multiple of VW, so a chunk never straddles an FP8 block or a
// 4-bit group); `scale` is that chunk's scale (scale_at): the decoded code times it as the format's torch
// reference computes it, and for the rounded kinds rounded once to bf16, as the GPU kernels and the torch
// path (RowLayout.weights) do in a bf16 model.
template <int KIND> static inline vf load_w(const uint8_t* w, int64_t k, float scale, int32_t zero) {
  if (KIND == BF16) return (vf)(__builtin_convertvector(loadu<vu16>(w + 2 * k), vu32) << 16);
  if (KIND == F32) return loadu<vf>(w + 4 * k);
  vf f = KIND <= FP8R ? fp8_decode(w + k) * scale
       : KIND <= NV4R ? e2m1_decode(nibbles(w + k / 2)) * scale : int4_decode(nibbles(w + k / 2), zero) * scale;
  return rounded(KIND) ? round_bf16(f) : f;
}
template <int KIND> static inline float load_w1(const uint8_t* w, int64_t k, float scale, int32_t zero) {
  if (KIND == BF16) return bf16_to_f32(loadu<uint16_t>(w + 2 * k));
  if (KIND == F32) return loadu<float>(w + 4 * k);
  float f = KIND <= FP8R ? fp8_decode1(w[k]) * scale
          : KIND <= NV4R ? e2m1_decode1(nibble1(w, k)) * scale : int4_decode1(nibble1(w, k), zero) * scale;
  return rounded(KIND) ? round_bf16_1(f) : f;
}
