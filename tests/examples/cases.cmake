# tests/examples/cases.cmake: the cases of a program test script (command_line_usage.cmake, refusals.cmake).
#   for_each_case("${BAD}" check_case)   calls check_case(ARGS EXPECTED) for each case of BAD in order
# BAD: cases "ARGS=>EXPECTED" separated by "@@" (not a CMake list: a range's unmatched ']' of "(0, 100]" would keep
# list splitting from seeing the next ';'); ARGS and EXPECTED reach the function as one argument each.
function(for_each_case cases callback)
  set(rest "${cases}@@")
  while(NOT rest STREQUAL "")
    string(FIND "${rest}" "@@" end)
    string(SUBSTRING "${rest}" 0 ${end} case)
    math(EXPR next "${end} + 2")
    string(SUBSTRING "${rest}" ${next} -1 rest)
    string(FIND "${case}" "=>" split)
    if(split EQUAL -1)
      message(FATAL_ERROR "${CMAKE_SCRIPT_MODE_FILE}: the case \"${case}\" has no \"=>\"")
    endif()
    string(SUBSTRING "${case}" 0 ${split} args)
    math(EXPR from "${split} + 2")
    string(SUBSTRING "${case}" ${from} -1 expected)
    cmake_language(CALL ${callback} "${args}" "${expected}")
  endwhile()
endfunction()
