#!/bin/bash
# Runs inside the bookworm root of tests/package/deb_test.sh after deb_inside.sh installed the
# .deb (DEB, in /root/t): an admin's life with the package, with the unit enabled.
#   upgrade: over an older build (this .deb repacked with an older version and none of its
#            maintainer scripts, as builds before them were), then remove, then purge.
# The root has no systemd: /run/systemd/system makes the maintainer scripts believe one runs, and
# a stub systemctl records what they ask of it (deb-systemd-invoke calls systemctl too).
# usage: deb_lifecycle.sh DEB
set -euo pipefail
deb=$1
fail() { echo "FAIL: $*"; exit 1; }
cd /root/t
export DEBIAN_FRONTEND=noninteractive
unit=ddprun-rdzvd.service
wants=/etc/systemd/system/multi-user.target.wants/$unit
log=/root/t/systemctl.log
version=$(dpkg-query -W -f='${Version}' ddprun)

[[ ! -e /usr/bin/systemctl ]] || fail "the root has a systemctl; the stub would replace it"
mkdir -p /run/systemd/system
cat >/usr/bin/systemctl <<'S'
#!/bin/sh
echo "systemctl $*" >>/root/t/systemctl.log
case "$*" in *--version*) echo "systemd 252 (252)";; esac
exit 0
S
chmod 0755 /usr/bin/systemctl
: >"$log"
# What `systemctl enable ddprun-rdzvd` does ([Install] WantedBy=multi-user.target).
mkdir -p "${wants%/*}"
ln -sf /lib/systemd/system/$unit "$wants"

# The older build: same files, older version, no maintainer scripts but ldconfig's.
rm -rf old && dpkg-deb -R "$deb" old
sed -i "s/^Version: .*/Version: 0.0.1~old/" old/DEBIAN/control
rm -f old/DEBIAN/{postinst,prerm,postrm,triggers}
printf '#!/bin/sh\nset -e\n[ "$1" = configure ] && ldconfig\nexit 0\n' >old/DEBIAN/postinst
chmod 0755 old/DEBIAN/postinst
dpkg-deb -b old ddprun-old.deb >/dev/null || fail "repacking the .deb as an older build"
dpkg -i ddprun-old.deb >dpkg.log 2>&1 || { cat dpkg.log; fail "installing the older build (downgrade)"; }
[[ "$(dpkg-query -W -f='${Version}' ddprun)" == 0.0.1~old ]] || fail "the older build is not installed"

# Upgrade over it: systemd reloads the units and a running daemon restarts on the new binary.
: >"$log"
dpkg -i "$deb" >dpkg.log 2>&1 || { cat dpkg.log; fail "upgrading over the older build"; }
[[ "$(dpkg-query -W -f='${Status} ${Version}' ddprun)" == "install ok installed $version" ]] \
  || fail "after the upgrade: $(dpkg-query -W -f='${Status} ${Version}' ddprun)"
grep -q "daemon-reload" "$log" || { cat "$log"; fail "upgrade: no systemctl daemon-reload"; }
grep -qE "try-restart .*$unit" "$log" || { cat "$log"; fail "upgrade: no try-restart of $unit"; }
grep -qE " (stop|start) " "$log" && { cat "$log"; fail "upgrade: stopped or started $unit (try-restart only)"; }
grep -q libddprun_worker <<<"$(ldconfig -p)" || fail "libddprun_worker is not in the linker cache after the upgrade"
[[ -L "$wants" ]] || fail "the upgrade dropped the enable link"
[[ -f /var/lib/systemd/deb-systemd-helper-enabled/$unit.dsh-also ]] || fail "postinst recorded no unit state"
echo "ok: upgrade over an older build (0.0.1~old -> $version): $(tr '\n' ';' <"$log")"

# Remove: the daemon is stopped before its binary goes; the enable link stays (for a reinstall).
: >"$log"
dpkg -r ddprun >dpkg.log 2>&1 || { cat dpkg.log; fail "dpkg -r ddprun"; }
grep -qE "stop .*$unit" "$log" || { cat "$log"; fail "remove: $unit was not stopped"; }
grep -q "daemon-reload" "$log" || { cat "$log"; fail "remove: no systemctl daemon-reload"; }
for f in /usr/bin/ddprun /usr/bin/ddprun-rdzvd /usr/lib/systemd/system/$unit /usr/include/ddprun; do
  [[ ! -e "$f" ]] || fail "remove left $f"
done
if grep -q libddprun_worker <<<"$(ldconfig -p)"; then fail "libddprun_worker is still in the linker cache after remove"; fi
[[ "$(dpkg-query -W -f='${Status}' ddprun)" == "deinstall ok config-files" ]] || fail "after remove: $(dpkg-query -W -f='${Status}' ddprun)"
echo "ok: remove stopped the daemon and took every file: $(tr '\n' ';' <"$log")"

# Purge: nothing of the package stays; the admin's /etc/ddprun (the token) is not the package's.
: >"$log"
dpkg -P ddprun >dpkg.log 2>&1 || { cat dpkg.log; fail "dpkg -P ddprun"; }
[[ ! -L "$wants" ]] || fail "purge left the enable link $wants"
if dpkg-query -W ddprun >/dev/null 2>&1 && [[ -n "$(dpkg-query -W -f='${Status}' ddprun | grep -v not-installed)" ]]; then
  fail "dpkg still knows ddprun after purge: $(dpkg-query -W -f='${Status}' ddprun)"
fi
left=$(find / -xdev \( -path /proc -o -path /root/t -o -path /tmp -o -path /etc/ddprun -o -path /.ddprun-root-complete \) -prune -o \
         \( -iname '*ddprun*' -print \) 2>/dev/null | grep -v '^/var/lib/dpkg/info/ddprun\.' || true)
[[ -z "$left" ]] || fail "purge left: $left"
ls /var/lib/dpkg/info/ddprun.* >/dev/null 2>&1 && fail "purge left dpkg's ddprun.* files"
rm -f /usr/bin/systemctl; rm -rf /run/systemd
echo "ok: purge removed the enable link and the unit state; nothing named *ddprun* is left outside /etc/ddprun"
