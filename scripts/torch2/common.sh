# Shared by scripts/torch2/*: where the torch 2.x root lives and how to enter it.
#
# The root is a Debian trixie tree (debootstrap --variant=minbase) with python3-torch 2.6 and
# nothing mounted in it on the host: every command that needs /proc, /dev, /sys runs in a
# private mount namespace (unshare --mount --propagation private), so the bind mounts live only
# as long as that process and its children, and the tree can always be removed like any
# directory. The root is complete when its marker file exists.
DDPRUN_TORCH2_ROOT=${DDPRUN_TORCH2_ROOT:-/var/cache/ddprun/torch2-trixie}
DDPRUN_TORCH2_MARKER=.ddprun-torch2-ready
DDPRUN_TORCH2_MIRROR=${DDPRUN_TORCH2_MIRROR:-http://deb.debian.org/debian}

torch2_ready() { [[ -f "$DDPRUN_TORCH2_ROOT/$DDPRUN_TORCH2_MARKER" ]]; }
