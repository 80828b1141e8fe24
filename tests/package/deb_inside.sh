#!/bin/bash
# Runs inside the fresh bookworm root (chroot) that tests/package/deb_test.sh prepared, with the
# .deb and the worker-library consumer in /root/t. Fails with "FAIL: ..." naming the step.
#   deb_inside.sh            install with apt, then use what was installed
#   deb_inside.sh lifecycle  (after the first) an admin's life with the package: enable the
#                            unit, upgrade over an older build, remove, purge; what the maintainer
#                            scripts ask of systemd and what is left after each step
set -euo pipefail
fail() { echo "FAIL: $*"; exit 1; }
cd /root/t
deb=$(ls ddprun_*.deb)
if [[ "${1:-}" == lifecycle ]]; then
  exec bash /root/t/lifecycle.sh "$deb"
fi

# The base root has none of ddprun's libraries: Depends must bring them.
# (The cache is read once into a variable: `ldconfig -p | grep -q` under pipefail fails at random
# when grep exits at the first match and ldconfig dies of SIGPIPE.)
cache=$(ldconfig -p)
for lib in libspdlog libfmt libboost_filesystem; do
  if grep -q "$lib" <<<"$cache"; then fail "the base root already has $lib; the Depends check would prove nothing"; fi
done
t0=$(date +%s)
export DEBIAN_FRONTEND=noninteractive
if ! apt-get install -y -q --no-install-recommends "./$deb" >apt.log 2>&1; then
  # Package lists older than the mirror: refresh once.
  apt-get update -q >>apt.log 2>&1 && apt-get install -y -q --no-install-recommends "./$deb" >>apt.log 2>&1 \
    || { cat apt.log; fail "apt-get install ./$deb"; }
fi
pulled=$(grep -oE '^Setting up [^ ]+' apt.log | cut -d' ' -f3 | tr '\n' ' ')
echo "ok: apt-get install ./$deb in $(( $(date +%s) - t0 )) s; set up: $pulled"
cache=$(ldconfig -p)
for lib in libspdlog libfmt; do
  grep -q "$lib" <<<"$cache" || fail "$lib is still missing after installing the .deb (Depends incomplete?)"
done
# OpenSSL is loaded on first use (dlopen), which dpkg-shlibdeps cannot see: Depends names it
# (the base root may have it already, so the field itself is checked).
depends=$(dpkg-query -W -f='${Depends}' ddprun)
grep -q "libssl3" <<<"$depends" || fail "Depends lacks libssl3 (bin/ddprun loads it on first use): $depends"
grep -q "libssl.so.3" <<<"$cache" || fail "libssl.so.3 is missing after installing the .deb"

# The files, in one place (man pages and completions join this list when they are generated).
files=$(dpkg -L ddprun)
multiarch=$(dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null || echo "$(uname -m)-linux-gnu")
expect_files=(
  '^/usr/bin/ddprun$' '^/usr/bin/ddprun-rdzvd$' '^/usr/bin/ddprun-nccl-id$' '^/usr/libexec/ddprun/ddprun-watchdog$'
  # Debian's multiarch directory (lintian: pkg-config-unavailable-for-cross-compilation otherwise).
  "^/usr/lib/$multiarch/libddprun_worker\\.so\\.0\$" "^/usr/lib/$multiarch/libddprun_worker\\.so\$"
  '^/usr/include/ddprun/worker\.hpp$' '^/usr/include/ddprun/worker\.h$'
  "^/usr/lib/$multiarch/cmake/ddprun/ddprunConfig\\.cmake\$" "^/usr/lib/$multiarch/pkgconfig/ddprun-worker\\.pc\$"
  '^/usr/lib/systemd/system/ddprun-rdzvd\.service$'
  '^/usr/share/doc/ddprun/changelog\.gz$' '^/usr/share/doc/ddprun/README\.md$' '^/usr/share/doc/ddprun/install\.md$' '^/usr/share/doc/ddprun/daemon\.md$'
  '^/usr/share/ddprun/examples/ddp_train\.py$'
  '^/usr/share/man/man1/ddprun\.1\.gz$' '^/usr/share/man/man8/ddprun-rdzvd\.8\.gz$'
  '^/usr/share/man/man1/ddprun-nccl-id\.1\.gz$'
  '^/usr/share/bash-completion/completions/ddprun$' '^/usr/share/bash-completion/completions/ddprun-rdzvd$'
  # Debian's zsh looks in vendor-completions, not /usr/share/zsh/site-functions.
  '^/usr/share/zsh/vendor-completions/_ddprun$' '^/usr/share/zsh/vendor-completions/_ddprun-rdzvd$'
  '^/usr/share/lintian/overrides/ddprun$'
)
for re in "${expect_files[@]}"; do
  grep -qE "$re" <<<"$files" || fail "the package has no file matching $re"
