// paradyse/kernels/all.cuh: every CUDA kernel of the library and the launchers that ops/cuda/ and the CUDA
// communicators declare. Compile it in exactly one .cu translation unit of a program (nvcc, -std=c++20,
// --expt-relaxed-constexpr); cmake/paradyse_kernels.cu is that unit for this repository's own programs.
//
// The launchers are declared in host headers (ops/cuda/*.hpp, comm/cuda_reduce.hpp) and defined here as ordinary,
// non-inline functions: an inline definition that nothing in this unit calls would never be emitted, and the host
// objects calling it would not link. Hence the rule of exactly one unit per program (two would define them twice).
#pragma once

#include "paradyse/kernels/softmax.cuh"
#include "paradyse/kernels/moe_ops.cuh"
#include "paradyse/kernels/tensor_ops.cuh"
#include "paradyse/kernels/comm_reduce.cuh"
#include "paradyse/kernels/normalization.cuh"
#include "paradyse/kernels/activation.cuh"
#include "paradyse/kernels/rope.cuh"
#include "paradyse/kernels/embedding.cuh"
#include "paradyse/kernels/attention_forward.cuh"
#include "paradyse/kernels/attention_backward.cuh"
#include "paradyse/kernels/attention_tensor_core.cuh"
#include "paradyse/kernels/cross_entropy.cuh"
#include "paradyse/kernels/adamw.cuh"
#include "paradyse/kernels/convert.cuh"
