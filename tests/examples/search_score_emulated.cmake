# search_parallel --score FILE --emulate NODE prices the links of the cluster the file names as train_gpt --emulate
# paces them (the file's cluster emulated, not only the default one): the same ZeRO-3 configuration's exposed dp time
# with --emulate h100 differs from the plain score's (dgx-a100's NVLink stretched by H100's GEMM rate over A100's).
# -DEXE=search_parallel -DWORK=folder
file(MAKE_DIRECTORY ${WORK})
file(WRITE ${WORK}/config.json [=[{"format": "paradyse.parallel_config/1", "model": "gpt-175b", "cluster": "dgx-a100",
 "devices": 64, "seq": 512, "global_batch": 64, "trainer": "train_gpt", "dp": 64, "zero": 3, "micro_batch": 1}]=])
foreach(variant plain emulated)
  set(flags "")
  if(variant STREQUAL "emulated")
    set(flags --emulate h100)
  endif()
  execute_process(COMMAND ${EXE} --score ${WORK}/config.json ${flags} RESULT_VARIABLE rc OUTPUT_VARIABLE out
                  ERROR_VARIABLE err)
  if(NOT rc EQUAL 0 AND NOT rc EQUAL 1)  # 1: feasible or not, the breakdown is printed
    message(FATAL_ERROR "search_parallel --score ${flags} failed (${rc}): ${err}")
  endif()
  if(NOT out MATCHES "exposed dp +([0-9.]+) s")
    message(FATAL_ERROR "search_parallel --score ${flags}: no 'exposed dp' line in:\n${out}")
  endif()
  set(dp_${variant} ${CMAKE_MATCH_1})
endforeach()
message(STATUS "exposed dp: plain ${dp_plain} s, --emulate h100 ${dp_emulated} s")
if(dp_plain STREQUAL dp_emulated)
  message(FATAL_ERROR "--score with --emulate h100 priced the file's cluster un-emulated (exposed dp ${dp_plain} s both)")
endif()
