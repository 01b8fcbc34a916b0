# tests/examples/step_rows.cmake: how the ctest scripts of train_gpt (train_gpt_mesh.cmake, train_gpt_mpi.cmake,
# train_gpt_resume.cmake, train_gpt_mesh_resume.cmake, ... include() it) run the program, read its per-step table
# (--csv FILE: a header line, then one line per step whose first column is the step) and compare losses.
#
# The timed columns: the only columns whose values two runs that train the same steps may give differently (wall-clock
# seconds and what is derived from them, the ranks' CPU seconds). Every other column (lengths, rows, plans, losses and
# router losses to 17 digits, measured and predicted peaks, status) is a result and must match where the runs must
# agree.
set(STEP_ROWS_TIMED_COLUMNS seconds mfu tokens_per_s cpu_s optimizer_cpu_s)

# The runs of one script compare results to the bit, so they must run the same GEMM engines. The engine choice is
# measured once per machine and program and cached (ops/cpu/gemm_choice.hpp); a test's own cache folder keeps another
# test's train_gpt, measuring at the same time under a different load, from replacing the choice between two runs.
if(DEFINED WORK)
  set(ENV{PARADYSE_GEMM_CACHE} ${WORK}/gemm-cache)
endif()

# run_train(label command...): runs the command; fails naming `label` with its exit code and output unless it exits 0.
# Sets last_output (stdout) in the caller's scope.
function(run_train label)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${label} failed (${rc}):\n${out}\n${err}")
  endif()
  set(last_output "${out}" PARENT_SCOPE)
endfunction()

# The header's columns and the step lines of a CSV table (internal). train_gpt's fields hold no comma, quote or ';'
# (CsvTable would quote a comma), so a line splits at its commas; a quoted field stops the test rather than be misread.
function(_step_table csv columns_var lines_var)
  if(NOT EXISTS ${csv})
    message(FATAL_ERROR "${csv}: no such table (did the run write its --csv?)")
  endif()
  file(STRINGS ${csv} lines)
  list(LENGTH lines n)
  if(n EQUAL 0)
    message(FATAL_ERROR "${csv}: empty, expected a header line")
  endif()
  list(POP_FRONT lines header)
  foreach(line IN LISTS header lines)
    if(line MATCHES "[\";]")
      message(FATAL_ERROR "${csv}: a quoted field or a ';' in \"${line}\": step_rows.cmake splits lines at commas")
    endif()
  endforeach()
  string(REPLACE "," ";" columns "${header}")
  set(${columns_var} "${columns}" PARENT_SCOPE)
  set(${lines_var} "${lines}" PARENT_SCOPE)
endfunction()

# step_rows(csv first out_var): the lines of steps >= first, each with the value of every timed column replaced by
# <timed>, as a list.
function(step_rows csv first out_var)
  _step_table(${csv} columns lines)
  set(timed "")
  foreach(name IN LISTS STEP_ROWS_TIMED_COLUMNS)
    list(FIND columns ${name} at)
    if(NOT at LESS 0)
      list(APPEND timed ${at})
    endif()
  endforeach()
  set(rows "")
  foreach(line IN LISTS lines)
    string(REPLACE "," ";" fields "${line}")
    list(GET fields 0 step)
    if(NOT step MATCHES "^[0-9]+$")
      message(FATAL_ERROR "${csv}: the line \"${line}\" does not start with a step")
    endif()
    if(step LESS first)
      continue()
    endif()
    foreach(at IN LISTS timed)  # (not list(TRANSFORM REPLACE): a timed field may be empty, a failed step's mfu)
      list(REMOVE_AT fields ${at})
      list(INSERT fields ${at} "<timed>")
    endforeach()
    list(JOIN fields "," row)
    list(APPEND rows "${row}")
  endforeach()
  set(${out_var} "${rows}" PARENT_SCOPE)
endfunction()

# step_column(csv name out_var): the values of column `name`, step by step, as a list.
function(step_column csv name out_var)
  _step_table(${csv} columns lines)
  list(FIND columns ${name} at)
  if(at LESS 0)
    message(FATAL_ERROR "${csv}: no column ${name} in \"${columns}\"")
  endif()
  set(values "")
  foreach(line IN LISTS lines)
    string(REPLACE "," ";" fields "${line}")
    list(GET fields ${at} value)
    list(APPEND values "${value}")
  endforeach()
  set(${out_var} "${values}" PARENT_SCOPE)
endfunction()

# same_step_rows(label want got): fails naming `label` unless the two lists of step rows are equal and not empty.
function(same_step_rows label want got)
  list(LENGTH want n)
  if(n EQUAL 0)
    message(FATAL_ERROR "${label}: no step rows to compare")
  endif()
  if(NOT want STREQUAL got)
    string(REPLACE ";" "\n" a "${want}")
    string(REPLACE ";" "\n" b "${got}")
    message(FATAL_ERROR "${label}: the step rows differ\nexpected:\n${a}\ngot:\n${b}")
  endif()
endfunction()

# to_micro(text out_var): a plain decimal ("4.080197") as an integer of millionths (CMake has no floating point); fails
# on anything else. math() reads "080197" as decimal, so no zeros are stripped (a REGEX REPLACE of "^0+" would strip
# again after each match: 4.080197 became 4.008197).
function(to_micro text out_var)
  if(NOT text MATCHES "^([0-9]+)\\.?([0-9]*)$")
    message(FATAL_ERROR "\"${text}\" is not a plain decimal")
  endif()
  set(whole ${CMAKE_MATCH_1})
  string(SUBSTRING "${CMAKE_MATCH_2}000000" 0 6 fraction)
  math(EXPR micro "${whole} * 1000000 + ${fraction}")
  set(${out_var} ${micro} PARENT_SCOPE)
endfunction()

# compare_losses(label reference got): fails unless the two lists of losses (millionths) have the same length and agree
# within TOL (the including script's -DTOL, millionths); prints the worst gap.
function(compare_losses label reference got)
  list(LENGTH reference n)
  list(LENGTH got m)
  if(n EQUAL 0)
    message(FATAL_ERROR "${label}: the reference run trained no step")
  endif()
  if(NOT m EQUAL n)
    message(FATAL_ERROR "${label}: ${m} steps against the reference's ${n}")
  endif()
  set(worst 0)
  math(EXPR last "${n} - 1")
  foreach(i RANGE ${last})
    list(GET reference ${i} a)
    list(GET got ${i} b)
    math(EXPR diff "${a} - ${b}")
    if(diff LESS 0)
      math(EXPR diff "0 - ${diff}")
    endif()
    if(diff GREATER worst)
      set(worst ${diff})
    endif()
    if(diff GREATER ${TOL})
      message(FATAL_ERROR "${label}, step ${i}: loss ${b} against the reference's ${a} (millionths), more than ${TOL} apart")
    endif()
  endforeach()
  message(STATUS "${label}: ${n} steps, losses within ${worst} millionths of the reference's")
endfunction()
