# tests/examples/plan_trace_prices_train_gpt.cmake: plan_trace predicts the step train_gpt predicts for itself on one
# calibrated profile (scripts/validate_trainer.sh compares plan_trace's predictions with train_gpt's measured steps and
# needs the two to be one cost table). The profile's GEMM engines decide what the dry runs count (the built-in kernel
# packs its operands into a workspace the time model prices), so both programs take them from the profile
# (cost/gemm_engines.hpp), not from their own measured choice: with the engines all "fallback" and, where the build has
# CBLAS, all "cblas" (the two predictions must then differ, or the engines did not reach the dry run), train_gpt's
# predicted_s of every 256-token step equals plan_trace's MegatronTS time to the microsecond. The train_gpt runs probe
# the machine's speed (--speed-probe on) and must print both probes.
#   cmake -DTRAIN=train_gpt -DPLAN=plan_trace -DPROFILE=cpu_two_ranks.json -DWORK=dir -DCBLAS=ON|OFF -P ...
foreach(var TRAIN PLAN PROFILE WORK CBLAS)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "plan_trace_prices_train_gpt.cmake: -D${var}=... is required")
  endif()
endforeach()
file(REMOVE_RECURSE ${WORK})
file(MAKE_DIRECTORY ${WORK})
include(${CMAKE_CURRENT_LIST_DIR}/step_rows.cmake)  # run_train, step_column, to_micro; a GEMM cache of this test's own

set(MODEL --layers 2 --hidden 64 --heads 2)
file(WRITE ${WORK}/lengths.txt "256\n")

# plan_trace's predicted MegatronTS step of 256 tokens on `profile`, microseconds.
function(plan_trace_micro profile out_var)
  run_train("plan_trace --profile ${profile}" ${PLAN} --profile ${profile} --lengths ${WORK}/lengths.txt --p 2 ${MODEL}
            --causal --rope --dtype fp32 --budget-gib 1000 --vocab 256 --csv ${WORK}/plan.csv)
  file(STRINGS ${WORK}/plan.csv rows REGEX "^lengths,0,256,MegatronTS,static,")
  if(NOT rows MATCHES "^lengths,0,256,MegatronTS,static,([0-9.]+),")
    message(FATAL_ERROR "plan_trace wrote no MegatronTS row for 256 tokens in ${WORK}/plan.csv")
  endif()
  to_micro(${CMAKE_MATCH_1} micro)
  set(${out_var} ${micro} PARENT_SCOPE)
endfunction()

# train_gpt's own predicted_s of its 256-token steps on `profile` against plan_trace's `want` (microseconds).
function(check_train_gpt profile want)
  run_train("train_gpt --profile ${profile}" ${TRAIN} --ranks 2 ${MODEL} --steps 2 --min-len 256 --max-len 256
            --profile ${profile} --strategy MegatronTS --speed-probe on --csv ${WORK}/train.csv)
  # --speed-probe on: the machine's speed against the profile, measured / priced, before the steps and after them.
  foreach(when "before the steps" "after the steps")
    if(NOT last_output MATCHES "speed probe ${when}: measured / priced [0-9]+\\.[0-9]+")
      message(FATAL_ERROR "train_gpt --speed-probe on printed no probe ${when}:\n${last_output}")
    endif()
  endforeach()
  step_column(${WORK}/train.csv length lengths)
  step_column(${WORK}/train.csv predicted_s predicted)
  set(compared 0)
  foreach(length seconds IN ZIP_LISTS lengths predicted)
    if(length EQUAL 256)
      to_micro(${seconds} got)
      math(EXPR gap "${got} - ${want}")
      if(gap GREATER 1 OR gap LESS -1)
        message(FATAL_ERROR "${profile}: train_gpt predicted ${seconds} s for a 256-token MegatronTS step, plan_trace "
                            "${want} us: not one cost table")
      endif()
      math(EXPR compared "${compared} + 1")
    endif()
  endforeach()
  if(compared EQUAL 0)
    message(FATAL_ERROR "train_gpt ran no 256-token step (lengths: ${lengths})")
  endif()
  message(STATUS "${profile}: plan_trace ${want} us, train_gpt the same in ${compared} step(s)")
endfunction()

plan_trace_micro(${PROFILE} fallback)
check_train_gpt(${PROFILE} ${fallback})
if(CBLAS)
  file(READ ${PROFILE} text)
  string(REPLACE "\"engine\": \"fallback\"" "\"engine\": \"cblas\"" text "${text}")
  file(WRITE ${WORK}/cblas.json "${text}")
  plan_trace_micro(${WORK}/cblas.json cblas)
  if(cblas EQUAL fallback)
    message(FATAL_ERROR "plan_trace priced the step alike (${cblas} us) with the profile's GEMMs on cblas and on "
                        "fallback: the profile's engines did not reach the dry run")
  endif()
  check_train_gpt(${WORK}/cblas.json ${cblas})
endif()
