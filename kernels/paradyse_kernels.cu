// kernels/paradyse_kernels.cu: the one translation unit that compiles paradyse's CUDA kernels into a program.
// This repository's programs link it as the object library paradyse_cuda_kernels (cmake/ParadyseCuda.cmake); a
// consumer of the installed package gets it through the CUDA component: linking paradyse::cuda_kernels compiles this
// file (installed as include/paradyse/kernels/paradyse_kernels.cu) once into the consumer's program.
#include "all.cuh"
