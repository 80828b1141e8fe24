// Host lists for the SSH fan-out: hostfile / --hosts parsing and DeepSpeed-style selection.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <cstdio>
#include <fstream>

#include "ddprun/common/error.hpp"
#include "ddprun/launcher/hosts.hpp"

using namespace ddprun::launcher;
using Catch::Matchers::Contains;
using ddprun::UsageError;

namespace {

HostEntry host(std::string name, int slots = -1, std::string user = {}) {
  HostEntry e;
  e.user = std::move(user);
  e.host = std::move(name);
  e.slots = slots;
  return e;
}

HostEntry with_slots(HostEntry e, std::vector<int> idx) {
  e.slot_indices = std::move(idx);
  return e;
}

std::vector<std::string> names(const std::vector<HostEntry>& v) {
  std::vector<std::string> out;
  for (const auto& e : v) out.push_back(e.host);
  return out;
}

}  // namespace

TEST_CASE("hostfile: every accepted line form") {
  const std::string text =
      "# DeepSpeed style\n"
      "worker-0 slots=4\n"
      "worker-1   slots=8   # trailing comment\n"
      "\n"
      "   \t\n"
      "node-a:2\n"
      "node-b\n"
      "alice@node-c slots=2\n"
      "bob@node-d:3\n"
      "node-e slots=1 max_slots=4\n"
      "10.0.0.7\n"
      "[fe80::1]:2\n"
      "fe80::2\n"
      "crlf-host slots=2\r\n";
  std::vector<std::string> notes;
  const auto hosts = parse_hostfile_text(text, "hosts.txt", &notes);
  const std::vector<HostEntry> want = {host("worker-0", 4), host("worker-1", 8),        host("node-a", 2),
                                       host("node-b"),      host("node-c", 2, "alice"), host("node-d", 3, "bob"),
                                       host("node-e", 1),   host("10.0.0.7"),           host("fe80::1", 2),
                                       host("fe80::2"),     host("crlf-host", 2)};
  CHECK(hosts == want);
  REQUIRE(notes.size() == 1);
  CHECK_THAT(notes[0], Contains("hosts.txt:10") && Contains("max_slots=4"));
  CHECK(hosts[4].destination() == "alice@node-c");
  CHECK(hosts[0].destination() == "worker-0");
  // Without a notes sink, ignored keys are fine too.
  CHECK(parse_hostfile_text("h slots=2 max_slots=3\n", "f").at(0).slots == 2);
  // Comments only -> no hosts (load_hostfile rejects that).
  CHECK(parse_hostfile_text("# nothing\n\n", "f").empty());
}

