// read_secret_file: one trailing newline dropped, empty/unreadable/non-regular files refused with
// the flag and path named, a world-readable file accepted with a warning, the secret never shown.
#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <string>

#include "ddprun/common/error.hpp"
#include "ddprun/common/secret_file.hpp"

namespace {

struct TempDir {
  std::filesystem::path path =
      std::filesystem::temp_directory_path() / ("ddprun-secret-test-" + std::to_string(::getpid()));
  TempDir() { std::filesystem::create_directories(path); }
  ~TempDir() { std::filesystem::remove_all(path); }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  std::string write(const std::string& name, const std::string& content, mode_t mode) const {
    const auto p = (path / name).string();
    std::ofstream(p, std::ios::binary) << content;
    ::chmod(p.c_str(), mode);
    return p;
  }
};

std::string error_of(const std::string& path) {
  try {
    ddprun::read_secret_file(path, "--token-file");
  } catch (const ddprun::Error& e) {
    return e.what();
  }
  return "<no error>";
}

}  // namespace

TEST_CASE("one trailing newline is dropped, nothing else") {
  TempDir dir;
  CHECK(ddprun::read_secret_file(dir.write("a", "s3cret\n", 0600), "--token-file").secret == "s3cret");
  CHECK(ddprun::read_secret_file(dir.write("b", "s3cret", 0600), "--token-file").secret == "s3cret");
  CHECK(ddprun::read_secret_file(dir.write("c", "s3cret\r\n", 0600), "--token-file").secret == "s3cret");
  CHECK(ddprun::read_secret_file(dir.write("d", "s3cret\n\n", 0600), "--token-file").secret == "s3cret\n");
  CHECK(ddprun::read_secret_file(dir.write("e", " a b ", 0600), "--token-file").secret == " a b ");
  CHECK(ddprun::read_secret_file(dir.write("f", "x\n", 0600), "--token-file").warning.empty());
}

TEST_CASE("a world-readable token file works but warns without showing the token") {
  TempDir dir;
  const auto r = ddprun::read_secret_file(dir.write("t", "hunter2\n", 0644), "--token-file");
  CHECK(r.secret == "hunter2");
  CHECK_THAT(r.warning,
             Catch::Contains("readable by every user") && Catch::Contains("0644") && Catch::Contains("chmod o-r"));
  CHECK_THAT(r.warning, !Catch::Contains("hunter2"));
}

TEST_CASE("empty, missing, directory and oversized token files are refused, naming flag and path") {
  TempDir dir;
  const auto empty = dir.write("empty", "\n", 0600);
  CHECK_THAT(error_of(empty), Catch::Contains("--token-file '" + empty + "' is empty"));
  CHECK_THAT(error_of(dir.write("zero", "", 0600)), Catch::Contains("is empty"));
  const auto missing = (dir.path / "missing").string();
  CHECK_THAT(error_of(missing),
             Catch::Contains("cannot open --token-file '" + missing + "'") && Catch::Contains("No such file"));
  CHECK_THAT(error_of(dir.path.string()), Catch::Contains("is not a regular file"));
  CHECK_THAT(error_of(dir.write("big", std::string(70000, 'x'), 0600)), Catch::Contains("at most 65536"));
}

TEST_CASE("an unreadable token file is refused with a hint") {
  if (::geteuid() == 0) {
    SUCCEED("root reads any file; permission errors cannot be produced here");
    return;
  }
  TempDir dir;
  const auto p = dir.write("locked", "x", 0000);
  CHECK_THAT(error_of(p), Catch::Contains("Permission denied") && Catch::Contains("LoadCredential="));
}
