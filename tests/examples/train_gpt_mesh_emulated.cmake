# tests/examples/train_gpt_mesh_emulated.cmake: train_gpt --mesh with --emulate NODE (every mesh group's thread
# transfers paced at NODE's links, cost/emulation.hpp) trains the same numbers as without: with the strategy fixed
# (--strategy, so the emulated links cannot change the plan) the losses of every step equal, to 17 digits, those of
# the same mesh planned with a built-in profile and unpaced; and the run says it is emulated.
#   cmake -DEXE=train_gpt -DWORK=dir -DMESH=dp=2,cp=2 -DNODE=h100 -DARGS="--steps;2;...;--strategy;MegatronTS" \
#         -P train_gpt_mesh_emulated.cmake
foreach(var EXE WORK MESH NODE ARGS)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "train_gpt_mesh_emulated.cmake: -D${var}=... is required")
  endif()
endforeach()
file(REMOVE_RECURSE ${WORK})
file(MAKE_DIRECTORY ${WORK})
include(${CMAKE_CURRENT_LIST_DIR}/step_rows.cmake)  # run_train, step_column

run_train("train_gpt --mesh ${MESH}" ${EXE} ${ARGS} --mesh ${MESH} --profile A100-SXM4-80GB-x8 --csv ${WORK}/plain.csv)
run_train("train_gpt --mesh ${MESH} --emulate ${NODE}" ${EXE} ${ARGS} --mesh ${MESH} --emulate ${NODE}
          --csv ${WORK}/emulated.csv)
if(NOT last_output MATCHES "emulated node: [0-9]+ ranks with the links of")
  message(FATAL_ERROR "train_gpt --mesh ${MESH} --emulate ${NODE} does not say it is emulated:\n${last_output}")
endif()
step_column(${WORK}/plain.csv loss plain)
step_column(${WORK}/emulated.csv loss emulated)
if(NOT plain OR NOT plain STREQUAL emulated)
  message(FATAL_ERROR "--emulate ${NODE} changed the losses of --mesh ${MESH}:\n  unpaced: ${plain}\n  emulated: ${emulated}")
endif()
list(LENGTH plain steps)
message(STATUS "--mesh ${MESH} --emulate ${NODE}: ${steps} steps, the same losses as unpaced: ${plain}")