TEST_CASE("hostfile: errors name file:line") {
  CHECK_THROWS_WITH(parse_hostfile_text("a slots=2\nb slots=2\na slots=4\n", "hf"),
                    Contains("hf:3") && Contains("'a' is listed twice") && Contains("line 1"));
  // Same host with a different user is still the same host.
  CHECK_THROWS_WITH(parse_hostfile_text("u@a\nv@a\n", "hf"), Contains("hf:2") && Contains("twice"));
  CHECK_THROWS_WITH(parse_hostfile_text("\n\na slots=0\n", "hf"), Contains("hf:3") && Contains("slots=0"));
  CHECK_THROWS_WITH(parse_hostfile_text("a slots=-1\n", "hf"), Contains("hf:1") && Contains("positive"));
  CHECK_THROWS_WITH(parse_hostfile_text("a slots=x\n", "hf"), Contains("slots=x"));
  CHECK_THROWS_WITH(parse_hostfile_text("a slots=\n", "hf"), Contains("hf:1"));
  CHECK_THROWS_WITH(parse_hostfile_text("a slots=99999999\n", "hf"), Contains("hf:1"));
  CHECK_THROWS_WITH(parse_hostfile_text("a:0\n", "hf"), Contains("hf:1") && Contains("slot count '0'"));
  CHECK_THROWS_WITH(parse_hostfile_text("a:x\n", "hf"), Contains("slot count 'x'"));
  CHECK_THROWS_WITH(parse_hostfile_text("a:\n", "hf"), Contains("hf:1"));
  CHECK_THROWS_WITH(parse_hostfile_text("a:2 slots=2\n", "hf"), Contains("given twice"));
  CHECK_THROWS_WITH(parse_hostfile_text("a slots=2 slots=3\n", "hf"), Contains("given twice"));
  CHECK_THROWS_WITH(parse_hostfile_text("a b\n", "hf"), Contains("hf:1") && Contains("'b' is not a KEY=VALUE"));
  CHECK_THROWS_WITH(parse_hostfile_text("a =4\n", "hf"), Contains("'=4'"));
  CHECK_THROWS_WITH(parse_hostfile_text("-oProxyCommand=x\n", "hf"), Contains("not a valid host name"));
  CHECK_THROWS_WITH(parse_hostfile_text("a;b\n", "hf"), Contains("not a valid host name"));
  CHECK_THROWS_WITH(parse_hostfile_text("@a\n", "hf"), Contains("not a valid user name"));
  CHECK_THROWS_WITH(parse_hostfile_text("-u@a\n", "hf"), Contains("not a valid user name"));
  CHECK_THROWS_WITH(parse_hostfile_text("u@\n", "hf"), Contains("empty host name"));
  CHECK_THROWS_WITH(parse_hostfile_text(":4\n", "hf"), Contains("empty host name"));
  CHECK_THROWS_WITH(parse_hostfile_text("[fe80::1\n", "hf"), Contains("without ']'"));
  CHECK_THROWS_WITH(parse_hostfile_text("[host]\n", "hf"), Contains("not an IPv6 address"));
  CHECK_THROWS_WITH(parse_hostfile_text("[fe80::1]x\n", "hf"), Contains("after ']'"));
  // Colons that make no IPv6 address ("host:8:" is a typo of host:8) are a parse error here,
  // not an unresolvable name later.
  CHECK_THROWS_WITH(parse_hostfile_text("node1:8:\n", "hf"), Contains("hf:1") && Contains("not a host name or IPv6"));
  CHECK_THROWS_WITH(parse_hostfile_text("[fe80:::1]\n", "hf"), Contains("not an IPv6 address"));
  CHECK(parse_hostfile_text("fe80::1%eth0\n[fd00::5]:2\n", "hf").size() == 2);
  // An address whose last group could be a slot count (host:N) is ambiguous, as in --include;
  // before, fd00::5:4 was read as the whole address with one slot.
  CHECK_THROWS_WITH(parse_hostfile_text("fd00::5:4\n", "hf"),
                    Contains("hf:1") && Contains("ambiguous") && Contains("[fd00::5]:4") && Contains("[fd00::5:4]"));
  CHECK(parse_hostfile_text("[fd00::5:4]\nfd00::5\n", "hf").size() == 2);
  // With slots=N after it the word is the whole address (a count given twice is no reading).
  const auto whole = parse_hostfile_text("fd00::5:4 slots=8\n", "hf");
  REQUIRE(whole.size() == 1);
  CHECK(whole[0].host == "fd00::5:4");
  CHECK(whole[0].slots == 8);
  // A last group that is no slot count (0) leaves one reading: the whole address.
  CHECK(parse_hostfile_text("fd00::5:0\n", "hf").front().host == "fd00::5:0");
  // A word far longer than any host name is named by its start and length, not echoed whole.
  const std::string huge(100000, 'h');
  CHECK_THROWS_WITH(parse_hostfile_text(huge + "\n", "hf"), Contains("hf:1") &&
                                                                Contains("(100000 characters): too long for a host") &&
                                                                !Contains(std::string(1000, 'h')));
  CHECK_THROWS_WITH(parse_hostfile_text(std::string("a\0b\n", 4), "hf"), Contains("NUL"));
  // Every error carries the accepted forms as its hint.
  try {
    parse_hostfile_text("a slots=0\n", "hf");
    FAIL("no throw");
  } catch (const UsageError& e) {
    CHECK_THAT(e.hint(), Contains("host slots=N"));
  }
}

