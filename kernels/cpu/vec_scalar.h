// The portable "vector" of one float: the same kernels, compiled for any x86-64 (or other) CPU.
// Included inside namespace conduit_cpu::CONDUIT_ISA.
#pragma once

struct Vec {
  using R = float;
  static constexpr int W = 1;
  static constexpr int kTileW = 4;
  static constexpr int kTileX = 2;
  static constexpr int kGemvRows = 4;
  static constexpr int kPackedRows = 2;

  static R zero() { return 0.0f; }
  static R set1(float a) { return a; }
  static R load(const float* p) { return *p; }
  static R load(const bf16* p) { return bf16_to_float(*p); }
  static R load_n(const float* p, int) { return *p; }
  static R load_n(const bf16* p, int) { return bf16_to_float(*p); }
  static void store(float* p, R a) { *p = a; }
  static void store(bf16* p, R a) { *p = float_to_bf16(a); }
  static void store_n(float* p, R a, int) { *p = a; }
  static void store_n(bf16* p, R a, int) { *p = float_to_bf16(a); }
  static R round_bf16(R a) { return bf16_to_float(float_to_bf16(a)); }
  // KV cache codes (common.h): int8, and fp8 e4m3 decoded in software
  static R load_i8(const uint8_t* p) { return static_cast<float>(static_cast<int8_t>(*p)); }
  static R load_i8_n(const uint8_t* p, int) { return load_i8(p); }
  static R load_e4m3(const uint8_t* p) { return fp8_e4m3_to_float(*p); }
  static R load_e4m3_n(const uint8_t* p, int) { return load_e4m3(p); }

  static R add(R a, R b) { return a + b; }
  static R sub(R a, R b) { return a - b; }
  static R mul(R a, R b) { return a * b; }
  static R div(R a, R b) { return a / b; }
  static R fma(R a, R b, R c) { return a * b + c; }
  static R max(R a, R b) { return a > b ? a : b; }
  static R min(R a, R b) { return a < b ? a : b; }
  static float reduce_add(R a) { return a; }
  static float reduce_max(R a) { return a; }
  static R exp(R x) { return std::exp(x); }
  static R tanh(R x) { return std::tanh(x); }
};
