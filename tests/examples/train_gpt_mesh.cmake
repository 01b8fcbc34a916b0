# tests/examples/train_gpt_mesh.cmake: train_gpt on a mesh (--mesh dp=2,cp=2, pp=2,cp=2, ...) gives, step by step,
# the losses of the single cp group (--ranks C) training on the same batches, within float rounding (TOL, in
# millionths of the loss, absolute). A mesh given as MESH@Z trains with --zero Z. Both runs write their table as CSV
# (losses to 17 digits).
# With MOE_ARGS (an MoE GPT: --experts ...), two more checks of the experts folded over dp x cp:
#   1. train_gpt --experts --ranks C (examples/train_gpt/train_moe.hpp, the Gpt class; one window per step) and --mesh cp=C on
#      the same steps give the same losses (the mesh's single group is the MoE GPT's);
#   2. with MOE_PACK added (packed steps of several rows), --mesh cp=C and each of MOE_MESHES (dp x cp: the MoE layers
#      over the expert group of every replica's and cp rank's tokens, or with ep=..,etp=.. over expert groups of ep
#      ranks, experts replicated over edp) give the same losses.
# With PACK_DOCUMENTS (--pack-documents;B: each step one sequence of packed documents, attention within each), ARGS
# without its --pack-tokens and with PACK_DOCUMENTS instead: --ranks C against each of PACK_MESHES (dp = 1); the
# first of PACK_DP_MESHES (dp > 1: one packed sequence per replica per step) against the others of the same dp; and
# with MOE_ARGS, train_gpt --experts --ranks C against --experts --mesh cp=C on the same packed sequences.
# ZERO3_MESHES (optional): meshes trained with --zero 1 and with --zero 3: the losses agree (TOL) and ZeRO-3's peak
# memory per rank is below ZeRO-1's; ZERO3_ARGS (optional): arguments for those --zero 3 runs only.
# MESH_ARGS (optional): arguments for the mesh runs only (e.g. --virtual-stages;2), not for the single group's.
# A mesh given as MESH@Z/V (MOE_MESHES, MOE_PP_MESHES, ...) trains with --virtual-stages V as well, and one given
# as MESH@Z~S with --strategy S (e.g. MegatronRing or Tp2d in the attention and dense MLPs of a factorised group).
# MESHES may be empty (an MoE-only test): then no dense run is made.
# MOE_PP_MESHES, MOE_PP_PACK (optional, with MOE_ARGS): meshes with pipeline stages and several micro-batches per
# replica, each against the first (see 3. below).
# Run by ctest (examples/CMakeLists.txt):
#   cmake -DEXE=train_gpt -DCP=2 -DMESHES="dp=2,cp=2;pp=2,cp=2" -DTOL=100 -DWORK=dir -DARGS="--steps;4;..." \
#         [-DMPIEXEC=mpiexec -DMPI_MESH=dp=2,cp=2] [-DMOE_ARGS=... -DMOE_PACK=... -DMOE_MESHES=...] \
#         [-DMOE_MPI_MESH=dp=2,cp=2@2[+dp=2,ep=1@1...]] [-DPACK_DOCUMENTS=--pack-documents;512 -DPACK_MESHES=pp=2,cp=2] \
#         [-DPACK_DP_MESHES=dp=2,cp=2@0;dp=2,pp=2,cp=2@2] \
#         -P train_gpt_mesh.cmake
foreach(var EXE CP MESHES TOL WORK ARGS)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "train_gpt_mesh.cmake: -D${var}=... is required")
  endif()
endforeach()
file(MAKE_DIRECTORY ${WORK})

include(${CMAKE_CURRENT_LIST_DIR}/step_rows.cmake)  # run_train, step_column, to_micro

# A column of a CSV table (loss, peak_mib), in millionths (integers: CMake has no floating point), into out_var.
function(csv_micros path name out_var)
  step_column(${path} ${name} column)
  set(losses "")
  foreach(loss IN LISTS column)
    to_micro("${loss}" micro)
    list(APPEND losses ${micro})
  endforeach()
  set(${out_var} "${losses}" PARENT_SCOPE)
