// exp, tanh, silu and GELU (tanh form) on any `Vec` of vec_avx512.h / vec_avx2.h: Cephes' single
// precision exp (polynomial of degree 5 after range reduction, about 1 ulp on [-87, 88]).
// Included inside namespace conduit_cpu::CONDUIT_ISA after the Vec of that instruction set.
#pragma once

template <class V>
inline typename V::R exp_poly(typename V::R x) {
  using R = typename V::R;
  x = V::min(V::max(x, V::set1(-88.3762626647949f)), V::set1(88.3762626647949f));
  R fx = V::floor(V::fma(x, V::set1(1.44269504088896341f), V::set1(0.5f)));
  x = V::sub(x, V::mul(fx, V::set1(0.693359375f)));
  x = V::sub(x, V::mul(fx, V::set1(-2.12194440e-4f)));
  R y = V::set1(1.9875691500e-4f);
  y = V::fma(y, x, V::set1(1.3981999507e-3f));
  y = V::fma(y, x, V::set1(8.3334519073e-3f));
  y = V::fma(y, x, V::set1(4.1665795894e-2f));
  y = V::fma(y, x, V::set1(1.6666665459e-1f));
  y = V::fma(y, x, V::set1(5.0000001201e-1f));
  y = V::fma(y, V::mul(x, x), V::add(x, V::set1(1.0f)));
  return V::mul(y, V::pow2n(fx));
}

// tanh(x) = 1 - 2 / (exp(2x) + 1): exact limits at +-inf, absolute error about 1e-7 near 0.
template <class V>
inline typename V::R tanh_poly(typename V::R x) {
  typename V::R one = V::set1(1.0f);
  return V::sub(one, V::div(V::set1(2.0f), V::add(V::exp(V::add(x, x)), one)));
}

template <class V>
inline typename V::R silu(typename V::R x) {
  return V::div(x, V::add(V::set1(1.0f), V::exp(V::sub(V::zero(), x))));
}

template <class V>
inline typename V::R gelu_tanh(typename V::R x) {
  using R = typename V::R;
  R inner = V::mul(V::set1(0.7978845608028654f), V::fma(V::mul(V::set1(0.044715f), x), V::mul(x, x), x));
  return V::mul(V::mul(V::set1(0.5f), x), V::add(V::set1(1.0f), V::tanh(inner)));
}
