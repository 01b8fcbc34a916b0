# tests/examples/train_gpt_bf16.cmake: train_gpt --dtype bf16 (bf16 mixed precision, ops/cpu/bf16_backend.hpp) follows
# the fp32 run of the same options step by step: every step's loss within TOL_PPM millionths of the fp32 loss
# (relative), and the runs are not the same (the bf16 one rounds); and a bf16 run stopped halfway and resumed from its
# training checkpoint (which says compute_dtype bf16) gives the uninterrupted bf16 losses to the last bit. Prints the
# per-step table of both losses, their gap, and each run's median step time.
#
# The tolerance. One forward's loss moves under bf16 rounding by the mean over tokens of sum_j (p_j - [j = t]) dz_j,
# dz the logits' error: relative lambda sqrt(K) u to the logits' scale in norm (tests/model/mixed_precision.cpp:
# u = 2^-8, K = 3 + 12 L roundings on the forward path, lambda = 5; 0.11 for L = 2) but a mean over N tokens of
# terms of both signs, so ~0.11 max|z| / sqrt(N) for N >= 64 tokens and max|z| <~ 3: ~4e-2 absolute at most, under
# 2% of the losses of such a run (2.5..6). Training compounds the difference (the weights part after the first step),
# which over a short run stays of the same order (a statement, not a bound): 2% (TOL_PPM = 20000) is the stated
# tolerance; the measured gaps are printed (under 10^-3 on the CI run).
#   cmake -DEXE=train_gpt -DWORK=dir -DTOL_PPM=20000 -DARGS="--steps;30;..." -P train_gpt_bf16.cmake
foreach(var EXE WORK TOL_PPM ARGS)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "train_gpt_bf16.cmake: -D${var}=... is required")
  endif()
endforeach()
file(REMOVE_RECURSE ${WORK})
file(MAKE_DIRECTORY ${WORK})

include(${CMAKE_CURRENT_LIST_DIR}/step_rows.cmake)  # run_train, step_column, to_micro

# The median of a list of integers.
function(median values out_var)
  list(SORT values COMPARE NATURAL)
  list(LENGTH values n)
  math(EXPR middle "${n} / 2")
  list(GET values ${middle} m)
  set(${out_var} ${m} PARENT_SCOPE)
endfunction()

foreach(dtype fp32 bf16)
  run_train("train_gpt --dtype ${dtype}" ${EXE} ${ARGS} --dtype ${dtype} --csv ${WORK}/${dtype}.csv)
  step_column(${WORK}/${dtype}.csv loss loss_${dtype})
  step_column(${WORK}/${dtype}.csv seconds seconds_${dtype})
endforeach()
if(NOT last_output MATCHES "precision: bf16 mixed")
  message(FATAL_ERROR "train_gpt --dtype bf16 does not say it trains in bf16 mixed precision:\n${last_output}")
endif()

list(LENGTH loss_fp32 n)
list(LENGTH loss_bf16 m)
if(n EQUAL 0 OR NOT m EQUAL n)
  message(FATAL_ERROR "the fp32 run trained ${n} steps, the bf16 run ${m}")
endif()
math(EXPR last "${n} - 1")
set(table "step  loss fp32   loss bf16   gap (millionths of the loss)\n")
set(worst 0)
set(differs FALSE)
set(micro_fp32 "")
set(micro_bf16 "")
foreach(i RANGE ${last})
  list(GET loss_fp32 ${i} a_text)
  list(GET loss_bf16 ${i} b_text)
  to_micro(${a_text} a)
  to_micro(${b_text} b)
  if(NOT a_text STREQUAL b_text)
    set(differs TRUE)
  endif()
  math(EXPR gap "${a} - ${b}")
  if(gap LESS 0)
    math(EXPR gap "0 - ${gap}")
  endif()
  math(EXPR ppm "${gap} * 1000000 / ${a}")
  if(ppm GREATER worst)
    set(worst ${ppm})
  endif()
  string(APPEND table "${i}  ${a_text}  ${b_text}  ${ppm}\n")
  if(ppm GREATER ${TOL_PPM})
    message(FATAL_ERROR "${table}step ${i}: the bf16 loss ${b_text} is ${ppm} millionths from the fp32 loss ${a_text}, more "
                        "than ${TOL_PPM}")
  endif()
  foreach(dtype fp32 bf16)
    list(GET seconds_${dtype} ${i} s)
    to_micro(${s} us)
    list(APPEND micro_${dtype} ${us})
  endforeach()
endforeach()
if(NOT differs)
  message(FATAL_ERROR "${table}the bf16 run's losses equal the fp32 run's at every step: it did not round")
endif()
# A bf16 run stopped at step STOP (a training checkpoint: the fp32 masters, AdamW moments, options with --dtype bf16)
# and resumed continues with the uninterrupted bf16 run's losses to the last bit; the checkpoint says compute_dtype bf16.
math(EXPR stop "${n} / 2")
run_train("train_gpt --dtype bf16 --stop-after ${stop}" ${EXE} ${ARGS} --dtype bf16 --stop-after ${stop}
          --checkpoint-dir ${WORK}/checkpoints)
file(GLOB checkpoint ${WORK}/checkpoints/step_*.safetensors)
list(LENGTH checkpoint found)
if(NOT found EQUAL 1)
  message(FATAL_ERROR "train_gpt --stop-after ${stop} wrote ${found} checkpoints in ${WORK}/checkpoints, expected one")
endif()
file(READ ${checkpoint} header OFFSET 8 LIMIT 65536)  # after the 8-byte length (it holds NULs)
if(NOT header MATCHES "\"compute_dtype\":\"bf16\"")
  message(FATAL_ERROR "${checkpoint}: its metadata does not say compute_dtype bf16")
endif()
run_train("train_gpt --resume ${checkpoint}" ${EXE} --resume ${checkpoint} --csv ${WORK}/resumed.csv)
step_column(${WORK}/resumed.csv loss resumed)
list(SUBLIST loss_bf16 ${stop} -1 uninterrupted)
if(NOT resumed STREQUAL uninterrupted)
  message(FATAL_ERROR "the resumed bf16 run's losses\n  ${resumed}\ndiffer from the uninterrupted run's\n  ${uninterrupted}")
endif()
message(STATUS "bf16 stopped at step ${stop} and resumed: the uninterrupted run's losses to the last bit")

median("${micro_fp32}" median_fp32)
median("${micro_bf16}" median_bf16)
message(STATUS "${table}${n} steps: bf16 losses within ${worst} millionths of the fp32 losses (tolerance ${TOL_PPM}); "
               "median step time fp32 ${median_fp32} us, bf16 ${median_bf16} us")
