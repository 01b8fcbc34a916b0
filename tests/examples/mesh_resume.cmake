# tests/examples/mesh_resume.cmake: what the checkpoint scripts of train_gpt --mesh (train_gpt_mesh_resume.cmake, the
# dense GPT; train_gpt_mesh_moe_resume.cmake, --experts) share. Include it after step_rows.cmake, with EXE, ARGS and K
# defined:
#   mesh_flags(MESH@Z flags_var [np_var]): "--mesh;MESH;--zero;Z", and the world size (the device axes' product: dp,
#     pp, cp, tp or tp_x x tp_y; ep and etp fold the same devices);
#   losses_from(csv first out_var): the losses of a CSV table from step `first` on, in millionths;
#   mesh_step_file: the checkpoint file name of step K (step_00000K.safetensors);
#   same_mesh(label dir MESH@Z [launcher...]): on one mesh, the run stopped at step K (--stop-after) and resumed
#     (--resume) says it continues at step K and prints the uninterrupted run's step rows to the bit (step_rows.cmake's
#     untimed columns), and its final --save is the uninterrupted run's, byte for byte. `launcher` runs the program
#     (empty on threads; mpirun -np N for --backend mpi).
function(mesh_flags spec out_var)
  set(mesh ${spec})
  set(zero 0)
  if(spec MATCHES "^(.*)@([0-9])$")
    set(mesh ${CMAKE_MATCH_1})
    set(zero ${CMAKE_MATCH_2})
  endif()
  set(${out_var} --mesh ${mesh} --zero ${zero} PARENT_SCOPE)
  if(ARGC GREATER 2)
    string(REGEX MATCHALL "(^|,)(dp|pp|cp|tp|tp_x|tp_y)=[0-9]+" axes "${mesh}")
    set(np 1)
    foreach(axis IN LISTS axes)
      string(REGEX REPLACE ".*=" "" size "${axis}")
      math(EXPR np "${np} * ${size}")
    endforeach()
    set(${ARGV2} ${np} PARENT_SCOPE)
  endif()
endfunction()

function(losses_from csv first out_var)
  step_column(${csv} step steps)
  step_column(${csv} loss column)
  set(out "")
  list(LENGTH steps n)
  math(EXPR last "${n} - 1")
  foreach(i RANGE ${last})
    list(GET steps ${i} step)
    if(step LESS first)
      continue()
    endif()
    list(GET column ${i} loss)
    to_micro("${loss}" micro)
    list(APPEND out ${micro})
  endforeach()
  set(${out_var} "${out}" PARENT_SCOPE)
endfunction()

string(LENGTH "${K}" digits)
math(EXPR pad "6 - ${digits}")
string(REPEAT "0" ${pad} zeros)
set(mesh_step_file step_${zeros}${K}.safetensors)

function(same_mesh label dir spec)
  set(launcher ${ARGN})
  mesh_flags(${spec} flags)
  set(backend "")
  if(launcher)
    set(backend --backend mpi)
  endif()
  file(MAKE_DIRECTORY ${dir})
  run_train("${label}: the uninterrupted run" ${launcher} ${EXE} ${ARGS} ${flags} ${backend} --csv ${dir}/straight.csv
            --checkpoint-every ${K} --keep 1 --checkpoint-dir ${dir}/checkpoints --save ${dir}/straight.safetensors)
  run_train("${label}: the run stopped at step ${K}" ${launcher} ${EXE} ${ARGS} ${flags} ${backend} --stop-after ${K}
            --csv ${dir}/first.csv --checkpoint-dir ${dir}/stopped)
  if(NOT EXISTS ${dir}/stopped/${mesh_step_file})
    message(FATAL_ERROR "${label}: no checkpoint ${dir}/stopped/${mesh_step_file} after the stopped run:\n${last_output}")
  endif()
  run_train("${label}: the resumed run" ${launcher} ${EXE} --resume ${dir}/stopped/${mesh_step_file}
            --csv ${dir}/resumed.csv --checkpoint-dir ${dir}/resumed --save ${dir}/resumed.safetensors)
  if(NOT last_output MATCHES "data continues at step ${K} of")
    message(FATAL_ERROR "${label}: the resumed run does not say it continues at step ${K}:\n${last_output}")
  endif()
  step_rows(${dir}/straight.csv ${K} want)
  step_rows(${dir}/resumed.csv 0 got)
  same_step_rows("${label}: the resumed run against the uninterrupted one (from step ${K})" "${want}" "${got}")
  file(SHA256 ${dir}/straight.safetensors a)
  file(SHA256 ${dir}/resumed.safetensors b)
  if(NOT a STREQUAL b)
    message(FATAL_ERROR "${label}: the resumed run's --save differs from the uninterrupted run's")
  endif()
  list(LENGTH want n)
  message(STATUS "${label}: steps ${K}.. of the resumed run equal the uninterrupted run's (${n} rows, losses to 17 "
                 "digits) and so does its --save, byte for byte")
endfunction()