done
grep -q '^ExecStart=/usr/bin/ddprun-rdzvd ' /usr/lib/systemd/system/ddprun-rdzvd.service || fail "unit ExecStart"
bad=$(grep -E '^/usr/share/zsh/site-functions/|^/usr/share/man/man[0-9]/.*\.[0-9]$|^/usr/bin/ddprun-watchdog$' <<<"$files" || true)
[[ -z "$bad" ]] || fail "files where Debian does not look for them (zsh site-functions, uncompressed man pages) or should not (the watchdog is no command): $bad"
gzip -t /usr/share/man/man1/ddprun.1.gz /usr/share/man/man8/ddprun-rdzvd.8.gz /usr/share/man/man1/ddprun-nccl-id.1.gz \
  || fail "a man page is not valid gzip"
# The changelog's latest entry (its first line) is this package's version.
clv=$(zcat /usr/share/doc/ddprun/changelog.gz | head -1 | sed -E 's/^ddprun \(([^)]*)\).*/\1/')
[[ "$clv" == "$(dpkg-query -W -f='${Version}' ddprun)" ]] || fail "changelog.gz names version '$clv'"
echo "ok: $(wc -l <<<"$files") paths in the package, all ${#expect_files[@]} expected ones present"

v=$(ddprun --version) || fail "ddprun --version"
[[ "$v" == *"$(dpkg-query -W -f='${Version}' ddprun)"* ]] || fail "ddprun --version printed '$v'"
ddprun-rdzvd --version >/dev/null || fail "ddprun-rdzvd --version"
echo "ok: $v"

cat >/root/t/worker.sh <<'W'
#!/bin/sh
echo "worker rank=$RANK world=$WORLD_SIZE local=$LOCAL_RANK"
W
chmod +x /root/t/worker.sh
out=$(timeout 60 ddprun --master-port 0 --nproc-per-node 2 /root/t/worker.sh 2>&1) || { echo "$out"; fail "2-rank shell job"; }
for r in 0 1; do grep -q "worker rank=$r world=2 local=$r" <<<"$out" || { echo "$out"; fail "rank $r missing"; }; done
echo "ok: ddprun --nproc-per-node 2 with a shell worker"
# The agent's containment watchdog is the package's /usr/libexec/ddprun/ddprun-watchdog (else the
# agent would fork one).
out=$(bash "$(dirname "$0")/job_watchdog.sh" 2>&1) || { echo "$out"; fail "watchdog job"; }
grep -qx "/usr/libexec/ddprun/ddprun-watchdog" <<<"$out" \
  || { echo "$out"; fail "the agent's watchdog is not /usr/libexec/ddprun/ddprun-watchdog"; }
echo "ok: the agent's watchdog is /usr/libexec/ddprun/ddprun-watchdog"

# The daemon as the unit runs it: token from a 0600 file, JSON logs.
install -d -m 0700 /etc/ddprun
token=deb-test-$RANDOM$RANDOM
(umask 077; echo "$token" >/etc/ddprun/rdzvd.token)
mkfifo /tmp/rdzvd.out
ddprun-rdzvd --host 127.0.0.1 --port 0 --token-file /etc/ddprun/rdzvd.token --log-format json \
  >/tmp/rdzvd.out 2>/tmp/rdzvd.err &