TEST_CASE("host names that differ only in letter case are one host; messages keep the spelling") {
  // ssh and DNS ignore the case of a host name: Node1 and node1 would start two agents on one
  // machine.
  CHECK_THROWS_WITH(parse_hostfile_text("node1 slots=2\nNODE1 slots=2\n", "hf"),
                    Contains("hf:2") && Contains("'NODE1' is listed twice") && Contains("line 1 as 'node1'") &&
                        Contains("ignore case"));
  CHECK_THROWS_WITH(parse_hostfile_text("u@Ab\nv@aB\n", "hf"), Contains("'aB' is listed twice"));
  CHECK_THROWS_WITH(parse_hostfile_text("[FE80::1]\nfe80::1\n", "hf"), Contains("listed twice"));
  CHECK_THROWS_WITH(parse_hosts_list("h1,H1", "--hosts"),
                    Contains("'H1' is listed twice") && Contains("first as 'h1'"));
  CHECK_THROWS_WITH(parse_hosts_list("h1,h1", "--hosts"), Contains("'h1' is listed twice") && !Contains("case"));
  // Distinct hosts keep the spelling the user gave (an ssh config alias may care).
  CHECK(names(parse_hosts_list("Node1,node2", "--hosts")) == std::vector<std::string>{"Node1", "node2"});
}

TEST_CASE("load_hostfile reads a file and rejects unreadable or empty ones") {
  char dir_template[] = "/tmp/ddprun-fanout-XXXXXX";
  REQUIRE(::mkdtemp(dir_template) != nullptr);
  const std::string dir = dir_template;
  const std::string good = dir + "/hosts";
  const std::string empty = dir + "/empty";
  { std::ofstream(good) << "worker-0 slots=2\nworker-1 slots=2\n"; }
  { std::ofstream(empty) << "# only a comment\n"; }
  CHECK(load_hostfile(good) == std::vector<HostEntry>{host("worker-0", 2), host("worker-1", 2)});
  CHECK_THROWS_WITH(load_hostfile(empty), Contains(empty) && Contains("lists no host"));
  CHECK_THROWS_WITH(load_hostfile(dir + "/missing"), Contains(dir + "/missing") && Contains("cannot be read"));
  // An error inside the file names the path and the line.
  { std::ofstream(good) << "a\nb:0\n"; }
  CHECK_THROWS_WITH(load_hostfile(good), Contains(good + ":2"));
  std::remove(good.c_str());
  std::remove(empty.c_str());
  ::rmdir(dir.c_str());
}

TEST_CASE("load_hostfile refuses a directory, a device and a file too large to be a host list") {
  char dir_template[] = "/tmp/ddprun-fanout-XXXXXX";
  REQUIRE(::mkdtemp(dir_template) != nullptr);
  const std::string dir = dir_template;
  CHECK_THROWS_WITH(load_hostfile(dir), Contains("--hostfile " + dir + ": is a directory") && !Contains("no host"));
  // /dev/zero has no end: it used to be read until the memory ran out.
  CHECK_THROWS_WITH(load_hostfile("/dev/zero"), Contains("--hostfile /dev/zero: is a device"));
  // A pipe is read (--hostfile <(scontrol show hostnames)), within the size bound.
  int fds[2];
  REQUIRE(::pipe(fds) == 0);
  const std::string text = "p0\np1:2\n";
  REQUIRE(::write(fds[1], text.data(), text.size()) == static_cast<ssize_t>(text.size()));
  ::close(fds[1]);
  CHECK(load_hostfile("/proc/self/fd/" + std::to_string(fds[0])) == std::vector<HostEntry>{host("p0"), host("p1", 2)});
  ::close(fds[0]);
  // Over 64 MiB: named with the bound (a sparse file, nothing written).
  const std::string big = dir + "/big";
  { std::ofstream(big) << "h0\n"; }
  REQUIRE(::truncate(big.c_str(), (64LL << 20) + 1) == 0);
  CHECK_THROWS_WITH(load_hostfile(big), Contains("--hostfile " + big + ": is larger than 64 MiB"));
  std::remove(big.c_str());
  ::rmdir(dir.c_str());
}

