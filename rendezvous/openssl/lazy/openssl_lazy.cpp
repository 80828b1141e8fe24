// OpenSSL loaded on first use, for bin/ddprun (openssl_runtime.hpp; x86-64 only).
//
// Each OpenSSL function ddprun calls (functions.inc) is defined here as a small trampoline that
// jumps through a slot. The slots start empty; require_openssl() (or, as a fallback, the first
// trampoline called) loads libcrypto.so.3 and libssl.so.3 with dlopen and fills every slot with
// dlsym, once, under a lock. A trampoline that finds its slot empty saves the argument
// registers, loads, restores them and jumps on, so the call proceeds as if OpenSSL had been
// linked; if loading fails there it can only abort (no exception can cross the assembly frame),
// which is why every feature calls require_openssl() first and gets a ddprun::Error instead.
// The trampolines are hidden: the executable exports none of these names, so the loaded
// libraries bind to each other, never to the trampolines.
#include <dlfcn.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <string>

#include "ddprun/common/error.hpp"
#include "ddprun/rendezvous/openssl_runtime.hpp"

#if !defined(__x86_64__)
#error "lazy/openssl_lazy.cpp is x86-64 only; build with -DDDPRUN_LAZY_OPENSSL=OFF"
#endif

extern "C" {
#define X(name, lib) __attribute__((visibility("hidden"), used)) void* ddprun_ossl_slot_##name = nullptr;
#include "functions.inc"
#undef X
__attribute__((visibility("hidden"), used)) void ddprun_ossl_load_or_die();
}

// The trampoline: endbr64 (a no-op without CET), the fast path (slot filled: jump), else save
// the six integer argument registers and %rax (the vector count of a variadic call), load,
// restore, jump. On entry %rsp is 8 mod 16; seven pushes make the call aligned. No OpenSSL
// function ddprun calls takes floating-point arguments.
// clang-format off
#define X(name, lib)                                                                   \
  asm(".pushsection .text\n"                                                           \
      ".globl " #name "\n"                                                             \
      ".hidden " #name "\n"                                                            \
      ".type " #name ", @function\n"                                                   \
      ".p2align 4\n"                                                                   \
      #name ":\n"                                                                      \
      "  endbr64\n"                                                                    \
      "  movq ddprun_ossl_slot_" #name "(%rip), %r11\n"                                \
      "  testq %r11, %r11\n"                                                           \
      "  jz 1f\n"                                                                      \
      "  jmpq *%r11\n"                                                                 \
      "1:\n"                                                                           \
      "  pushq %rdi\n  pushq %rsi\n  pushq %rdx\n  pushq %rcx\n  pushq %r8\n"          \
      "  pushq %r9\n  pushq %rax\n"                                                    \
      "  call ddprun_ossl_load_or_die\n"                                               \
      "  popq %rax\n  popq %r9\n"                                                      \
      "  popq %r8\n  popq %rcx\n  popq %rdx\n  popq %rsi\n  popq %rdi\n"               \
      "  jmpq *ddprun_ossl_slot_" #name "(%rip)\n"                                     \
      ".size " #name ", .-" #name "\n"                                                 \
      ".popsection\n");
// clang-format on
#include "functions.inc"
#undef X

namespace ddprun::rendezvous {

namespace {

constexpr const char* kLibraries[] = {"libcrypto.so.3", "libssl.so.3"};

std::mutex load_mutex;
std::atomic<bool> loaded{false};
std::string load_error;  // set once under load_mutex when loading failed

// Loads both libraries and fills every slot; empty string on success, else what failed.
std::string load_locked() {
  void* handles[2] = {nullptr, nullptr};
  for (int i = 0; i < 2; ++i) {
    // libcrypto first: libssl's own need for it is then met by the copy already loaded.
    handles[i] = ::dlopen(kLibraries[i], RTLD_NOW | RTLD_LOCAL);
    if (handles[i] == nullptr) {
      const char* why = ::dlerror();
      return std::string("cannot load ") + kLibraries[i] + ": " + (why != nullptr ? why : "unknown dlopen error");
    }
  }
  struct Entry {
    const char* name;
    int lib;
    void** slot;
  };
  static const Entry entries[] = {
#define X(name, lib) {#name, lib, &ddprun_ossl_slot_##name},
#include "functions.inc"
#undef X
  };
  void* found[sizeof entries / sizeof entries[0]] = {};
  for (std::size_t i = 0; i < sizeof entries / sizeof entries[0]; ++i) {
    found[i] = ::dlsym(handles[entries[i].lib], entries[i].name);
    if (found[i] == nullptr) {
      return std::string(kLibraries[entries[i].lib]) + " has no " + entries[i].name + " (is it OpenSSL 3?)";
    }
  }
  // All or nothing: no slot is filled unless every function was found.
  for (std::size_t i = 0; i < sizeof entries / sizeof entries[0]; ++i) {
    __atomic_store_n(entries[i].slot, found[i], __ATOMIC_RELEASE);
  }
  return {};
}

// Loads once; returns the failure ("" when loaded).
const std::string& load() {
  if (loaded.load(std::memory_order_acquire)) return load_error;
  std::lock_guard<std::mutex> lock(load_mutex);
  if (!loaded.load(std::memory_order_relaxed) && load_error.empty()) {
    load_error = load_locked();
    if (load_error.empty()) loaded.store(true, std::memory_order_release);
  }
  return load_error;
}

}  // namespace

void require_openssl(std::string_view purpose) {
  const std::string& error = load();
  if (error.empty()) return;
  throw Error(std::string(purpose) + " needs OpenSSL 3, which ddprun loads when it is first used: " + error,
              "install OpenSSL 3's libraries (Debian/Ubuntu: apt-get install libssl3; Fedora/RHEL: dnf install "
              "openssl-libs), or make libssl.so.3 findable through LD_LIBRARY_PATH");
}

bool openssl_deferred() { return !loaded.load(std::memory_order_acquire); }

}  // namespace ddprun::rendezvous

extern "C" void ddprun_ossl_load_or_die() {
  // No exception may leave: the trampoline that called this has no unwind information.
  const char* error = "unknown error";
  try {
    const std::string& e = ddprun::rendezvous::load();
    if (e.empty()) return;
    error = e.c_str();  // load_error is never changed again once set
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ddprun: internal error: loading OpenSSL failed: %s\n", e.what());
    std::abort();
  }
  std::fprintf(stderr,
               "ddprun: internal error: an OpenSSL function was called before require_openssl() and OpenSSL "
               "cannot be loaded: %s\n",
               error);
  std::abort();
}
