# Start-up cost of the ddprun launcher (docs/performance.md, "Where the launch time goes"):
# the dynamic loader's symbol lookups and relocations for libstdc++, spdlog, fmt, libssl and
# libcrypto cost about 2.5 ms of CPU per launch, more than a bare posix_spawn of a worker.
# With DDPRUN_STATIC_RUNTIME (the default) bin/ddprun links those statically and needs only
# glibc (libc; not even libm) at run time; the test `launcher_needed_libs` checks that. The other
# binaries and libddprun_worker.so stay dynamic. OpenSSL: on x86-64 bin/ddprun loads it with
# dlopen on first use instead (DDPRUN_LAZY_OPENSSL, rendezvous/openssl/), so the system's
# security updates reach it; elsewhere it is linked statically and reaches it only through a
# rebuild. Configure with -DDDPRUN_STATIC_RUNTIME=OFF to link everything dynamically again.
option(DDPRUN_STATIC_RUNTIME "Link libstdc++, spdlog, fmt and OpenSSL statically into bin/ddprun" ON)

if(DDPRUN_STATIC_RUNTIME)
  # FindOpenSSL caches the library it found: a build tree configured before this option existed
  # holds the shared ones.
  foreach(_v OPENSSL_SSL_LIBRARY OPENSSL_CRYPTO_LIBRARY)
    if(DEFINED CACHE{${_v}} AND NOT "$CACHE{${_v}}" MATCHES "\\.a$")
      unset(${_v} CACHE)
    endif()
  endforeach()
  set(OPENSSL_USE_STATIC_LIBS TRUE)
endif()

# Links `target` (an executable) with the static runtime when DDPRUN_STATIC_RUNTIME is on.
# spdlog's and fmt's compiled parts come in as object files (launcher/static_runtime), so the
# shared libraries the other targets name are left unneeded and --as-needed drops them.
function(ddprun_static_runtime target)
  if(NOT DDPRUN_STATIC_RUNTIME)
    return()
  endif()
  if(NOT TARGET ddprun_static_runtime_objects)
    add_library(ddprun_static_runtime_objects OBJECT
      ${PROJECT_SOURCE_DIR}/launcher/static_runtime/spdlog_impl.cpp
      ${PROJECT_SOURCE_DIR}/launcher/static_runtime/fmt_impl.cpp)
    # Compiled against the same headers and definitions as everything else (spdlog::spdlog's
    # SPDLOG_COMPILED_LIB mode); Debian's headers are not warning-clean at our level.
    target_link_libraries(ddprun_static_runtime_objects PRIVATE spdlog::spdlog)
  endif()
  target_sources(${target} PRIVATE $<TARGET_OBJECTS:ddprun_static_runtime_objects>)
  target_link_options(${target} PRIVATE -static-libstdc++ -static-libgcc LINKER:--as-needed)
endfunction()
