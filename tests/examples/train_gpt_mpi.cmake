# tests/examples/train_gpt_mpi.cmake: train_gpt run as MPI processes (mpirun -np NP train_gpt --backend mpi) writes the
# same per-step table as the thread-rank run of the same command: lengths, plans, losses to 17 digits, measured and
# predicted peak memory, step by step (only the timed columns of step_rows.cmake may differ), with the planner and
# with METP everywhere. Run by ctest (examples/CMakeLists.txt):
#   cmake -DEXE=train_gpt -DMPIEXEC=mpiexec -DNP=2 -DWORK=dir -DARGS="--steps;4;..." -P train_gpt_mpi.cmake
foreach(var EXE MPIEXEC NP WORK ARGS)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "train_gpt_mpi.cmake: -D${var}=... is required")
  endif()
endforeach()
file(REMOVE_RECURSE ${WORK})
file(MAKE_DIRECTORY ${WORK})

include(${CMAKE_CURRENT_LIST_DIR}/step_rows.cmake)  # run_train, step_rows, same_step_rows

foreach(variant IN ITEMS planner METP)
  set(args ${ARGS} --ranks ${NP})
  if(NOT variant STREQUAL "planner")
    list(APPEND args --strategy ${variant})
  endif()
  run_train("thread run (${variant})" ${EXE} ${args} --csv ${WORK}/${variant}_threads.csv)
  run_train("MPI run (${variant})" ${MPIEXEC} -np ${NP} --oversubscribe ${EXE} --backend mpi ${args}
            --csv ${WORK}/${variant}_mpi.csv)
  if(NOT last_output MATCHES "ranks: ${NP} MPI processes")
    message(FATAL_ERROR "the MPI run does not say it ran on ${NP} MPI processes:\n${last_output}")
  endif()
  step_rows(${WORK}/${variant}_threads.csv 0 rows_threads)
  step_rows(${WORK}/${variant}_mpi.csv 0 rows_mpi)
  same_step_rows("${variant}: the MPI run against the thread run" "${rows_threads}" "${rows_mpi}")
  list(LENGTH rows_threads n)
  message(STATUS "${variant}: ${n} steps equal on ${NP} MPI processes and ${NP} threads")
endforeach()
file(REMOVE_RECURSE ${WORK})
