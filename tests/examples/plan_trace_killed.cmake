# tests/examples/plan_trace_killed.cmake: plan_trace --csv streams its rows to FILE.tmp.<pid>.<n> beside FILE as each
# sequence is planned, and puts the table in place only at the end (core/csv_table.hpp): a run killed (SIGKILL)
# part-way leaves FILE as it was (an older table untouched, or absent) and its rows so far, whole, in the temporary.
#   cmake -DEXE=plan_trace -DWORK=dir -P plan_trace_killed.cmake
foreach(var EXE WORK)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "plan_trace_killed.cmake: -D${var}=... is required")
  endif()
endforeach()
file(REMOVE_RECURSE ${WORK})
file(MAKE_DIRECTORY ${WORK})
set(old "an older table\n")
file(WRITE ${WORK}/rows.csv "${old}")
# A trace far too long to finish (10^6 sequences); killed once its temporary holds 20 lines (up to 30 s).
execute_process(COMMAND sh -c "
  '${EXE}' --dataset githubcode --sequences 1000000 --hidden 1024 --heads 16 --layers 2 --csv '${WORK}/rows.csv' \
    >'${WORK}/out.txt' 2>&1 &
  pid=$!
  n=0
  for i in $(seq 1 300); do
    sleep 0.1
    n=$(cat '${WORK}'/rows.csv.tmp.* 2>/dev/null | wc -l)
    [ \"$n\" -ge 20 ] && break
  done
  kill -9 $pid
  wait $pid
  echo \"lines $n\"" OUTPUT_VARIABLE said RESULT_VARIABLE rc TIMEOUT 120)
file(READ ${WORK}/out.txt log)
if(NOT said MATCHES "lines ([0-9]+)" OR CMAKE_MATCH_1 LESS 20)
  message(FATAL_ERROR "plan_trace wrote no rows to its temporary within 30 s (${said}):\n${log}")
endif()
file(READ ${WORK}/rows.csv now)
if(NOT now STREQUAL old)
  message(FATAL_ERROR "the killed run changed --csv ${WORK}/rows.csv (it holds \"${now}\")")
endif()
file(GLOB temporaries ${WORK}/rows.csv.tmp.*)
list(LENGTH temporaries n)
if(NOT n EQUAL 1)
  message(FATAL_ERROR "expected one temporary beside rows.csv, found ${n}: ${temporaries}")
endif()
file(STRINGS ${temporaries} lines)
list(GET lines 0 header)
if(NOT header MATCHES "^dataset,sequence,length,variant,kind,time_s,peak_bytes")
  message(FATAL_ERROR "the temporary does not start with the table's header: ${header}")
endif()
string(REPLACE "," ";" columns "${header}")
list(LENGTH columns width)
list(LENGTH lines count)
math(EXPR last "${count} - 2")  # every row but the last (the kill may fall inside one) is whole
foreach(i RANGE 1 ${last})
  list(GET lines ${i} row)
  string(REGEX REPLACE "\"[^\"]*\"" "quoted" unquoted "${row}")  # a quoted field may hold commas
  string(REGEX MATCHALL "," commas "${unquoted}")
  list(LENGTH commas c)
  math(EXPR fields "${c} + 1")
  if(NOT row MATCHES "^githubcode," OR NOT fields EQUAL width)
    message(FATAL_ERROR "row ${i} of the temporary is not a whole row of ${width} fields: ${row}")
  endif()
endforeach()
message(STATUS "plan_trace killed: rows.csv untouched, ${count} lines streamed to ${temporaries}")