endfunction()
# The losses of a CSV table, in millionths, into out_var.
function(csv_losses path out_var)
  csv_micros(${path} loss losses)
  set(${out_var} "${losses}" PARENT_SCOPE)
endfunction()

# Runs the command with --csv CSV appended, and prints its output.
function(train_to label csv)
  run_train("${label}" ${ARGN} --csv ${csv})
  message(STATUS "${label}:\n${last_output}")
endfunction()

# Trains on BACKEND (threads or mpi) on the mesh SPEC (MESH or MESH@Z: --zero Z) with the arguments after the
# fourth, and sets out_var to its losses (millionths); the CSV is WORK/<prefix>_<backend>_<mesh>_zero<Z>.csv.
function(train_on_mesh prefix backend spec out_var)
  set(mesh ${spec})
  set(zero 0)
  set(virtual "")
  set(virtual_args "")
  set(strategy_args "")
  if(mesh MATCHES "^(.*)~([A-Za-z0-9]+)$")
    set(mesh ${CMAKE_MATCH_1})
    set(strategy_args --strategy ${CMAKE_MATCH_2})
  endif()
  if(mesh MATCHES "^(.*)/([0-9]+)$")
    set(mesh ${CMAKE_MATCH_1})
    set(virtual "_v${CMAKE_MATCH_2}")
    set(virtual_args --virtual-stages ${CMAKE_MATCH_2})
  endif()
  string(REPLACE ";" " " virtual_label "${virtual_args};${strategy_args}")
  string(STRIP "${virtual_label}" virtual_label)
  if(virtual_label)
    set(virtual_label " ${virtual_label}")
  endif()
  if(mesh MATCHES "^(.*)@([0-9])$")
    set(mesh ${CMAKE_MATCH_1})
    set(zero ${CMAKE_MATCH_2})
  endif()
  string(REPLACE "," "_" name "${prefix}_${backend}_${mesh}_zero${zero}${virtual}${strategy_args}")
  string(REPLACE ";" "_" name "${name}")
  string(REPLACE "=" "" name "${name}")
  if(backend STREQUAL "mpi")
    # The world's size is the mesh's: the product of the device axes' sizes (ep and etp fold the same devices).
    string(REGEX MATCHALL "(^|,)(dp|pp|cp|tp|tp_x|tp_y)=[0-9]+" axes "${mesh}")
    set(np 1)
    foreach(axis IN LISTS axes)
      string(REGEX REPLACE ".*=" "" size "${axis}")
      math(EXPR np "${np} * ${size}")
    endforeach()
    train_to("--mesh ${mesh} --zero ${zero}${virtual_label} on ${np} MPI processes" ${WORK}/${name}.csv
              ${MPIEXEC} -np ${np} --oversubscribe ${EXE} ${ARGN} --mesh ${mesh} --zero ${zero} ${virtual_args}
              ${strategy_args} --backend mpi)
  else()
    train_to("--mesh ${mesh} --zero ${zero}${virtual_label} on threads" ${WORK}/${name}.csv ${EXE} ${ARGN} --mesh ${mesh}
              --zero ${zero} ${virtual_args} ${strategy_args})
  endif()
  csv_losses(${WORK}/${name}.csv losses)
  set(${out_var} "${losses}" PARENT_SCOPE)
  set(last_run "--mesh ${mesh} --zero ${zero}${virtual_label} (${backend})" PARENT_SCOPE)
  set(last_csv ${WORK}/${name}.csv PARENT_SCOPE)
endfunction()

set(runs "")
foreach(mesh IN LISTS MESHES)
  list(APPEND runs "threads|${mesh}")
endforeach()
if(DEFINED MPIEXEC AND DEFINED MPI_MESH)
  list(APPEND runs "mpi|${MPI_MESH}")