dpid=$!
exec 3</tmp/rdzvd.out
read -r -t 30 line <&3 || { cat /tmp/rdzvd.err; fail "ddprun-rdzvd printed no 'listening on' line within 30 s"; }
port=${line##*:}
[[ "$line" == "listening on 127.0.0.1:$port" ]] || fail "unexpected first line '$line'"
DDPRUN_RDZV_TOKEN=$token timeout 30 ddprun status --rdzv-endpoint "127.0.0.1:$port" >status.out 2>&1 || { cat status.out; fail "ddprun status"; }
out=$(DDPRUN_RDZV_TOKEN=$token timeout 120 ddprun --master-port 0 --nnodes 1 --nproc-per-node 2 --rdzv-backend c10d \
        --rdzv-endpoint "127.0.0.1:$port" --rdzv-id debjob /root/t/worker.sh 2>&1) || { echo "$out"; fail "job via the daemon"; }
grep -q "worker rank=1 world=2" <<<"$out" || { echo "$out"; fail "job via the daemon: rank 1 missing"; }
if out=$(DDPRUN_RDZV_TOKEN=wrong timeout 120 ddprun --master-port 0 --nnodes 1 --nproc-per-node 1 --rdzv-backend c10d \
           --rdzv-endpoint "127.0.0.1:$port" --rdzv-id debjob2 /root/t/worker.sh 2>&1); then
  fail "a job with the wrong token ran"
fi
grep -q "authentication failed" <<<"$out" || { echo "$out"; fail "wrong token: no 'authentication failed' error"; }
DDPRUN_RDZV_TOKEN=$token timeout 30 ddprun status --rdzv-endpoint "127.0.0.1:$port" --rdzv-id debjob >status.out 2>&1 \
  || { cat status.out; fail "ddprun status --rdzv-id debjob"; }
grep -q debjob status.out || { cat status.out; fail "status does not show debjob"; }
maps=$(grep -oE '/[^ ]+$' "/proc/$dpid/maps" | sort -u)
bad=$(grep -vE '^/usr/' <<<"$maps" || true)
[[ -z "$bad" ]] || fail "the daemon maps files outside /usr: $bad"
echo "ok: ddprun-rdzvd (token file, JSON logs) answered ddprun status and hosted a job; maps only /usr: $(tr '\n' ' ' <<<"$maps")"
kill -TERM "$dpid"
wait "$dpid" || fail "ddprun-rdzvd exited $? on SIGTERM"
python3 - "$token" /tmp/rdzvd.err <<'P'
import json, sys
token, path = sys.argv[1], sys.argv[2]
lines = open(path, encoding="utf-8").read().splitlines()
assert lines, "no log lines"
for line in lines:
    obj = json.loads(line)
    assert set(obj) == {"time", "level", "logger", "pid", "message"}, obj
    assert obj["logger"] == "ddprun-rdzvd", obj
    assert token not in line, "the token appears in the log"
assert any("--token-file /etc/ddprun/rdzvd.token" in json.loads(l)["message"] for l in lines), lines
print("ok: %d JSON log lines parse, none shows the token" % len(lines))
P

# The worker library from the package: find_package(ddprun) and pkg-config.
cmake -S consumer -B cbuild >cmake.log 2>&1 && cmake --build cbuild >>cmake.log 2>&1 || { cat cmake.log; fail "consumer via find_package(ddprun)"; }
out=$(timeout 60 ddprun --master-port 0 --nproc-per-node 2 cbuild/consumer_cxx 2>&1) || { echo "$out"; fail "native consumer job"; }
for r in 0 1; do grep -q "cxx rank=$r/2 local=$r/2" <<<"$out" || { echo "$out"; fail "consumer_cxx rank $r"; }; done
flags=$(pkg-config --cflags --libs ddprun-worker) || fail "pkg-config ddprun-worker"
cc consumer/consumer.c -o consumer_pc $flags || fail "cc consumer.c $flags"
out=$(timeout 60 ddprun --master-port 0 --nproc-per-node 2 ./consumer_pc 2>&1) || { echo "$out"; fail "pkg-config consumer job"; }
grep -q "c rank=1/2 local=1/2" <<<"$out" || { echo "$out"; fail "consumer_pc rank 1"; }
echo "ok: worker library via find_package(ddprun) and pkg-config ($flags), run as 2-rank native jobs"
