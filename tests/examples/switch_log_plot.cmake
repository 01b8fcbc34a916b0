# tests/examples/switch_log_plot.cmake: moe_infer --simulate's switch log (serve/switch_log.hpp) read back and drawn
# (issue 25: where the dynamic policy switched, through scripts/plot.py).
#   cmake -DEXE=moe_infer "-DARGS=--ranks 2 ..." -DWORK=dir -DPYTHON=/usr/bin/python3 -DPLOT=scripts/plot.py \
#         -P switch_log_plot.cmake
# Runs moe_infer ARGS --simulate h100 --policy tp,ep,dynamic --switch-csv WORK/switches.csv, then checks: exit 0; the
# header; every policy logged, static TP's steps all in TP and static EP's all in EP, each policy's steps numbered
# from 0 in order at non-decreasing times; as many steps logged per policy as its table row counts; plot.py draws it.
cmake_minimum_required(VERSION 3.20)
foreach(var EXE ARGS WORK PYTHON PLOT)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "switch_log_plot.cmake: -D${var}=... is required")
  endif()
endforeach()
file(REMOVE_RECURSE "${WORK}")
file(MAKE_DIRECTORY "${WORK}")
separate_arguments(args UNIX_COMMAND "${ARGS}")
execute_process(COMMAND "${EXE}" ${args} --simulate h100 --policy tp,ep,dynamic --switch-csv "${WORK}/switches.csv"
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 120)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "moe_infer ${ARGS} --simulate h100 exited ${rc}:\n${out}\n${err}")
endif()
file(STRINGS "${WORK}/switches.csv" rows)
list(POP_FRONT rows header)
if(NOT header STREQUAL "trace,policy,step,time_s,tokens,layout")
  message(FATAL_ERROR "switches.csv: header \"${header}\"")
endif()
foreach(policy "static TP" "static EP" "dynamic TP/EP")
  set(count 0)
  set(last_time 0)
  foreach(row IN LISTS rows)
    string(REPLACE "," ";" fields "${row}")  # the trace's name holds no comma here
    list(GET fields 1 name)
    if(NOT name STREQUAL policy)
      continue()
    endif()
    list(GET fields 2 step)
    list(GET fields 3 time)
    list(GET fields 5 layout)
    if(NOT step EQUAL count)
      message(FATAL_ERROR "switches.csv: ${policy}'s step ${count} is numbered ${step}: ${row}")
    endif()
    if(time LESS last_time)
      message(FATAL_ERROR "switches.csv: ${policy}'s step ${step} ends at ${time}, before ${last_time}: ${row}")
    endif()
    if((policy STREQUAL "static TP" AND NOT layout STREQUAL "TP") OR
       (policy STREQUAL "static EP" AND NOT layout STREQUAL "EP"))
      message(FATAL_ERROR "switches.csv: ${policy} ran a step in ${layout}: ${row}")
    endif()
    set(last_time ${time})
    math(EXPR count "${count} + 1")
  endforeach()
  # The table's row: "<policy>  TTFT p50 ... tokens/s  steps  EP steps ...".
  string(REGEX MATCH "\n${policy} +[0-9.]+ms +[0-9.]+ms +[0-9.]+ms +[0-9.]+ms +[0-9.]+ +([0-9]+) " row "${out}")
  if(NOT CMAKE_MATCH_1 OR NOT count EQUAL CMAKE_MATCH_1)
    message(FATAL_ERROR "switches.csv: ${count} steps of ${policy}; its table row says \"${CMAKE_MATCH_1}\":\n${out}")
  endif()
endforeach()
execute_process(COMMAND "${PYTHON}" "${PLOT}" "${WORK}/switches.csv" -o "${WORK}"
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 120)
if(NOT rc EQUAL 0 OR NOT EXISTS "${WORK}/switches_switches.png")
  message(FATAL_ERROR "plot.py ${WORK}/switches.csv exited ${rc} (switches_switches.png: not written):\n${out}\n${err}")
endif()