endif()
if(runs)  # the dense meshes' reference (none needed when MESHES is empty: an MoE-only test)
  train_to("one cp group of ${CP} threads" ${WORK}/single.csv ${EXE} ${ARGS} --ranks ${CP})
  csv_losses(${WORK}/single.csv single)
  list(LENGTH single n)
  if(n EQUAL 0)
    message(FATAL_ERROR "the single-group run trained no step")
  endif()
endif()
foreach(run IN LISTS runs)
  string(REPLACE "|" ";" parts "${run}")
  list(GET parts 0 backend)
  list(GET parts 1 spec)
  train_on_mesh(dense ${backend} ${spec} meshed ${ARGS} ${MESH_ARGS})
  compare_losses("${last_run} against --ranks ${CP}" "${single}" "${meshed}")
endforeach()

# ZERO3_MESHES: each mesh trained with --zero 1 and --zero 3 on threads; ZeRO-3's losses against ZeRO-1's (TOL), and
# ZeRO-3's peak (the largest peak_mib of its steps: the largest over the ranks) below ZeRO-1's.
foreach(mesh IN LISTS ZERO3_MESHES)
  set(peaks "")
  foreach(zero 1 3)
    set(zero_args "")
    if(zero EQUAL 3)
      set(zero_args ${ZERO3_ARGS})
    endif()
    train_on_mesh(zero3 threads ${mesh}@${zero} losses_zero${zero} ${ARGS} ${MESH_ARGS} ${zero_args})
    csv_micros(${last_csv} peak_mib column)
    list(SORT column COMPARE NATURAL ORDER DESCENDING)
    list(GET column 0 peak_zero${zero})
  endforeach()
  compare_losses("--mesh ${mesh} --zero 3 against --zero 1" "${losses_zero1}" "${losses_zero3}")
  math(EXPR kib1 "${peak_zero1} * 1024 / 1000000")
  math(EXPR kib3 "${peak_zero3} * 1024 / 1000000")
  message(STATUS "--mesh ${mesh}: peak per rank ${kib1} KiB with --zero 1, ${kib3} KiB with --zero 3")
  if(NOT peak_zero3 LESS peak_zero1)
    message(FATAL_ERROR "--mesh ${mesh}: the peak with --zero 3 (${kib3} KiB) is not below --zero 1's (${kib1} KiB)")
  endif()
endforeach()

if(DEFINED MOE_ARGS)
  # 1. The mesh's single group is train_gpt --experts's MoE GPT (unpacked: one window per step).
  train_to("train_gpt --experts on ${CP} threads" ${WORK}/moe_single.csv ${EXE} ${MOE_ARGS} --ranks ${CP})
  csv_losses(${WORK}/moe_single.csv moe_single)
  train_to("--experts --mesh cp=${CP}" ${WORK}/moe_cp.csv ${EXE} ${MOE_ARGS} --mesh cp=${CP})
  csv_losses(${WORK}/moe_cp.csv moe_cp)
  compare_losses("--experts --mesh cp=${CP} against train_gpt --experts --ranks ${CP}" "${moe_single}" "${moe_cp}")
  # 2. Packed steps: the experts folded over dp x cp against the single cp group.
  train_to("--experts --mesh cp=${CP}, packed" ${WORK}/moe_cp_packed.csv ${EXE} ${MOE_ARGS} ${MOE_PACK} --mesh cp=${CP})
  csv_losses(${WORK}/moe_cp_packed.csv moe_reference)
  set(moe_runs "")
  foreach(spec IN LISTS MOE_MESHES)
    list(APPEND moe_runs "threads|${spec}")
  endforeach()
  if(DEFINED MPIEXEC AND DEFINED MOE_MPI_MESH)  # one mesh, or several joined by "+"
    string(REPLACE "+" ";" moe_mpi_meshes "${MOE_MPI_MESH}")
    foreach(spec IN LISTS moe_mpi_meshes)
      list(APPEND moe_runs "mpi|${spec}")
    endforeach()
  endif()
  foreach(run IN LISTS moe_runs)
    string(REPLACE "|" ";" parts "${run}")
    list(GET parts 0 backend)
    list(GET parts 1 spec)
    train_on_mesh(moe ${backend} ${spec} moe_meshed ${MOE_ARGS} ${MOE_PACK})
    compare_losses("--experts ${last_run} against --mesh cp=${CP}" "${moe_reference}" "${moe_meshed}")
  endforeach()
  # 3. MOE_PP_MESHES with MOE_PP_PACK (pipeline stages, several micro-batches per replica: a step's router losses are
  #    the mean of its micro-batches', which no single group trains): the first is the reference of the others, which
  #    must share its dp (the same micro-batches: row i of every replica).
  set(moe_pp_reference "")
  foreach(spec IN LISTS MOE_PP_MESHES)
    train_on_mesh(moe_pp threads ${spec} moe_pp_meshed ${MOE_ARGS} ${MOE_PP_PACK})
    if(moe_pp_reference STREQUAL "")
      set(moe_pp_reference "${moe_pp_meshed}")
      set(moe_pp_label "${last_run}")
    else()
      compare_losses("--experts ${last_run}, micro-batches, against ${moe_pp_label}" "${moe_pp_reference}"
                     "${moe_pp_meshed}")
    endif()
  endforeach()
