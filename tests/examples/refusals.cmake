# tests/examples/refusals.cmake: inputs a program must refuse, in bounded time, with a message that names the flag or
# file, the value and what was expected (issue 27).
#   cmake -DEXE=reshard_walkthrough "-DBAD=--ranks 100000=>--ranks expects an integer in [1, 256]@@..." -P refusals.cmake
# BAD: cases "ARGS=>EXPECTED" separated by "@@", ARGS as a shell would split them (so '' is an empty argument); each
# must exit non-zero within 60 s with EXPECTED on stderr (or stdout).
foreach(var EXE BAD)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "refusals.cmake: -D${var}=... is required")
  endif()
endforeach()
include(${CMAKE_CURRENT_LIST_DIR}/cases.cmake)
function(check_case args expected)
  execute_process(COMMAND sh -c "'${EXE}' ${args}" RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 60)
  if(rc EQUAL 0 OR NOT rc MATCHES "^[0-9]+$")
    message(FATAL_ERROR "${EXE} ${args} exited \"${rc}\", expected a refusal:\n${out}\n${err}")
  endif()
  string(FIND "${err}${out}" "${expected}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "${EXE} ${args}: does not say \"${expected}\":\n${out}\n${err}")
  endif()
endfunction()
for_each_case("${BAD}" check_case)