TEST_CASE("a UTF-8 byte order mark at the start of a hostfile is not part of the first host") {
  CHECK(parse_hostfile_text("\xEF\xBB\xBFnode1 slots=2\nnode2\n", "hf") ==
        std::vector<HostEntry>{host("node1", 2), host("node2")});
  CHECK(parse_hostfile_text("\xEF\xBB\xBF# hosts\r\nnode1\r\n", "hf") == std::vector<HostEntry>{host("node1")});
  // Only at the very start.
  CHECK_THROWS_WITH(parse_hostfile_text("node1\n\xEF\xBB\xBFnode2\n", "hf"), Contains("hf:2"));
}

TEST_CASE("--hosts list") {
  CHECK(parse_hosts_list("h1,h2:4,user@h3", "--hosts") ==
        std::vector<HostEntry>{host("h1"), host("h2", 4), host("h3", -1, "user")});
  CHECK(parse_hosts_list(" a , b:2 ", "--hosts") == std::vector<HostEntry>{host("a"), host("b", 2)});
  CHECK(parse_hosts_list("[::1]:2,u@[fe80::3]", "--hosts") ==
        std::vector<HostEntry>{host("::1", 2), host("fe80::3", -1, "u")});
  CHECK_THROWS_WITH(parse_hosts_list("", "--hosts"), Contains("--hosts: no hosts given"));
  CHECK_THROWS_WITH(parse_hosts_list("a,,b", "--hosts"), Contains("empty host name"));
  CHECK_THROWS_WITH(parse_hosts_list("a,b,a:2", "--hosts"), Contains("'a' is listed twice"));
  CHECK_THROWS_WITH(parse_hosts_list("a:0", "--hosts"), Contains("--hosts") && Contains("slot count '0'"));
  CHECK_THROWS_WITH(parse_hosts_list("a slots=2", "--hosts"), Contains("'a slots=2' is not a host"));
  // Its accepted forms are those of --hosts, not of a hostfile line.
  try {
    parse_hosts_list("h1 slots=2", "--hosts");
    FAIL("no throw");
  } catch (const UsageError& e) {
    CHECK_THAT(e.hint(), !Contains("host slots=SLOTS") && Contains("host:SLOTS") && Contains("here write host:N"));
  }
  CHECK_THROWS_WITH(parse_hosts_list("-oX=y", "--hosts"), Contains("is not a host"));
  CHECK_THROWS_WITH(parse_hosts_list("-evil", "--hosts"), Contains("not a valid host name"));
  try {
    parse_hosts_list("a:x", "--hosts");
    FAIL("no throw");
  } catch (const UsageError& e) {
    CHECK_THAT(e.hint(), Contains("h1,h2:4,user@h3"));
  }
}

