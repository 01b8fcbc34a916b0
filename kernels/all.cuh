// kernels/all.cuh: every CUDA kernel of the library and the launchers that ops/cuda/ and the CUDA
// communicators declare. Compile it in exactly one .cu translation unit of a program (nvcc, -std=c++20,
// --expt-relaxed-constexpr); kernels/paradyse_kernels.cu is that unit (for this repository's programs and, through
// the package's paradyse::cuda_kernels, for a consumer's). Installed as include/paradyse/kernels/; the kernels include
// each other by file name (same folder) and the host declarations as "paradyse/ops/..." and "paradyse/comm/...".
//
// The launchers are declared in host headers (ops/cuda/*.hpp, comm/cuda_reduce.hpp) and defined here as ordinary,
// non-inline functions: an inline definition that nothing in this unit calls would never be emitted, and the host
// objects calling it would not link. Hence the rule of exactly one unit per program (two would define them twice).
#pragma once

#include "softmax.cuh"
#include "moe_ops.cuh"
#include "tensor_ops.cuh"
#include "comm_reduce.cuh"
#include "normalization.cuh"
#include "activation.cuh"
#include "rope.cuh"
#include "embedding.cuh"
#include "attention_forward.cuh"
#include "attention_backward.cuh"
#include "attention_tensor_core.cuh"
#include "cross_entropy.cuh"
#include "adamw.cuh"
#include "convert.cuh"
