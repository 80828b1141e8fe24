#pragma once
// std::cout and friends without <iostream>'s start-up cost. With libstdc++ up to GCC 12, every
// translation unit that includes <iostream> (CLI11's header does) holds a static
// std::ios_base::Init, whose constructor, before main, builds the eight standard streams and the
// classic C++ locale (~28 facets): ~0.07 ms of CPU and ~25 page faults of every start of a
// program linked with a static libstdc++, measured here (docs/performance.md), for streams a
// launch never writes to. This header declares the streams as <iostream> does and takes
// <iostream>'s place (its include guard), without the static object: whoever writes to them
// first constructs one through lazy_cout()/lazy_cerr() or ensure_iostreams(), which the CLI11
// path of the flag parser does before it builds anything. Include it before any header that
// includes <iostream>, in the files of bin/ddprun that would otherwise include it.
#include <istream>
#include <ostream>

// GCC 12's libstdc++ and older only: from GCC 13 on the streams are built by a static object in
// libstdc++ itself, linked in by any use of them, and <iostream> is included as it is (the
// launcher_no_locale test then skips).
#if defined(__GLIBCXX__) && defined(_GLIBCXX_RELEASE) && _GLIBCXX_RELEASE < 13 && !defined(_GLIBCXX_IOSTREAM)
#define _GLIBCXX_IOSTREAM 1
namespace std _GLIBCXX_VISIBILITY(default) {  // NOLINT: the declarations of <iostream>, verbatim
  _GLIBCXX_BEGIN_NAMESPACE_VERSION
  extern istream cin;
  extern ostream cout;
  extern ostream cerr;
  extern ostream clog;
#ifdef _GLIBCXX_USE_WCHAR_T
  extern wistream wcin;
  extern wostream wcout;
  extern wostream wcerr;
  extern wostream wclog;
#endif
  _GLIBCXX_END_NAMESPACE_VERSION
}  // namespace )
#else
#include <iostream>
#endif

namespace ddprun::launcher {

// Constructs the standard streams (once; flushed at exit), before their first use.
inline void ensure_iostreams() { static const std::ios_base::Init init; }
inline std::ostream& lazy_cout() {
  ensure_iostreams();
  return std::cout;
}
inline std::ostream& lazy_cerr() {
  ensure_iostreams();
  return std::cerr;
}

}  // namespace ddprun::launcher
