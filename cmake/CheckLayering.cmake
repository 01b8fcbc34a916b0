# The layering test: no header includes a higher layer.
#
#   cmake -DROOT=<repository> -P cmake/CheckLayering.cmake
#
# Reads every header under include/paradyse/ (*.hpp, *.h, *.cuh) and the CUDA kernels of the top-level kernels/
# (*.cuh, *.cu: folder kernels, installed as include/paradyse/kernels/), takes each `#include "paradyse/<folder>/..."` (or
# <...>) and fails, listing every violation, when <folder> is higher in the order below than the header's own folder.
# A header may include headers of its own folder and of lower folders only. A folder that is not in the order is an
# error too, on either side of an include, so a new folder must first be given its place here (and in
# docs/DESIGN.md). Headers directly in include/paradyse/ (an umbrella header, none today) sit above every folder.
# Only line-start includes count: a commented-out `// #include` is ignored.
cmake_minimum_required(VERSION 3.20)

# Lowest first. moe sits below model (the layer stack runs the MoE sublayer); data (corpora, packing, document order)
# sits on layout (the chunking rule its document order balances); serve (the inference engine) and search
# (Hypertron) are placed before their first header lands. cli (programs' command lines, paradyse::cli) is the top: it
# serves programs and includes no other layer.
set(layers core device mesh comm ops kernels layout data contract strategy moe model cost plan serve search cli)

if(NOT DEFINED ROOT)
  get_filename_component(ROOT "${CMAKE_CURRENT_LIST_DIR}/.." ABSOLUTE)
endif()
set(include_root "${ROOT}/include/paradyse")
if(NOT IS_DIRECTORY "${include_root}")
  message(FATAL_ERROR "layering: ${include_root} is not a directory (pass -DROOT=<repository>)")
endif()

# The folder of a path below include/paradyse/ and its rank in the order: a header directly in include/paradyse/
# (folder "") ranks above every folder; an unknown folder ranks -1.
list(LENGTH layers top_rank)
function(layer_of path out_folder out_rank)
  if(path MATCHES "^([^/]+)/")
    set(folder "${CMAKE_MATCH_1}")
    list(FIND layers "${folder}" rank)
  else()
    set(folder "")
    set(rank ${top_rank})
  endif()
  set(${out_folder} "${folder}" PARENT_SCOPE)
  set(${out_rank} ${rank} PARENT_SCOPE)
endfunction()

file(GLOB_RECURSE headers RELATIVE "${include_root}" "${include_root}/*.hpp" "${include_root}/*.h"
  "${include_root}/*.cuh")
# The kernels sit at the top level (device code apart from the host templates) in layer `kernels`.
file(GLOB kernel_files RELATIVE "${ROOT}/kernels" "${ROOT}/kernels/*.cuh" "${ROOT}/kernels/*.cu")
list(TRANSFORM kernel_files PREPEND "kernels/")
list(APPEND headers ${kernel_files})
list(SORT headers)
if(NOT headers)
  message(FATAL_ERROR "layering: no headers found under ${include_root}")
endif()

set(violations "")
set(checked_includes 0)
foreach(header IN LISTS headers)
  if(header IN_LIST kernel_files)
    set(file "${header}")
  else()
    set(file "include/paradyse/${header}")
  endif()
  layer_of("${header}" own_folder own_rank)
  if(own_rank EQUAL -1)
    list(APPEND violations "${file} is in folder ${own_folder}/, which has no place in the layer order")
    continue()
  endif()

  file(STRINGS "${ROOT}/${file}" include_lines REGEX "^[ \t]*#[ \t]*include[ \t]*[<\"]paradyse/")
  foreach(line IN LISTS include_lines)
    if(NOT line MATCHES "^[ \t]*#[ \t]*include[ \t]*[<\"]paradyse/([^\">]*)[\">]")
      list(APPEND violations "${file} has an include it cannot read: ${line}")
      continue()
    endif()
    set(target "${CMAKE_MATCH_1}")
    math(EXPR checked_includes "${checked_includes} + 1")
    layer_of("${target}" target_folder target_rank)
    if(target_rank EQUAL -1)
      list(APPEND violations "${file} includes unknown layer ${target} (folder ${target_folder}/ has no place in the layer order)")
    elseif(target_rank GREATER own_rank)
      list(APPEND violations "${file} includes higher layer ${target}")
    endif()
  endforeach()
endforeach()

list(LENGTH headers header_count)
string(REPLACE ";" " < " order "${layers}")
if(violations)
  list(LENGTH violations violation_count)
  list(JOIN violations "\n  " listing)
  message(FATAL_ERROR "layering: ${violation_count} violation(s) of the order ${order}:\n  ${listing}\n")
endif()
message(STATUS "layering: ${header_count} headers, ${checked_includes} paradyse includes, none of a higher layer (${order})")