TEST_CASE("include/exclude strings (DeepSpeed syntax)") {
  using Spec = std::map<std::string, std::optional<std::vector<int>>>;
  CHECK(parse_include_exclude("worker-0:0,2@worker-1", "--include") ==
        Spec{{"worker-0", std::vector<int>{0, 2}}, {"worker-1", std::nullopt}});
  CHECK(parse_include_exclude("a", "--include") == Spec{{"a", std::nullopt}});
  CHECK(parse_include_exclude("a:3,1", "--include") == Spec{{"a", std::vector<int>{3, 1}}});
  // Named twice: union of slots; a bare name means the whole host.
  CHECK(parse_include_exclude("a:0@a:1,0", "--exclude") == Spec{{"a", std::vector<int>{0, 1}}});
  CHECK(parse_include_exclude("a:0@a", "--exclude") == Spec{{"a", std::nullopt}});
  CHECK(parse_include_exclude("a@a:1", "--exclude") == Spec{{"a", std::nullopt}});
  CHECK(parse_include_exclude("[fe80::1]:1@b", "--include") ==
        Spec{{"fe80::1", std::vector<int>{1}}, {"b", std::nullopt}});
  CHECK_THROWS_WITH(parse_include_exclude("", "--include"), Contains("--include=: empty"));
  CHECK_THROWS_WITH(parse_include_exclude("a@@b", "--include"), Contains("empty node spec"));
  CHECK_THROWS_WITH(parse_include_exclude("a@", "--include"), Contains("empty node spec"));
  CHECK_THROWS_WITH(parse_include_exclude(":1", "--include"), Contains("empty host name"));
  CHECK_THROWS_WITH(parse_include_exclude("a:", "--exclude"), Contains("--exclude=a:") && Contains("not a slot index"));
  CHECK_THROWS_WITH(parse_include_exclude("a:1,,2", "--include"), Contains("not a slot index"));
  CHECK_THROWS_WITH(parse_include_exclude("a:-1", "--include"), Contains("'-1' is not a slot index"));
  CHECK_THROWS_WITH(parse_include_exclude("a:x", "--include"), Contains("'x' is not a slot index"));
  CHECK_THROWS_WITH(parse_include_exclude("a:1:2", "--include"), Contains("'1:2' is not a slot index"));
  CHECK_THROWS_WITH(parse_include_exclude("[fe80::1", "--include"), Contains("without ']'"));
  // A bare IPv6 address names the whole host, as in a hostfile; where its last group could be a
  // slot index of the address before it, brackets are required.
  CHECK(parse_include_exclude("fd00::5", "--include") == Spec{{"fd00::5", std::nullopt}});
  CHECK(parse_include_exclude("2001:db8::1@b", "--include") ==
        Spec{{"2001:db8::1", std::nullopt}, {"b", std::nullopt}});
  CHECK_THROWS_WITH(parse_include_exclude("fd00::5:1", "--include"),
                    Contains("ambiguous") && Contains("[fd00::5]:1") && Contains("[fd00::5:1]"));
  CHECK_THROWS_WITH(parse_include_exclude("fd00::5:0,1", "--include"), Contains("[fd00::5]:0,1"));
  CHECK_THROWS_WITH(parse_include_exclude("fd00::5:x", "--include"), Contains("not a host name or IPv6 address"));
  // Names that differ only in letter case are one host (merged, first spelling kept).
  CHECK(parse_include_exclude("Node1:0@node1:1", "--include") == Spec{{"Node1", std::vector<int>{0, 1}}});
  CHECK(parse_include_exclude("Node1:0@node1", "--include") == Spec{{"Node1", std::nullopt}});
  try {
    parse_include_exclude("a:x", "--include");
    FAIL("no throw");
  } catch (const UsageError& e) {
    CHECK_THAT(e.hint(), Contains("worker-0:0,2@worker-1") && Contains("[fd00::5]:0,1"));
  }
}

