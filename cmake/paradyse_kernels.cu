// The one translation unit that compiles paradyse's CUDA kernels (see cmake/ParadyseCuda.cmake). A program that uses
// ops::Cuda or the CUDA communicators without this build compiles the same line in one .cu file of its own.
#include "paradyse/kernels/all.cuh"
