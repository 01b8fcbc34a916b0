# tests/examples/moe_simulate_measure.cmake: moe_simulate --measure end to end on a small trace (issue 25's
# validation run, shortened): the synthetic MoE served on 2 thread ranks under TP, EP and dynamic (its forecast the dry
# run, whose events the clock charges as host work), 2 rounds each on the wall and CPU clocks, against the simulated
# clock of a given profile (tests/data/profiles/cpu_two_ranks.json with a host rate for the dynamic policy's forecast
# added, and one of the synthetic MoE's GEMM shapes as measured, so nothing is calibrated).
#   cmake -DEXE=moe_simulate -DPROFILE=tests/data/profiles/cpu_two_ranks.json -DWORK=dir -P moe_simulate_measure.cmake
# Checks: exit 0; every policy's wall, cpu, @speed, @steps 1 and @steps rows, each ending in its count of cells within
# the bounds; the step probe's reading around each round (2, positive), of all steps and of each kind (steps with a
# prompt chunk / of decode tokens alone); the per-step table's rows, the forecast's host work spent and charged in the
# dynamic policy's steps alone, and the same steps priced on the GEMM fits alone (", fits": the profile has measured
# shapes); the steps CSV: every policy's 2 rounds on the wall and CPU clocks and its simulated run, every step priced
# (simulated_s > 0; the CPU clock's on the GEMM table too, fits_s > 0, the others not), the CPU clock's step (each
# piece between collectives at its slowest rank) never shorter than rank 0's own CPU time in it, nor that shorter than
# rank 0's stepper compute, the layout each step computed in (the static policies' own, never switching; the dynamic
# policy's TP or EP), the forecast's events and CPU time in the dynamic policy's measured steps alone; static TP's
# routing recorded (--record-routing).
cmake_minimum_required(VERSION 3.20)
foreach(var EXE PROFILE WORK)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "moe_simulate_measure.cmake: -D${var}=... is required")
  endif()
endforeach()
file(REMOVE_RECURSE "${WORK}")
file(MAKE_DIRECTORY "${WORK}")
file(READ "${PROFILE}" profile)
string(JSON profile SET "${profile}" planning_events_per_s 2.0e7)
# An expert's TP slice (n 512 = 2 x 256 gate and up rows, k = h 256) measured at 1 and 16 rows.
string(JSON profile SET "${profile}" gemm measured
       [=[{"dtype_bytes": 4, "shapes": [{"n": 512, "k": 256, "rows": [1, 16], "seconds": [1e-4, 2e-4]}]}]=])
file(WRITE "${WORK}/profile.json" "${profile}")
execute_process(COMMAND "${EXE}" --measure --cluster "${WORK}/profile.json" --ranks 2 --requests 12 --rates 50
                        --prompt 8 16 --output 4 8 --step-tokens 16 --rounds 2 --policies tp,ep,dynamic
                        --forecast dry-run
                        --steps-csv "${WORK}/steps.csv" --record-routing "${WORK}/routing.csv"
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 240)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "moe_simulate --measure exited ${rc}:\n${out}\n${err}")
endif()
foreach(policy "static TP" "static EP" "dynamic TP/EP")
  foreach(clock "wall" "cpu" "wall @speed" "cpu @speed" "cpu @steps 1" "cpu @steps")
    if(NOT out MATCHES "${policy} +${clock} +[0-9.]+ +[0-9]+% +[0-9.]+[^\n]* [0-5]/5\n")
      message(FATAL_ERROR "moe_simulate --measure prints no \"${clock}\" row for ${policy}:\n${out}")
    endif()
  endforeach()
  if(NOT out MATCHES "${policy} +step probe [^\n:]*: ([0-9]+[.][0-9]+) ([0-9]+[.][0-9]+)\n"
     OR CMAKE_MATCH_1 EQUAL 0 OR CMAKE_MATCH_2 EQUAL 0)
    message(FATAL_ERROR
            "moe_simulate --measure prints no positive step probe reading for each of ${policy}'s 2 rounds:\n${out}")
  endif()
  set(pair "([0-9]+[.][0-9]+)/([0-9]+[.][0-9]+)")
  if(NOT out MATCHES "${policy} +the same, steps with a prompt chunk / of decode tokens alone: ${pair} ${pair}\n")
    message(FATAL_ERROR "moe_simulate --measure prints no step probe reading by kind for ${policy}'s 2 rounds:\n${out}")
  endif()
  foreach(i 1 2 3 4)
    if(CMAKE_MATCH_${i} EQUAL 0)
      message(FATAL_ERROR "a step probe reading by kind of ${policy} is 0:\n${out}")
    endif()
  endforeach()
  # The per-step table: count, tokens, cpu, rank 0, run, forecast (measured), simulated, compute, comm, host,
  # forecast (priced).
  set(number "[0-9]+[.][0-9]+")
  set(n " +${number}")
  set(row "${policy} +decode only +[0-9]+${n}${n}${n} +(${number}) +(${number})${n}${n}${n}${n} +(${number})")
  if(NOT out MATCHES "${row}")
    message(FATAL_ERROR "moe_simulate --measure prints no per-step row for ${policy}'s decode steps:\n${out}")
  endif()
  set(run "${CMAKE_MATCH_1}")
  set(forecast "${CMAKE_MATCH_2}")
  set(plan "${CMAKE_MATCH_3}")
  if(NOT out MATCHES "${policy}, fits +decode only +[0-9]+ +${number}")
    message(FATAL_ERROR "moe_simulate --measure prints no per-step row on the GEMM fits alone for ${policy}:\n${out}")
  endif()
  if(run EQUAL 0)
    message(FATAL_ERROR "${policy}'s decode steps spent no CPU in decoder_step (run ${run} ms):\n${out}")
  endif()
  if(policy STREQUAL "dynamic TP/EP" AND (plan EQUAL 0 OR forecast EQUAL 0))
    message(FATAL_ERROR "the dynamic policy's decode steps are charged no forecast or spent no CPU in it (charged "
                        "${plan} ms, spent ${forecast} ms):\n${out}")
  elseif(NOT policy STREQUAL "dynamic TP/EP" AND NOT (plan EQUAL 0 AND forecast EQUAL 0))
    message(FATAL_ERROR "${policy} plans no forecast but is charged ${plan} ms a step (spent ${forecast} ms):\n${out}")
  endif()