TEST_CASE("DeepSpeed's documented examples") {
  // From the docstring of parse_resource_filter (deepspeed/launcher/runner.py) and the
  // "Resource Configuration (multi-node)" page: a hostfile of worker-0..2 with 4 slots each.
  const auto pool = parse_hostfile_text("worker-0 slots=4\nworker-1 slots=4\nworker-2 slots=4\n", "hostfile");
  // include_str="worker-0@worker-1:0,2": all slots of worker-0, slots [0, 2] on worker-1.
  CHECK(select_hosts(pool, "worker-0@worker-1:0,2", "", {}, {}, {}) ==
        std::vector<HostEntry>{host("worker-0", 4), with_slots(host("worker-1", 4), {0, 2})});
  // exclude_str="worker-1:0": everything except slot 0 on worker-1.
  CHECK(select_hosts(pool, "", "worker-1:0", {}, {}, {}) ==
        std::vector<HostEntry>{host("worker-0", 4), with_slots(host("worker-1", 4), {1, 2, 3}), host("worker-2", 4)});
  // deepspeed --include="worker-2:0,1": only GPUs 0 and 1 of worker-2.
  CHECK(select_hosts(pool, "worker-2:0,1", "", {}, {}, {}) ==
        std::vector<HostEntry>{with_slots(host("worker-2", 4), {0, 1})});
  // deepspeed --exclude="worker-2:0@worker-0:0,1".
  CHECK(select_hosts(pool, "", "worker-2:0@worker-0:0,1", {}, {}, {}) ==
        std::vector<HostEntry>{with_slots(host("worker-0", 4), {2, 3}), host("worker-1", 4),
                               with_slots(host("worker-2", 4), {1, 2, 3})});
  // deepspeed --num_nodes=2 / --num_gpus=1 (runner.py main()).
  CHECK(names(select_hosts(pool, "", "", 2, {}, {})) == std::vector<std::string>{"worker-0", "worker-1"});
  CHECK(select_hosts(pool, "", "", 1, 1, {}) == std::vector<HostEntry>{with_slots(host("worker-0", 4), {0})});
  // Per-host process counts that follow from the selections.
  CHECK(resolve_nproc(select_hosts(pool, "", "worker-1:0", {}, {}, {}), {}) == std::vector<int>{4, 3, 4});
}

TEST_CASE("select_hosts: include/exclude semantics") {
  const std::vector<HostEntry> pool = {host("a", 4), host("b", 2), host("c", -1, "u")};
  // No filter: unchanged.
  CHECK(select_hosts(pool, "", "", {}, {}, {}) == pool);
  // include keeps the pool order, not the order of the include string.
  CHECK(names(select_hosts(pool, "c@a", "", {}, {}, {})) == std::vector<std::string>{"a", "c"});
  // include slot order as given, duplicates dropped (DeepSpeed's _stable_remove_duplicates).
  CHECK(select_hosts(pool, "a:3,1,3", "", {}, {}, {}).at(0).slot_indices == std::vector<int>{3, 1});
  // exclude of a whole host.
  CHECK(names(select_hosts(pool, "", "b", {}, {}, {})) == std::vector<std::string>{"a", "c"});
  // exclude of every slot drops the host.
  CHECK(names(select_hosts(pool, "", "b:0,1", {}, {}, {})) == std::vector<std::string>{"a", "c"});
  // A host without slots: indices are checked against --nproc-per-node (default_slots).
  CHECK(select_hosts(pool, "", "c:1", {}, {}, 3).at(2) == with_slots(host("c", -1, "u"), {0, 2}));
  CHECK(select_hosts(pool, "c:2", "", {}, {}, 3) == std::vector<HostEntry>{with_slots(host("c", -1, "u"), {2})});
  // The user is kept.
  CHECK(select_hosts(pool, "c", "", {}, {}, {}).at(0).destination() == "u@c");
}

TEST_CASE("select_hosts: --include/--exclude compare host names without letter case") {
  const auto pool = parse_hostfile_text("Node1 slots=2\nnode2 slots=2\n[FD00::5]:4\n", "hf");
  // The host list's spelling is kept (an ssh config alias may care).
  CHECK(select_hosts(pool, "node1", "", {}, {}, {}) == std::vector<HostEntry>{host("Node1", 2)});
  CHECK(select_hosts(pool, "NODE2:1", "", {}, {}, {}) == std::vector<HostEntry>{with_slots(host("node2", 2), {1})});
  CHECK(names(select_hosts(pool, "", "NODE1@fd00::5", {}, {}, {})) == std::vector<std::string>{"node2"});
  CHECK(select_hosts(pool, "", "node1:0", {}, {}, {}).at(0) == with_slots(host("Node1", 2), {1}));
  CHECK(select_hosts(pool, "[fd00::5]:3", "", {}, {}, {}) ==
        std::vector<HostEntry>{with_slots(host("FD00::5", 4), {3})});
}

