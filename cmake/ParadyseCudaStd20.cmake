# CMake 3.25.1 rejects CUDA_STANDARD 20 / cuda_std_20 for nvcc (Kitware issue 23079, fixed in 3.25.2): it does not know
# the flag. paradyse_teach_cuda_std20() teaches it, in the caller's scope, once CUDA is enabled: the build does it
# (cmake/ParadyseCuda.cmake), and so does the installed package's config for a consumer that enabled CUDA (paradyse::cuda
# requires cuda_std_20).
macro(paradyse_teach_cuda_std20)
  if(CMAKE_CUDA_COMPILER_ID STREQUAL "NVIDIA" AND CMAKE_VERSION VERSION_LESS 3.25.2 AND NOT CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
    set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
    set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
    list(APPEND CMAKE_CUDA_COMPILE_FEATURES cuda_std_20)
    set(CMAKE_CUDA20_COMPILE_FEATURES cuda_std_20)
  endif()
endmacro()
