# tests/examples/train_gpt_mesh_moe_resume.cmake: checkpoints of train_gpt --mesh --experts (model/mesh_checkpoint.hpp's
# MoE layers: the router, every expert and the shared experts gathered over the expert, column and expert-data groups):
#   1. on the same mesh (MESH@Z, with its ep and etp): the run stopped at step K (--stop-after K) and resumed (--resume)
#      prints the uninterrupted run's step rows to the bit (but the peak memory), and its final --save is the
#      uninterrupted run's, byte for byte;
#   2. the same checkpoint resumed on each of OTHERS (MESH@Z: other shapes, other ep and etp) prints the uninterrupted
#      run's losses within TOL millionths (the same weights and moments summed in another order);
#   3. with MPIEXEC and MPI_MESH: 1. under mpirun, one process per rank.
# ARGS must give one row per dp replica and step without pipeline stages (one micro-batch per replica: the router losses
# are then the whole step's on every mesh).
#   cmake -DEXE=train_gpt -DWORK=dir -DK=2 -DMESH=dp=2,ep=1@1 "-DOTHERS=cp=2@0;dp=2,tp=2,etp=1@3" -DTOL=100
#         -DARGS="--steps;8;--experts;4;..." [-DMPIEXEC=mpiexec -DMPI_MESH=dp=2,ep=1@2] -P train_gpt_mesh_moe_resume.cmake
foreach(var EXE WORK K MESH OTHERS TOL ARGS)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "train_gpt_mesh_moe_resume.cmake: -D${var}=... is required")
  endif()
endforeach()
file(REMOVE_RECURSE ${WORK})
file(MAKE_DIRECTORY ${WORK})

include(${CMAKE_CURRENT_LIST_DIR}/step_rows.cmake)  # run_train, step_rows, same_step_rows, step_column, to_micro
include(${CMAKE_CURRENT_LIST_DIR}/mesh_resume.cmake)  # mesh_flags, losses_from, mesh_step_file, same_mesh
# The peak memory is not compared: the first step after a resume peaks 0.06 MiB lower than the uninterrupted run's
# (dp = 2 over ep = 1; not understood yet, see the report of issue 26); lengths, plans and losses to 17 digits are.
list(APPEND STEP_ROWS_TIMED_COLUMNS peak_mib)

set(source ${WORK}/same)
same_mesh("--experts --mesh ${MESH}" ${source} ${MESH})
losses_from(${source}/straight.csv ${K} straight)

# 2. Other shapes, ep and etp resume the same checkpoint.
foreach(other IN LISTS OTHERS)
  mesh_flags(${other} flags np)
  string(MAKE_C_IDENTIFIER "${other}" name)
  run_train("${MESH}'s checkpoint resumed with ${flags}" ${EXE} --resume ${source}/stopped/${mesh_step_file} ${flags}
            --csv ${WORK}/${name}.csv --checkpoint-dir ${WORK}/${name})
  losses_from(${WORK}/${name}.csv ${K} got)
  compare_losses("--experts --mesh ${MESH}'s checkpoint resumed with ${flags}, against the uninterrupted run"
                 "${straight}" "${got}")
endforeach()

# 3. Under mpirun.
if(DEFINED MPIEXEC AND DEFINED MPI_MESH)
  mesh_flags(${MPI_MESH} flags np)
  same_mesh("--experts --mesh ${MPI_MESH} on ${np} MPI processes" ${WORK}/mpi ${MPI_MESH} ${MPIEXEC} -np ${np}
                --oversubscribe)
endif()
file(REMOVE_RECURSE ${WORK})
