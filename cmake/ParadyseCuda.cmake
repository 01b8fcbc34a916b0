# The optional CUDA (cudart, cuBLAS, CCCL) and NCCL components.
#
# CMake 3.25.1 rejects CUDA_STANDARD 20 for nvcc (Kitware issue 23079, fixed in 3.25.2): we teach it the flag right
# after enabling CUDA (cmake/ParadyseCudaStd20.cmake, installed for consumers too). CMAKE_CUDA_ARCHITECTURES must be chosen before enable_language;
# the default here is 90 (H100/H200), one architecture to keep CI builds short.
set(PARADYSE_HAVE_CUDA OFF)
if(NOT PARADYSE_ENABLE_CUDA STREQUAL "OFF")
  include(CheckLanguage)
  if(NOT CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 90)
    endif()
    if(NOT DEFINED CMAKE_CUDA_HOST_COMPILER)
      set(CMAKE_CUDA_HOST_COMPILER ${CMAKE_CXX_COMPILER})
    endif()
    enable_language(CUDA)
    include(ParadyseCudaStd20)
    paradyse_teach_cuda_std20()
    find_package(CUDAToolkit REQUIRED)
    # cuBLAS's grouped GEMM (cublasSgemmGroupedBatched, ops/cuda/gemm.hpp gemm_grouped) came with CUDA 12.5.
    if(CUDAToolkit_VERSION VERSION_LESS 12.5)
      message(FATAL_ERROR "paradyse: CUDA ${CUDAToolkit_VERSION} found at ${CUDAToolkit_BIN_DIR}; the CUDA path needs "
                          "12.5 or later (cuBLAS's grouped GEMM)")
    endif()
    set(PARADYSE_HAVE_CUDA ON)
  elseif(PARADYSE_ENABLE_CUDA STREQUAL "ON")
    message(FATAL_ERROR "PARADYSE_ENABLE_CUDA=ON but no CUDA compiler was found (set CMAKE_CUDA_COMPILER)")
  endif()
endif()

if(PARADYSE_HAVE_CUDA)
  add_library(paradyse_cuda INTERFACE)
  add_library(paradyse::cuda ALIAS paradyse_cuda)
  set_target_properties(paradyse_cuda PROPERTIES EXPORT_NAME cuda)
  # cudart static: a program carries its runtime and needs only the driver, cuBLAS and NCCL on the machine it runs on.
  target_link_libraries(paradyse_cuda INTERFACE paradyse CUDA::cudart_static CUDA::cublas)
  target_compile_definitions(paradyse_cuda INTERFACE PARADYSE_WITH_CUDA=1
    $<$<COMPILE_LANGUAGE:CUDA>:FMT_USE_CONSTEXPR=1>)  # fmt 9 disables constexpr under nvcc, then fails to compile
  target_compile_features(paradyse_cuda INTERFACE cuda_std_20)
  list(APPEND PARADYSE_EXPORTED_TARGETS paradyse_cuda)

  # The kernels: the library stays header-only, and its CUDA kernels (the top-level kernels/, device code apart from
  # the host templates under include/) are compiled by nvcc once per program, in one translation unit,
  # kernels/paradyse_kernels.cu, that includes kernels/all.cuh. Everything else of the CUDA path, ops::Cuda, the
  # device memory and the communicators, is host code that the host compiler builds. Here the one translation unit
  # is an object library that every CUDA test, benchmark and example links.
  add_library(paradyse_cuda_kernels OBJECT ${PROJECT_SOURCE_DIR}/kernels/paradyse_kernels.cu)
  target_link_libraries(paradyse_cuda_kernels PUBLIC paradyse_cuda)
  target_compile_options(paradyse_cuda_kernels PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr -lineinfo>)
  set_target_properties(paradyse_cuda_kernels PROPERTIES CUDA_STANDARD 20)

  # The package's CUDA component for a consumer: kernels/ is installed as include/paradyse/kernels/ (CMakeLists.txt),
  # and a program that links paradyse::cuda_kernels compiles the installed paradyse_kernels.cu once into itself
  # (its project enables CUDA). Empty in this build tree, whose programs link the object library above instead.
  add_library(paradyse_cuda_kernel_source INTERFACE)
  add_library(paradyse::cuda_kernels ALIAS paradyse_cuda_kernel_source)
  set_target_properties(paradyse_cuda_kernel_source PROPERTIES EXPORT_NAME cuda_kernels)
  target_link_libraries(paradyse_cuda_kernel_source INTERFACE paradyse_cuda)
  target_sources(paradyse_cuda_kernel_source INTERFACE
    $<INSTALL_INTERFACE:$<INSTALL_PREFIX>/${CMAKE_INSTALL_INCLUDEDIR}/paradyse/kernels/paradyse_kernels.cu>)
  target_compile_options(paradyse_cuda_kernel_source INTERFACE $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr>)
  list(APPEND PARADYSE_EXPORTED_TARGETS paradyse_cuda_kernel_source)

  find_package(NCCL)
  if(NCCL_FOUND)
    add_library(paradyse_nccl INTERFACE)
    add_library(paradyse::nccl ALIAS paradyse_nccl)
    set_target_properties(paradyse_nccl PROPERTIES EXPORT_NAME nccl)
    target_link_libraries(paradyse_nccl INTERFACE paradyse_cuda NCCL::nccl)
    target_compile_definitions(paradyse_nccl INTERFACE PARADYSE_WITH_NCCL=1)
    list(APPEND PARADYSE_EXPORTED_TARGETS paradyse_nccl)
  endif()
  message(STATUS "paradyse: CUDA ${CUDAToolkit_VERSION}, architectures ${CMAKE_CUDA_ARCHITECTURES}, NCCL ${NCCL_VERSION}")
endif()
