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
# The peak memory is not compared: the first step after a resume peaks 0.06 MiB lower than the uninterrupted run's
# (dp = 2 over ep = 1; not understood yet, see the report of issue 26); lengths, plans and losses to 17 digits are.
list(APPEND STEP_ROWS_TIMED_COLUMNS peak_mib)

# MESH@Z as "--mesh;MESH;--zero;Z" into out_var, and its world size (the device axes' product) into np_var.
function(moe_mesh_flags spec out_var np_var)
  set(mesh ${spec})
  set(zero 0)
  if(spec MATCHES "^(.*)@([0-9])$")
    set(mesh ${CMAKE_MATCH_1})
    set(zero ${CMAKE_MATCH_2})
  endif()
  string(REGEX MATCHALL "(^|,)(dp|pp|cp|tp)=[0-9]+" axes "${mesh}")
  set(np 1)
  foreach(axis IN LISTS axes)
    string(REGEX REPLACE ".*=" "" size "${axis}")
    math(EXPR np "${np} * ${size}")
  endforeach()
  set(${out_var} --mesh ${mesh} --zero ${zero} PARENT_SCOPE)
  set(${np_var} ${np} PARENT_SCOPE)
endfunction()

# The losses of a CSV table from step `first` on, in millionths, into out_var.
function(moe_losses_from csv first out_var)
  step_column(${csv} step steps)
  step_column(${csv} loss column)
  set(out "")
  list(LENGTH steps n)
  math(EXPR last "${n} - 1")
  foreach(i RANGE ${last})
    list(GET steps ${i} step)
    if(NOT step LESS first)
      list(GET column ${i} loss)
      to_micro("${loss}" micro)
      list(APPEND out ${micro})
    endif()
  endforeach()
  set(${out_var} "${out}" PARENT_SCOPE)
endfunction()

string(LENGTH "${K}" digits)
math(EXPR pad "6 - ${digits}")
string(REPEAT "0" ${pad} zeros)
set(step_file step_${zeros}${K}.safetensors)

# 1. The same mesh, stopped and resumed: the uninterrupted run to the bit. ARGN: the launcher (mpirun -np N).
function(moe_same_mesh label dir spec)
  set(launcher ${ARGN})
  moe_mesh_flags(${spec} flags np)
  set(backend "")
  if(launcher)
    set(backend --backend mpi)
  endif()
  file(MAKE_DIRECTORY ${dir})
  run_train("${label}: the uninterrupted run" ${launcher} ${EXE} ${ARGS} ${flags} ${backend} --csv ${dir}/straight.csv
            --checkpoint-every ${K} --keep 1 --checkpoint-dir ${dir}/checkpoints --save ${dir}/straight.safetensors)
  run_train("${label}: the run stopped at step ${K}" ${launcher} ${EXE} ${ARGS} ${flags} ${backend} --stop-after ${K}
            --csv ${dir}/first.csv --checkpoint-dir ${dir}/stopped)
  if(NOT EXISTS ${dir}/stopped/${step_file})
    message(FATAL_ERROR "${label}: no checkpoint ${dir}/stopped/${step_file} after the stopped run:\n${last_output}")
  endif()
  run_train("${label}: the resumed run" ${launcher} ${EXE} --resume ${dir}/stopped/${step_file} --csv ${dir}/resumed.csv
            --checkpoint-dir ${dir}/resumed --save ${dir}/resumed.safetensors)
  step_rows(${dir}/straight.csv ${K} want)
  step_rows(${dir}/resumed.csv 0 got)
  same_step_rows("${label}: the resumed run against the uninterrupted one (from step ${K})" "${want}" "${got}")
  file(SHA256 ${dir}/straight.safetensors a)
  file(SHA256 ${dir}/resumed.safetensors b)
  if(NOT a STREQUAL b)
    message(FATAL_ERROR "${label}: the resumed run's --save differs from the uninterrupted run's")
  endif()
  list(LENGTH want n)
  message(STATUS "${label}: steps ${K}.. resumed equal the uninterrupted run's (${n} rows to 17 digits) and so does "
                 "its --save, byte for byte")
endfunction()

set(source ${WORK}/same)
moe_same_mesh("--experts --mesh ${MESH}" ${source} ${MESH})
moe_losses_from(${source}/straight.csv ${K} straight)

# 2. Other shapes, ep and etp resume the same checkpoint.
foreach(other IN LISTS OTHERS)
  moe_mesh_flags(${other} flags np)
  string(MAKE_C_IDENTIFIER "${other}" name)
  run_train("${MESH}'s checkpoint resumed with ${flags}" ${EXE} --resume ${source}/stopped/${step_file} ${flags}
            --csv ${WORK}/${name}.csv --checkpoint-dir ${WORK}/${name})
  moe_losses_from(${WORK}/${name}.csv ${K} got)
  compare_losses("--experts --mesh ${MESH}'s checkpoint resumed with ${flags}, against the uninterrupted run"
                 "${straight}" "${got}")
endforeach()

# 3. Under mpirun.
if(DEFINED MPIEXEC AND DEFINED MPI_MESH)
  moe_mesh_flags(${MPI_MESH} flags np)
  moe_same_mesh("--experts --mesh ${MPI_MESH} on ${np} MPI processes" ${WORK}/mpi ${MPI_MESH} ${MPIEXEC} -np ${np}
                --oversubscribe)
endif()
file(REMOVE_RECURSE ${WORK})
