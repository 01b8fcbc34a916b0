# tests/examples/train_gpt_zero3_prefetch.cmake: train_gpt --zero 3 with --zero3-prefetch on and off on each of MESHES
# (thread ranks), and on MPI_MESH under mpirun when MPIEXEC is given: each step's loss (to 17 digits) the same with
# the gathers a layer ahead as with each waited for where it is posted (model/zero3_prefetch.hpp: the same
# collectives on the same data), and every run trains.
#   cmake -DEXE=train_gpt -DMESHES="dp=2;dp=2,pp=2" -DWORK=dir -DARGS="--steps;4;..." [-DMPIEXEC=mpiexec
#         -DMPI_MESH=dp=2] -P train_gpt_zero3_prefetch.cmake
foreach(var EXE MESHES WORK ARGS)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "train_gpt_zero3_prefetch.cmake: -D${var}=... is required")
  endif()
endforeach()
file(MAKE_DIRECTORY ${WORK})
include(${CMAKE_CURRENT_LIST_DIR}/step_rows.cmake)  # run_train, step_column

# The losses of train_gpt on MESH with --zero3-prefetch SWITCH (after LAUNCH, a launcher command or empty), into out_var.
function(prefetch_losses mesh switch backend out_var)
  string(MAKE_C_IDENTIFIER "${mesh}_${switch}_${backend}" name)
  set(csv ${WORK}/${name}.csv)
  set(launch "")
  set(backend_args "")
  if(backend STREQUAL "mpi")
    string(REGEX MATCHALL "[0-9]+" sizes "${mesh}")
    set(ranks 1)
    foreach(n IN LISTS sizes)
      math(EXPR ranks "${ranks} * ${n}")
    endforeach()
    set(launch ${MPIEXEC} -np ${ranks} --oversubscribe)
    set(backend_args --backend mpi)
  endif()
  run_train("--mesh ${mesh} --zero 3 --zero3-prefetch ${switch} (${backend})" ${launch} ${EXE} ${ARGS} --mesh ${mesh}
            --zero 3 --zero3-prefetch ${switch} ${backend_args} --csv ${csv})
  step_column(${csv} loss losses)
  list(LENGTH losses n)
  if(n EQUAL 0)
    message(FATAL_ERROR "--mesh ${mesh} --zero3-prefetch ${switch} (${backend}) trained no step:\n${last_output}")
  endif()
  message(STATUS "--mesh ${mesh} --zero 3 --zero3-prefetch ${switch} (${backend}): ${losses}")
  set(${out_var} "${losses}" PARENT_SCOPE)
endfunction()

set(runs "")
foreach(mesh IN LISTS MESHES)
  list(APPEND runs "${mesh}|threads")
endforeach()
if(DEFINED MPIEXEC AND DEFINED MPI_MESH)
  list(APPEND runs "${MPI_MESH}|mpi")
endif()
foreach(run IN LISTS runs)
  string(REPLACE "|" ";" parts "${run}")
  list(GET parts 0 mesh)
  list(GET parts 1 backend)
  prefetch_losses(${mesh} off ${backend} off)
  prefetch_losses(${mesh} on ${backend} on)
  if(NOT "${on}" STREQUAL "${off}")
    message(FATAL_ERROR "--mesh ${mesh} --zero 3 (${backend}): the losses with --zero3-prefetch on\n  ${on}\ndiffer from "
                        "those with it off\n  ${off}")
  endif()
endforeach()