endif()

if(DEFINED PACK_DOCUMENTS)
  # Packed sequences: ARGS with --pack-documents instead of --pack-tokens (the two exclude each other).
  set(pack_args ${ARGS})
  list(FIND pack_args "--pack-tokens" at)
  if(NOT at LESS 0)
    math(EXPR value "${at} + 1")
    list(REMOVE_AT pack_args ${at} ${value})
  endif()
  list(APPEND pack_args ${PACK_DOCUMENTS})
  train_to("one cp group of ${CP} threads, packed documents" ${WORK}/packed_single.csv ${EXE} ${pack_args} --ranks ${CP})
  csv_losses(${WORK}/packed_single.csv packed_single)
  foreach(spec IN LISTS PACK_MESHES)
    train_on_mesh(packed threads ${spec} packed_meshed ${pack_args})
    compare_losses("${last_run}, packed documents, against --ranks ${CP}" "${packed_single}" "${packed_meshed}")
  endforeach()
  # Over dp > 1 a mesh step holds one packed sequence per replica, which no single group trains together: the first
  # of PACK_DP_MESHES is the reference of the others (tests/examples/packing.cpp checks it against the documents alone).
  set(packed_dp_reference "")
  foreach(spec IN LISTS PACK_DP_MESHES)
    train_on_mesh(packed_dp threads ${spec} packed_dp_meshed ${pack_args})
    if(packed_dp_reference STREQUAL "")
      set(packed_dp_reference "${packed_dp_meshed}")
      set(packed_dp_label "${last_run}")
    else()
      compare_losses("${last_run}, packed documents, against ${packed_dp_label}" "${packed_dp_reference}"
                     "${packed_dp_meshed}")
    endif()
  endforeach()
  if(DEFINED MOE_ARGS)
    train_to("train_gpt --experts on ${CP} threads, packed documents" ${WORK}/moe_packed_single.csv ${EXE} ${MOE_ARGS}
              ${PACK_DOCUMENTS} --ranks ${CP})
    csv_losses(${WORK}/moe_packed_single.csv moe_packed_single)
    train_to("--experts --mesh cp=${CP}, packed documents" ${WORK}/moe_packed_cp.csv ${EXE} ${MOE_ARGS} ${PACK_DOCUMENTS}
              --mesh cp=${CP})
    csv_losses(${WORK}/moe_packed_cp.csv moe_packed_cp)
    compare_losses("--experts --mesh cp=${CP}, packed documents, against train_gpt --experts --ranks ${CP}"
                   "${moe_packed_single}" "${moe_packed_cp}")
  endif()
endif()
