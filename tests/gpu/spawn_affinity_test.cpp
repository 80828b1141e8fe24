// spawn_worker's CPU binding (--numa-binding, agent/process.hpp): the child is bound before
// exec, and a mask the kernel refuses is reported in affinity_error while the worker still runs.
#include <fcntl.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cerrno>
#include <string>

#include "ddprun/agent/process.hpp"
#include "ddprun/worker_env/numa.hpp"

using namespace ddprun;

namespace {

// Runs `sh -c 'grep Cpus_allowed_list /proc/self/status'` with `cpus`; returns the listed CPUs.
std::string run_bound(const std::vector<int>& cpus, agent::SpawnResult& res) {
  int p[2];
  REQUIRE(::pipe2(p, O_CLOEXEC) == 0);
  agent::SpawnRequest req;
  req.path = "/bin/sh";
  req.argv = {"sh", "-c", "sed -n 's/^Cpus_allowed_list:[[:space:]]*//p' /proc/self/status"};
  req.envp = {"PATH=/usr/bin:/bin"};
  req.stdout_fd = p[1];
  req.cpus = cpus;
  res = agent::spawn_worker(req);
  ::close(p[1]);
  std::string out;
  char buf[256];
  for (ssize_t n; (n = ::read(p[0], buf, sizeof buf)) > 0;) out.append(buf, static_cast<std::size_t>(n));
  ::close(p[0]);
  REQUIRE(res.pid > 0);
  const auto status = agent::peek_exit(res.pid);
  agent::reap(res.pid, res.pidfd);
  (void)status;
  while (!out.empty() && out.back() == '\n') out.pop_back();
  return out;
}

}  // namespace

TEST_CASE("spawn_worker binds the child to the requested CPUs", "[numa][spawn]") {
  const auto mine = worker_env::current_cpu_affinity();
  REQUIRE_FALSE(mine.empty());
  agent::SpawnResult res;
  // The last allowed CPU only (with one CPU this is still a real, checked binding).
  CHECK(run_bound({mine.back()}, res) == std::to_string(mine.back()));
  CHECK(res.ok());
  CHECK(res.affinity_error == 0);
  // No request: the agent's own affinity is inherited.
  CHECK(run_bound({}, res) == worker_env::format_cpu_list(mine));
  CHECK(res.affinity_error == 0);
}

TEST_CASE("a binding the kernel refuses is best effort", "[numa][spawn]") {
  const auto mine = worker_env::current_cpu_affinity();
  agent::SpawnResult res;
  // CPU 4000 does not exist here: sched_setaffinity fails with EINVAL; the worker runs unbound.
  CHECK(run_bound({4000}, res) == worker_env::format_cpu_list(mine));
  CHECK(res.ok());
  CHECK(res.affinity_error == EINVAL);
}
