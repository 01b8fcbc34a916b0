# tests/examples/train_gpt_mesh_resume.cmake: checkpoints of train_gpt --mesh (examples/train_gpt/mesh_checkpoints.hpp,
# model/mesh_checkpoint.hpp), in the dense run's file format:
#   1. on the same mesh (MESH, as MESH@Z for --zero Z): the run stopped at step K (--stop-after K) and resumed
#      (--resume) prints the uninterrupted run's step rows (lengths, plans, losses to 17 digits, peaks) to the bit,
#      and its final --save is the uninterrupted run's file, byte for byte;
#   2. on other shapes (OTHERS: "mesh:SPEC@Z" for --mesh SPEC --zero Z, "ranks:N" for a plain group of N): the same
#      checkpoint resumed there (the shape given replaces the checkpoint's; the data continues at step K) prints the
#      uninterrupted run's losses within TOL millionths (absolute): the same weights and moments summed in another
#      order. TOL: each activation is a float32 sum of at most ffn = 4h products, so a reassociation moves it by at
#      most 4h x 2^-24 relative (1.5e-5 at h = 64); on losses of 3-6 nats that is under 100 millionths, and so is the
#      drift of the few steps after it;
#   3. a dense run's checkpoint (--ranks CP, stopped at K) resumed on the mesh DENSE_TO: the dense run's losses within TOL;
#   4. with --pack-documents a mesh step holds one sequence per dp replica: resuming a dp = 2 checkpoint with dp = 1 is
#      refused, naming the dp and --load;
#   5. --load (weights only) of the mesh's --save: on the mesh DENSE_TO and on --ranks CP, the same losses within TOL;
#   6. with MPIEXEC and MPI_MESH (MESH@Z): 1. under mpirun, one process per rank (--backend mpi).
#   cmake -DEXE=train_gpt -DWORK=dir -DK=2 -DCP=2 -DMESH=dp=2,pp=2@1 "-DOTHERS=mesh:pp=3,tp=2@0;ranks:2" \
#         -DDENSE_TO=dp=2,cp=2@3 -DTOL=100 -DARGS="--steps;24;..." [-DMPIEXEC=mpiexec -DMPI_MESH=dp=2,pp=2@3] \
#         -P train_gpt_mesh_resume.cmake
foreach(var EXE WORK K CP MESH OTHERS DENSE_TO TOL ARGS)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "train_gpt_mesh_resume.cmake: -D${var}=... is required")
  endif()
endforeach()
file(REMOVE_RECURSE ${WORK})
file(MAKE_DIRECTORY ${WORK})

include(${CMAKE_CURRENT_LIST_DIR}/step_rows.cmake)  # run_train, step_rows, same_step_rows, step_column, to_micro
include(${CMAKE_CURRENT_LIST_DIR}/mesh_resume.cmake)  # mesh_flags, losses_from, mesh_step_file, same_mesh


set(source ${WORK}/same)
same_mesh("--mesh ${MESH}" ${source} ${MESH})
losses_from(${source}/straight.csv ${K} straight)

# 2. Other shapes resume the same checkpoint.
foreach(other IN LISTS OTHERS)
  if(other MATCHES "^mesh:(.*)$")
    mesh_flags(${CMAKE_MATCH_1} flags)
  elseif(other MATCHES "^ranks:([0-9]+)$")
    set(flags --ranks ${CMAKE_MATCH_1})
  else()
    message(FATAL_ERROR "OTHERS: \"${other}\" is not mesh:SPEC or ranks:N")
  endif()
  string(MAKE_C_IDENTIFIER "${other}" name)
  run_train("${MESH}'s checkpoint resumed with ${flags}" ${EXE} --resume ${source}/stopped/${mesh_step_file} ${flags}
            --csv ${WORK}/${name}.csv --checkpoint-dir ${WORK}/${name})
  losses_from(${WORK}/${name}.csv ${K} got)
  compare_losses("--mesh ${MESH}'s checkpoint resumed with ${flags}, against the uninterrupted run" "${straight}" "${got}")
