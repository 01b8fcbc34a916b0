# tests/examples/train_gpt_resume.cmake: train_gpt stopped at step K and resumed from its training checkpoint
# (--resume) prints, in its CSV, the same losses as the run that never stopped, to the last bit (17 digits), with
# the same plans and lengths, peaks and predictions. The uninterrupted run writes a checkpoint every K steps and
# keeps the newest 1; the stopped one stops with --stop-after K (which writes its checkpoint). The same for the MoE
# GPT (ARGS plus --experts 4 --top-k 2).
#   cmake -DEXE=train_gpt -DWORK=dir -DK=3 -DARGS="--steps;6;..." -P train_gpt_resume.cmake
foreach(var EXE WORK K ARGS)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "train_gpt_resume.cmake: -D${var}=... is required")
  endif()
endforeach()
file(REMOVE_RECURSE ${WORK})
file(MAKE_DIRECTORY ${WORK})

include(${CMAKE_CURRENT_LIST_DIR}/step_rows.cmake)  # run_train, step_rows, same_step_rows

# The check for one configuration, `args`, in folder `dir`.
function(check_resume label dir)
  set(args ${ARGN})
  file(MAKE_DIRECTORY ${dir})
  run_train("${label}: the uninterrupted run" ${EXE} ${args} --csv ${dir}/straight.csv --checkpoint-every ${K} --keep 1
            --checkpoint-dir ${dir}/checkpoints)
  file(GLOB kept ${dir}/checkpoints/*.safetensors)
  list(LENGTH kept kept_count)
  if(NOT kept_count EQUAL 1)
    message(FATAL_ERROR "${label}: --keep 1 left ${kept_count} checkpoints: ${kept}")
  endif()
  run_train("${label}: the run stopped at step ${K}" ${EXE} ${args} --stop-after ${K} --csv ${dir}/first.csv
            --checkpoint-dir ${dir}/stopped)
  string(LENGTH "${K}" digits)
  math(EXPR pad "6 - ${digits}")
  string(REPEAT "0" ${pad} zeros)
  set(checkpoint ${dir}/stopped/step_${zeros}${K}.safetensors)
  if(NOT EXISTS ${checkpoint})
    message(FATAL_ERROR "${label}: no checkpoint ${checkpoint} after the stopped run")
  endif()
  # Resumed with the options saved in the checkpoint.
  list(FIND args --steps at)
  math(EXPR at "${at} + 1")
  list(GET args ${at} steps)
  run_train("${label}: the resumed run" ${EXE} --resume ${checkpoint} --csv ${dir}/resumed.csv --checkpoint-dir ${dir}/resumed)
  if(NOT last_output MATCHES "data continues at step ${K} of ${steps}")
    message(FATAL_ERROR "${label}: the resumed run does not say it continues at step ${K}:\n${last_output}")
  endif()
  step_rows(${dir}/straight.csv ${K} want)
  step_rows(${dir}/resumed.csv 0 got)
  same_step_rows("${label}: the resumed run against the uninterrupted one (from step ${K})" "${want}" "${got}")
  list(LENGTH want n)
  message(STATUS "${label}: steps ${K}.. of the resumed run equal the uninterrupted run's (${n} rows, losses to 17 digits)")
endfunction()

check_resume("dense" ${WORK}/dense ${ARGS})
# The MoE GPT (--experts): its checkpoint holds the expert and router weights and their AdamW moments too; its CSV
# holds the router losses (aux, z) to 17 digits too.
check_resume("MoE" ${WORK}/moe ${ARGS} --experts 4 --top-k 2)
file(REMOVE_RECURSE ${WORK})
