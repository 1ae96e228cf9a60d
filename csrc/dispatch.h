// Runtime dtype to template dispatch, shared by the CPU and CUDA implementations.
#pragma once

#include <ATen/Dispatch.h>

// Dispatch over the three activation dtypes; anything else was rejected by checks.h before.
// Its default case raises with the dtype it could not handle.
#define FDC_DISPATCH_FLOAT_TYPES(TYPE, NAME, ...)                                                       \
  AT_DISPATCH_SWITCH(TYPE, NAME,                                                                        \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__) \
                         AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))