endforeach()
if(NOT EXISTS "${WORK}/routing.csv")
  message(FATAL_ERROR "--record-routing ${WORK}/routing.csv: no file written:\n${out}")
endif()
file(STRINGS "${WORK}/steps.csv" rows)
list(POP_FRONT rows header)
set(columns "policy,clock,round,step,end_s,step_s,cpu_s,run_s,tokens,decodes,layout,switch,simulated_s,fits_s,\
planning_events,forecast_s")
if(NOT header STREQUAL columns)
  message(FATAL_ERROR "steps.csv: unexpected header \"${header}\"")
endif()
set(seen "")
foreach(row IN LISTS rows)
  string(REPLACE "," ";" f "${row}")
  list(GET f 0 policy)
  list(GET f 1 clock)
  list(GET f 2 round)
  list(GET f 5 step_s)
  list(GET f 6 cpu_s)
  list(GET f 7 run_s)
  list(GET f 10 layout)
  list(GET f 11 switched)
  list(GET f 12 simulated_s)
  list(GET f 13 fits_s)
  list(GET f 14 events)
  list(GET f 15 forecast_s)
  list(APPEND seen "${policy}/${clock}/${round}")
  # The layout each step computed in: the static policies' own and never a switch; the dynamic policy's either.
  string(TOUPPER "${policy}" own)
  if(policy STREQUAL "dynamic")
    if(NOT layout MATCHES "^(TP|EP)$" OR NOT switched MATCHES "^[01]$")
      message(FATAL_ERROR "steps.csv: a dynamic step in layout \"${layout}\", switch \"${switched}\": ${row}")
    endif()
    if(switched EQUAL 1)
      list(APPEND dynamic_layouts "switch")
    endif()
    list(APPEND dynamic_layouts "${layout}")
  elseif(NOT layout STREQUAL own OR NOT switched EQUAL 0)
    message(FATAL_ERROR "steps.csv: a step of static ${own} in layout \"${layout}\", switch \"${switched}\": ${row}")
  endif()
  # The CPU clock's steps are priced on the GEMM table too (the profile has measured shapes), the others not; the
  # stepper's compute is part of rank 0's own CPU time in the step.
  if(clock STREQUAL "cpu")
    if(NOT fits_s GREATER 0)
      message(FATAL_ERROR "steps.csv: a CPU-clock step priced at fits_s \"${fits_s}\" on the GEMM table: ${row}")
    endif()
    if(NOT run_s GREATER 0 OR run_s GREATER cpu_s)
      message(FATAL_ERROR "steps.csv: a CPU-clock step of rank 0's ${cpu_s} s ran ${run_s} s in its stepper: ${row}")
    endif()
  elseif(NOT fits_s STREQUAL "")
    message(FATAL_ERROR "steps.csv: a ${clock} step priced on the GEMM table (${fits_s}): ${row}")
  endif()
  if(NOT policy STREQUAL "dynamic" AND NOT (events EQUAL 0 AND forecast_s EQUAL 0))
    message(FATAL_ERROR
            "steps.csv: ${policy} plans no forecast, yet a step has ${events} events, ${forecast_s} s: ${row}")
  endif()
  if(policy STREQUAL "dynamic" AND NOT clock STREQUAL "simulated" AND events GREATER 0)
    set(forecast_ran TRUE)
    if(NOT forecast_s GREATER 0)
      message(FATAL_ERROR "steps.csv: a forecast of ${events} events took ${forecast_s} s: ${row}")
    endif()
  endif()
  if(NOT simulated_s GREATER 0)
    message(FATAL_ERROR "steps.csv: a step priced at ${simulated_s} s: ${row}")
  endif()
  # Rank 0's pieces add up to its CPU time in the step (read a moment later), and each piece is taken at its slowest
  # rank: the CPU clock's step is never the shorter.
  if(clock STREQUAL "cpu" AND step_s LESS cpu_s)
    message(FATAL_ERROR "steps.csv: a CPU-clock step of ${step_s} s, shorter than rank 0's own ${cpu_s} s: ${row}")
  endif()
endforeach()
if(NOT forecast_ran)
  message(FATAL_ERROR "steps.csv: the dynamic policy's measured steps record no forecast")
endif()
list(REMOVE_DUPLICATES dynamic_layouts)
message(STATUS "steps.csv: the dynamic policy's steps: ${dynamic_layouts}")
list(REMOVE_DUPLICATES seen)
foreach(policy tp ep dynamic)
  foreach(run wall/0 wall/1 cpu/0 cpu/1 simulated/0)
    if(NOT "${policy}/${run}" IN_LIST seen)
      message(FATAL_ERROR "steps.csv has no steps of ${policy} on ${run} (clock/round)")
    endif()
  endforeach()
endforeach()
