# tests/examples/command_line_usage.cmake: a program's command line as a user meets it (paradyse/cli/flags.hpp):
# --help prints the generated usage on stdout and exits 0, naming every flag of FLAGS; each bad value of BAD exits 2
# with a message on stderr naming the flag, the value and what was expected, before the program does any work.
#   cmake -DEXE=train_gpt "-DFLAGS=--steps;--ranks" "-DBAD=--steps 0=>--steps expects an integer in [1, 10000000]@@..."
#         -P command_line_usage.cmake
# BAD: cases "ARGS=>EXPECTED" separated by "@@" (tests/examples/cases.cmake), ARGS split at spaces; stderr must hold EXPECTED and the last of ARGS (the
# bad value) in quotes.
foreach(var EXE FLAGS BAD)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "command_line_usage.cmake: -D${var}=... is required")
  endif()
endforeach()

execute_process(COMMAND ${EXE} --help RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${EXE} --help exited ${rc}, expected 0:\n${out}\n${err}")
endif()
foreach(flag IN LISTS FLAGS)
  string(FIND "${out}" "${flag}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "${EXE} --help does not name ${flag}:\n${out}")
  endif()
endforeach()

include(${CMAKE_CURRENT_LIST_DIR}/cases.cmake)
function(check_case args expected)
  separate_arguments(args UNIX_COMMAND "${args}")
  execute_process(COMMAND ${EXE} ${args} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 60)
  if(NOT rc EQUAL 2)
    message(FATAL_ERROR "${EXE} ${args} exited ${rc}, expected 2:\n${out}\n${err}")
  endif()
  string(FIND "${err}" "${expected}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "${EXE} ${args}: stderr does not say \"${expected}\":\n${err}")
  endif()
  list(GET args -1 value)
  string(FIND "${err}" "\"${value}\"" value_at)
  if(value_at EQUAL -1)
    message(FATAL_ERROR "${EXE} ${args}: stderr does not name the value \"${value}\":\n${err}")
  endif()
  string(FIND "${err}" "--help" usage_at)  # the usage follows the problem
  if(usage_at EQUAL -1)
    message(FATAL_ERROR "${EXE} ${args}: no usage after the problem:\n${err}")
  endif()
endfunction()
for_each_case("${BAD}" check_case)
message(STATUS "${EXE}: --help names the flags; the bad values exit 2 naming flag, value and range")
