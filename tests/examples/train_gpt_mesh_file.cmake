# tests/examples/train_gpt_mesh_file.cmake: train_gpt --mesh-file runs the configuration search_parallel --emit wrote
# (issue 26: one description of a configuration shared by the search and the trainer).
#   1. search_parallel --model <train_gpt's model as config.json> --config CONFIG --emit FILE; train_gpt --mesh-file FILE
#      trains step for step what train_gpt --mesh MESH --zero Z trains (every step row equal, losses to 17 digits);
#   2. a file with an axis train_gpt cannot run yet (REFUSE_CONFIG, e.g. tp_x=2) is refused naming it (REFUSE_SAYS);
#   3. the file of 1 read with train_gpt flags of another model (OTHER_ARGS appended) is refused naming both values
#      (OTHER_SAYS).
# Run by ctest (examples/CMakeLists.txt):
#   cmake -DEXE=train_gpt -DSEARCH=search_parallel -DWORK=dir -DARGS="--steps;4;..." -DMODEL_JSON="{...}"
#         -DCONFIG=dp=2,pp=2,zero=1,recompute=full -DMESH=dp=2,pp=2 -DZERO=1 -DREFUSE_CONFIG=tp_x=2,tp_y=2
#         "-DREFUSE_SAYS=tp_x=2: 2-D tensor parallelism is not trainable yet" -DOTHER_ARGS=--hidden;128
#         "-DOTHER_SAYS=hidden_size is 64 but train_gpt's --hidden gives 128" -P train_gpt_mesh_file.cmake
foreach(var EXE SEARCH WORK ARGS MODEL_JSON CONFIG MESH ZERO REFUSE_CONFIG REFUSE_SAYS OTHER_ARGS OTHER_SAYS)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "train_gpt_mesh_file.cmake: -D${var}=... is required")
  endif()
endforeach()
file(REMOVE_RECURSE ${WORK})
file(MAKE_DIRECTORY ${WORK})
include(${CMAKE_CURRENT_LIST_DIR}/step_rows.cmake)  # run_train, step_rows, same_step_rows

file(WRITE ${WORK}/model.json "${MODEL_JSON}")
function(emit config file)
  string(REGEX MATCHALL "(dp|pp|cp|tp|tp_x|tp_y)=[0-9]+" axes "${config}")
  set(devices 1)
  foreach(axis IN LISTS axes)
    string(REGEX REPLACE ".*=" "" size "${axis}")
    math(EXPR devices "${devices} * ${size}")
  endforeach()
  run_train("search_parallel --config ${config} --emit ${file}" ${SEARCH} --model ${WORK}/model.json --devices ${devices}
            --cluster dgx-a100 --seq 256 --global-batch 8 --config ${config} --emit ${file})
  if(NOT EXISTS ${file})
    message(FATAL_ERROR "search_parallel --emit ${file} wrote nothing:\n${last_output}")
  endif()
endfunction()

# 1. The emitted configuration runs, as the same mesh given by flags.
emit(${CONFIG} ${WORK}/run.json)
run_train("train_gpt --mesh-file" ${EXE} ${ARGS} --mesh-file ${WORK}/run.json --csv ${WORK}/file.csv)
message(STATUS "train_gpt --mesh-file ${WORK}/run.json:\n${last_output}")
string(FIND "${last_output}" "configuration: ${WORK}/run.json" at)
if(at EQUAL -1)
  message(FATAL_ERROR "train_gpt --mesh-file does not name its configuration file")
endif()
run_train("train_gpt --mesh ${MESH} --zero ${ZERO}" ${EXE} ${ARGS} --mesh ${MESH} --zero ${ZERO} --csv ${WORK}/flags.csv)
step_rows(${WORK}/flags.csv 0 want)
step_rows(${WORK}/file.csv 0 got)
same_step_rows("--mesh-file (${CONFIG}) against --mesh ${MESH} --zero ${ZERO}" "${want}" "${got}")
list(LENGTH got n)
message(STATUS "--mesh-file ${CONFIG}: ${n} steps, every row equal to --mesh ${MESH} --zero ${ZERO}'s")

# Refusals: exit non-zero, saying what.
function(refused label expected)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(rc EQUAL 0)
    message(FATAL_ERROR "${label}: ran, expected a refusal:\n${out}\n${err}")
  endif()
  string(FIND "${err}${out}" "${expected}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "${label}: does not say \"${expected}\":\n${out}\n${err}")
  endif()
  message(STATUS "${label}: refused (\"${expected}\")")
endfunction()
# 2. An axis train_gpt cannot run yet.
emit(${REFUSE_CONFIG} ${WORK}/refuse.json)
refused("--mesh-file with ${REFUSE_CONFIG}" "${REFUSE_SAYS}" ${EXE} ${ARGS} --mesh-file ${WORK}/refuse.json)
# 3. Another model than the flags'.
refused("--mesh-file with ${OTHER_ARGS}" "${OTHER_SAYS}" ${EXE} ${ARGS} ${OTHER_ARGS} --mesh-file ${WORK}/run.json)