endforeach()

# 3. A dense run's checkpoint resumed on a mesh.
run_train("dense --ranks ${CP}" ${EXE} ${ARGS} --ranks ${CP} --csv ${WORK}/dense.csv)
run_train("dense --ranks ${CP}, stopped at ${K}" ${EXE} ${ARGS} --ranks ${CP} --stop-after ${K}
          --checkpoint-dir ${WORK}/dense_stopped)
mesh_flags(${DENSE_TO} flags)
run_train("the dense checkpoint resumed with ${flags}" ${EXE} --resume ${WORK}/dense_stopped/${mesh_step_file} ${flags}
          --csv ${WORK}/dense_to_mesh.csv --checkpoint-dir ${WORK}/dense_to_mesh)
losses_from(${WORK}/dense.csv ${K} dense)
losses_from(${WORK}/dense_to_mesh.csv ${K} got)
compare_losses("--ranks ${CP}'s checkpoint resumed with ${flags}, against the dense run" "${dense}" "${got}")

# 4. Packed documents over dp: another dp is another data schedule, refused by name.
set(pack_args ${ARGS})
list(FIND pack_args "--pack-tokens" at)
if(NOT at LESS 0)
  math(EXPR value "${at} + 1")
  list(REMOVE_AT pack_args ${at} ${value})
endif()
run_train("--pack-documents on dp=2, stopped at step 1" ${EXE} ${pack_args} --pack-documents 256 --mesh dp=2 --stop-after 1
          --checkpoint-dir ${WORK}/packed)
execute_process(COMMAND ${EXE} --resume ${WORK}/packed/step_000001.safetensors --mesh dp=1,cp=2
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc EQUAL 0 OR NOT "${err}${out}" MATCHES "each dp replica|every dp replica" OR NOT "${err}${out}" MATCHES "--load")
  message(FATAL_ERROR "resuming a --pack-documents checkpoint of dp=2 on dp=1 was not refused by name (${rc}):\n${out}\n${err}")
endif()
message(STATUS "a --pack-documents checkpoint of dp=2 resumed on dp=1: refused, naming dp and --load")

# 5. --load (the weights only, fresh moments, from step 0): the uninterrupted mesh run's --save loaded on the mesh
# DENSE_TO and in a plain --ranks CP run trains the same losses within TOL (the first: the loaded model's loss).
mesh_flags(${DENSE_TO} flags)
run_train("--load into ${flags}" ${EXE} ${ARGS} ${flags} --load ${source}/straight.safetensors --csv ${WORK}/load_mesh.csv)
if(NOT last_output MATCHES "weights loaded from")
  message(FATAL_ERROR "--load into ${flags}: the run does not say it loaded the weights:\n${last_output}")
endif()
run_train("--load into --ranks ${CP}" ${EXE} ${ARGS} --ranks ${CP} --load ${source}/straight.safetensors
          --csv ${WORK}/load_dense.csv)
losses_from(${WORK}/load_dense.csv 0 want)
losses_from(${WORK}/load_mesh.csv 0 got)
compare_losses("--mesh ${MESH}'s --save loaded with ${flags}, against it loaded with --ranks ${CP}" "${want}" "${got}")
list(GET want 0 loaded_first)
losses_from(${WORK}/dense.csv 0 fresh)
list(GET fresh 0 dense_first)
if(loaded_first EQUAL dense_first)
  message(FATAL_ERROR "--load: the loaded model's first loss equals the fresh model's (${loaded_first}): nothing loaded?")
endif()

# 6. Under mpirun.
if(DEFINED MPIEXEC AND DEFINED MPI_MESH)
  mesh_flags(${MPI_MESH} flags np)
  same_mesh("--mesh ${MPI_MESH} on ${np} MPI processes" ${WORK}/mpi ${MPI_MESH} ${MPIEXEC} -np ${np} --oversubscribe)
endif()
file(REMOVE_RECURSE ${WORK})