TEST_CASE("select_hosts: errors") {
  const std::vector<HostEntry> pool = {host("a", 4), host("b", 2), host("c")};
  CHECK_THROWS_WITH(select_hosts(pool, "a", "b", {}, {}, {}),
                    Contains("--include and --exclude") && Contains("mutually exclusive"));
  CHECK_THROWS_WITH(select_hosts(pool, "zzz", "", {}, {}, {}),
                    Contains("--include=zzz: host 'zzz' is not in the host list") && Contains("a, b, c"));
  CHECK_THROWS_WITH(select_hosts(pool, "", "a@zzz:1", {}, {}, {}), Contains("--exclude=a@zzz:1") && Contains("'zzz'"));
  CHECK_THROWS_WITH(select_hosts(pool, "b:2", "", {}, {}, {}), Contains("host 'b' has no slot 2") && Contains("0..1"));
  CHECK_THROWS_WITH(select_hosts(pool, "", "a:4", {}, {}, {}), Contains("no slot 4"));
  CHECK_THROWS_WITH(select_hosts(pool, "", "c:0", {}, {}, {}),
                    Contains("'c' has no slot count") && Contains("--nproc-per-node"));
  CHECK_THROWS_WITH(select_hosts(pool, "", "c:3", {}, {}, 2), Contains("'c' has no slot 3"));
  CHECK_THROWS_WITH(select_hosts(pool, "", "a@b@c", {}, {}, {}), Contains("leaves no host"));
  CHECK_THROWS_WITH(select_hosts(pool, "a", "", 1, {}, {}), Contains("cannot be combined"));
  CHECK_THROWS_WITH(select_hosts(pool, "", "a", {}, 1, {}), Contains("cannot be combined"));
  CHECK_THROWS_WITH(select_hosts(pool, "", "", 4, {}, {}), Contains("--num-nodes=4: only 3 host(s)"));
  CHECK_THROWS_WITH(select_hosts(pool, "", "", 0, {}, {}), Contains("--num-nodes=0"));
  CHECK_THROWS_WITH(select_hosts(pool, "", "", {}, 0, {}), Contains("--num-gpus=0"));
  CHECK_THROWS_WITH(select_hosts(pool, "", "", {}, 3, {}), Contains("--num-gpus=3: host 'b' has only 2"));
  CHECK_THROWS_WITH(select_hosts({}, "", "", {}, {}, {}), Contains("no hosts"));
}

TEST_CASE("select_hosts: num_nodes and num_gpus") {
  const std::vector<HostEntry> pool = {host("a", 4), host("b", 2), host("c")};
  CHECK(names(select_hosts(pool, "", "", 3, {}, {})) == std::vector<std::string>{"a", "b", "c"});
  CHECK(names(select_hosts(pool, "", "", 1, {}, {})) == std::vector<std::string>{"a"});
  const auto two = select_hosts(pool, "", "", {}, 2, {});
  CHECK(two == std::vector<HostEntry>{with_slots(host("a", 4), {0, 1}), with_slots(host("b", 2), {0, 1}),
                                      with_slots(host("c"), {0, 1})});
  CHECK(resolve_nproc(two, 8) == std::vector<int>{2, 2, 2});
}

TEST_CASE("resolve_nproc: slot indices, then --nproc-per-node, then slots, then 1") {
  const std::vector<HostEntry> hosts = {with_slots(host("a", 8), {1, 5, 7}), host("b", 4), host("c"), host("d", 2)};
  CHECK(resolve_nproc(hosts, {}) == std::vector<int>{3, 4, 1, 2});
  CHECK(resolve_nproc(hosts, 6) == std::vector<int>{3, 6, 6, 6});
  CHECK(resolve_nproc({}, 2).empty());
}
