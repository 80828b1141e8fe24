# Project-wide settings as INTERFACE targets (ccache style): every ddprun target links
# ddprun_settings; nothing here leaks into consumers of the installed worker library.
add_library(ddprun_settings INTERFACE)
target_compile_features(ddprun_settings INTERFACE cxx_std_20)
# -Wnull-dereference is left out: GCC 12 reports false positives inside inlined Asio scheduler
# code (a system header), in every file that runs an io_context.
target_compile_options(ddprun_settings INTERFACE
  -Wall -Wextra -Wpedantic -Wshadow -Wnon-virtual-dtor -Wold-style-cast -Wcast-align
  -Wunused -Woverloaded-virtual -Wconversion -Wsign-conversion
  -Wdouble-promotion -Wformat=2 -Wimplicit-fallthrough
  $<$<CXX_COMPILER_ID:GNU>:-Wmisleading-indentation -Wduplicated-cond -Wlogical-op>)
target_compile_definitions(ddprun_settings INTERFACE
  BOOST_ASIO_NO_DEPRECATED
  SPDLOG_FMT_EXTERNAL)

if(DDPRUN_SANITIZE)
  message(STATUS "ddprun: building with -fsanitize=${DDPRUN_SANITIZE}")
  add_compile_options(-fsanitize=${DDPRUN_SANITIZE} -fno-omit-frame-pointer -fno-sanitize-recover=all)
  add_link_options(-fsanitize=${DDPRUN_SANITIZE})
endif()

# The fuzz build (scripts/fuzz, build-fuzz/): the static libraries carry libFuzzer's coverage
# instrumentation and the sanitizers (ddprun_fuzz_instrument), so that the targets linking whole
# libraries (fuzz_text_parsers, fuzz_flags in tests/fuzz/) are guided through their code too.
# Only the static ones: a shared library would need the sanitizers' runtime at its link.
set(DDPRUN_FUZZ_FLAGS -fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined
                      -fno-omit-frame-pointer)
function(ddprun_fuzz_instrument target)
  if(DDPRUN_FUZZ AND CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
    target_compile_options(${target} PRIVATE ${DDPRUN_FUZZ_FLAGS})
  endif()
endfunction()

# Helper: one library per folder, sources picked up from <folder>/src.
function(ddprun_add_folder_library name)
  cmake_parse_arguments(ARG "" "" "DEPS" ${ARGN})
  file(GLOB_RECURSE _srcs CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/src/*.cpp)
  add_library(ddprun_${name} STATIC ${_srcs})
  add_library(ddprun::${name} ALIAS ddprun_${name})
  target_include_directories(ddprun_${name} PUBLIC
    $<BUILD_INTERFACE:${CMAKE_CURRENT_SOURCE_DIR}/include>
    $<INSTALL_INTERFACE:include>)
  target_link_libraries(ddprun_${name} PUBLIC ${ARG_DEPS} PRIVATE ddprun_settings)
  set_target_properties(ddprun_${name} PROPERTIES POSITION_INDEPENDENT_CODE ON)
  ddprun_fuzz_instrument(ddprun_${name})
endfunction()
