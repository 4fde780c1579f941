# ctest script (kv_capi_*_exports_test): the shared library LIB exports
# exactly the kvdepot_kv_ functions the header HEADER declares, and no other
# defined symbol (see kv_capi.map). Run as
#   cmake -DNM=nm -DLIB=libkvdepot_kv_cpu.so -DHEADER=kv_capi.h -P kv_capi_exports.cmake
if(NOT EXISTS "${LIB}")
  message(STATUS "${LIB} is not built; skipped")
  return()
endif()

file(READ "${HEADER}" header)
string(REGEX MATCHALL "KVDEPOT_KV_API[^;]*[ *](kvdepot_kv_[a-z_]+)\\(" decls "${header}")
set(expected)
foreach(decl ${decls})
  string(REGEX MATCH "(kvdepot_kv_[a-z_]+)\\($" name "${decl}")
  list(APPEND expected "${CMAKE_MATCH_1}")
endforeach()
list(SORT expected)
list(LENGTH expected n)
if(n LESS 10)
  message(FATAL_ERROR "found only ${n} declarations in ${HEADER}: ${expected}")
endif()

execute_process(COMMAND "${NM}" -D --defined-only "${LIB}"
                OUTPUT_VARIABLE out RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${NM} -D --defined-only ${LIB} failed (${rc})")
endif()
string(REPLACE "\n" ";" lines "${out}")
set(exported)
foreach(line ${lines})
  # "<address> <type> <name>[@@version]"
  if(line MATCHES "^[0-9a-fA-F]+ [A-Za-z] ([^@ ]+)")
    list(APPEND exported "${CMAKE_MATCH_1}")
  endif()
endforeach()
list(SORT exported)

if(NOT exported STREQUAL expected)
  message(FATAL_ERROR "${LIB} exports\n  ${exported}\nexpected exactly\n  ${expected}")
endif()
message(STATUS "${LIB}: exports exactly the ${n} functions of kv_capi.h")
