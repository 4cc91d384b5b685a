#!/usr/bin/env bash
# deb_fresh_root.sh DEB: installs the kvfence .deb with apt in a pristine
# Debian 12 root (debootstrap --variant=minbase: nothing but the base system)
# and runs what it installed there: kvfence-control serves on loopback,
# kvfence-node attaches to it, the CLI lists the node, the Python package
# pings the control plane. apt pulls the package's Depends from the mirror, so
# a dependency the package forgot fails here.
#
#   sudo tests/install/deb_fresh_root.sh build-nocuda/kvfence_0.1.0_amd64.deb
#
# Build the .deb without CUDA (deploy/README.md, "Packages"):
#   cmake -S . -B build-nocuda -DKVF_WITH_CUDA=OFF -DCMAKE_INSTALL_PREFIX=/usr
#   cmake --build build-nocuda && (cd build-nocuda && cpack -G DEB)
# Needs root (debootstrap, chroot, mounts) and the Debian mirror; not a ctest.
# The pristine root is the one scripts/fresh-check.sh makes and caches
# ($KVF_FRESH_CACHE, default /var/tmp/kvfence-fresh), made here the same way
# when missing. Exit status 0 when everything ran.
set -euo pipefail
deb=$(readlink -f "${1:?usage: deb_fresh_root.sh KVFENCE.deb}")
[ -f "$deb" ] || { echo "deb_fresh_root: no $deb" >&2; exit 2; }
[ "$(id -u)" -eq 0 ] || { echo "deb_fresh_root: needs root (chroot, mounts)" >&2; exit 2; }
log() { echo "deb_fresh_root: $*" >&2; }

cache=${KVF_FRESH_CACHE:-/var/tmp/kvfence-fresh}
tarball=$cache/bookworm-minbase-amd64.tar.gz
mkdir -p "$cache"
if [ ! -s "$tarball" ]; then
    mirror=http://deb.debian.org/debian
    [ -f /etc/apt/sources.list.d/debian.sources ] &&
        mirror=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources)
    log "making the pristine root from $mirror (cached in $tarball)"
    staging=$(mktemp -d "$cache/pristine.XXXXXX")
    debootstrap --variant=minbase --arch=amd64 bookworm "$staging" "$mirror" >"$cache/debootstrap.log" 2>&1 ||
        { log "debootstrap failed: $cache/debootstrap.log"; rm -rf --one-file-system "$staging"; exit 1; }
    tar czf "$tarball.tmp" -C "$staging" . && mv "$tarball.tmp" "$tarball"
    rm -rf --one-file-system "$staging"
fi

root=$(mktemp -d "$cache/deb.XXXXXX")
mounted=()
cleanup() {
    local i
    for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do
        umount -R "${mounted[i]}" 2>/dev/null || umount -R -l "${mounted[i]}" 2>/dev/null || true
    done
    if grep -q " $root/" /proc/mounts; then log "mounts left under $root; not removing it"
    else rm -rf --one-file-system "$root"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM
tar xzf "$tarball" -C "$root"
cp /etc/resolv.conf "$root/etc/resolv.conf" 2>/dev/null || true
mount -t proc proc "$root/proc" && mounted+=("$root/proc")
mount --rbind /dev "$root/dev" && mounted+=("$root/dev")
mount --make-rslave "$root/dev"
cp "$deb" "$root/tmp/kvfence.deb"

cat >"$root/tmp/check.sh" <<'EOF'
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
start=$(date +%s)
apt-get install -y -qq --no-install-recommends /tmp/kvfence.deb >/tmp/apt.log 2>&1 || { cat /tmp/apt.log; exit 1; }
echo "apt-get install ./kvfence.deb: $(grep -c '^Setting up' /tmp/apt.log) packages set up in $(( $(date +%s) - start ))s"
dpkg -s kvfence | sed -n 's/^\(Status\|Version\): /  \1: /p'
command -v kvfence-control kvfence-node kvfence
d=$(mktemp -d)
kvfence-control --listen 127.0.0.1:0 --port-file "$d/port" --metrics-listen "" --data-dir "$d/data" >"$d/control.log" 2>&1 &
cpid=$!
for _ in $(seq 100); do [ -s "$d/port" ] && break; sleep 0.1; done
[ -s "$d/port" ] || { cat "$d/control.log"; exit 1; }
addr=127.0.0.1:$(cat "$d/port")
kvfence-node --control "$addr" --node-id fresh1 --local-socket "$d/node.sock" --run-dir "$d" --rdma off \
    >"$d/node.log" 2>&1 &
npid=$!
ok=0
for _ in $(seq 100); do
    if kvfence --server "$addr" nodes 2>/dev/null | grep -q '^fresh1 .*ATTACHED'; then ok=1; break; fi
    sleep 0.1
done
[ "$ok" = 1 ] || { cat "$d/node.log"; exit 1; }
kvfence --server "$addr" nodes
kvfence --server "$addr" stats | grep '^nodes\.\|^uptime_ms'
python3 -c "
import kvfence
with kvfence.AdminClient('$addr') as a:
    a.ping(timeout=5)
print('python3: kvfence', kvfence.__version__, 'from', kvfence.__file__)
"
kill "$npid" "$cpid"
wait "$npid" "$cpid" || true
echo "deb_fresh_root: OK"
EOF
log "installing $(basename "$deb") in a pristine bookworm root ($root)"
chroot "$root" /usr/bin/env -i HOME=/root LANG=C.UTF-8 PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    /bin/bash /tmp/check.sh
