# Fails unless BINARY's dynamic section names only glibc's libraries (readelf -d, NEEDED), and
# not libm: loading it was ~13 page faults and ~10 system calls of every launch for three
# functions (docs/performance.md).
execute_process(COMMAND readelf -d ${BINARY} OUTPUT_VARIABLE out RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "readelf -d ${BINARY} failed (${rc}): is binutils installed?")
endif()
string(REGEX MATCHALL "\\(NEEDED\\)[^\n]*\\[([^]\n]+)\\]" lines "${out}")
set(bad "")
set(all "")
foreach(l ${lines})
  string(REGEX REPLACE ".*\\[([^]]+)\\]" "\\1" lib "${l}")
  list(APPEND all ${lib})
  if(NOT lib MATCHES "^(libc|ld-linux-x86-64|ld-linux-aarch64|libpthread|libdl|librt)\\.so")
    list(APPEND bad ${lib})
  endif()
endforeach()
if(NOT all)
  message(FATAL_ERROR "no NEEDED entries read from ${BINARY}:\n${out}")
endif()
if(bad)
  message(FATAL_ERROR "${BINARY} needs ${bad} at run time (all: ${all}); DDPRUN_STATIC_RUNTIME links "
                      "everything but glibc statically: link the new dependency statically or add it to "
                      "launcher/static_runtime (see cmake/DdprunStaticRuntime.cmake). libm: find the "
                      "caller with -Wl,-y,SYMBOL (std::ceil, std::floor, std::llround, "
                      "std::from_chars of a double ...) and do without it")
endif()
message(STATUS "${BINARY} needs only: ${all}")
# Hardening (launcher/CMakeLists.txt): symbols bound at start, so the GOT is read-only (full RELRO).
if(NOT out MATCHES "\\(FLAGS_1\\)[^\n]*NOW")
  message(FATAL_ERROR "${BINARY} is not linked with -z now (no NOW in FLAGS_1):\n${out}")
endif()
execute_process(COMMAND readelf -lW ${BINARY} OUTPUT_VARIABLE segments)
if(NOT segments MATCHES "GNU_RELRO")
  message(FATAL_ERROR "${BINARY} has no GNU_RELRO segment (-z relro)")
endif()
