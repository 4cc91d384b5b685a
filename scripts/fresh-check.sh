#!/usr/bin/env bash
# Runs the README's commands as a new user would: in a pristine Debian 12
# (bookworm, amd64, `debootstrap --variant=minbase`) root that has nothing
# installed but the base system, on a clone of the current commit. Packages
# installed by hand on this machine cannot hide a missing install step there.
#
#   scripts/fresh-check.sh                  both README commands: scripts/run.sh,
#                                           then scripts/test.sh
#   scripts/fresh-check.sh --build          only install + configure + build of
#                                           the daemons and the CLI
#                                           (scripts/run.sh --build-only; what
#                                           .ci/run checks first)
#   scripts/fresh-check.sh --cmd 'CMD'      any command, run in the clone
#   scripts/fresh-check.sh --drop-package P removes P from install-deps.sh in the
#                                           clone first: the check must then
#                                           fail, naming P (proves the guard)
#   --rev REV                               check REV instead of HEAD (e.g. an
#                                           old commit, to see a failure again)
#   --keep                                  leave the root for inspection
#
# Needs root (debootstrap, chroot, mounts) and Debian's mirror (the one this
# machine's apt sources name). The pristine root is made once and cached as a
# tarball in $KVF_FRESH_CACHE (default /var/tmp/kvfence-fresh); it is made
# again when the tarball is missing. Each run unpacks it into a new directory,
# mounts /proc, /sys and /dev there and unmounts them on every exit path.
# Exit status: the command's.
set -euo pipefail
cd "$(dirname "$0")/.."
src=$PWD

mode=full
cmd=""
drop=""
keep=0
rev=HEAD
while [ $# -gt 0 ]; do
    case "$1" in
        --build) mode=build; shift ;;
        --cmd) mode=cmd; cmd=$2; shift 2 ;;
        --drop-package) drop=$2; shift 2 ;;
        --rev) rev=$2; shift 2 ;;
        --keep) keep=1; shift ;;
        -h | --help) sed -n '2,27p' "$0"; exit 0 ;;
        *) echo "fresh-check: unknown option '$1'" >&2; exit 2 ;;
    esac
done
case "$mode" in
    full) cmd="bash scripts/run.sh && bash scripts/test.sh" ;;
    build) cmd="bash scripts/run.sh --build-only" ;;
esac

[ "$(id -u)" -eq 0 ] || { echo "fresh-check: needs root (debootstrap, chroot, mount)" >&2; exit 2; }
[ "$(dpkg --print-architecture)" = amd64 ] || { echo "fresh-check: amd64 only" >&2; exit 2; }

log() { echo "fresh-check: $*" >&2; }

# The Debian mirror this machine's apt uses (deb822 sources first, then the
# one-line format), so the root is built from the same place as the machine.
debian_mirror() {
    local m=""
    if [ -f /etc/apt/sources.list.d/debian.sources ]; then
        m=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources)
    fi
    if [ -z "$m" ] && [ -f /etc/apt/sources.list ]; then
        m=$(awk '$1 == "deb" && $3 ~ /^bookworm$/ {print $2; exit}' /etc/apt/sources.list)
    fi
    echo "${m:-http://deb.debian.org/debian}"
}

cache=${KVF_FRESH_CACHE:-/var/tmp/kvfence-fresh}
tarball=$cache/bookworm-minbase-amd64.tar.gz
mkdir -p "$cache"
if [ ! -s "$tarball" ]; then
    if ! command -v debootstrap >/dev/null; then
        log "installing debootstrap"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        apt-get install -y -qq debootstrap >/dev/null
    fi
    mirror=$(debian_mirror)
    log "making the pristine root from $mirror (once; cached in $tarball)"
    staging=$(mktemp -d "$cache/pristine.XXXXXX")
    if ! debootstrap --variant=minbase --arch=amd64 bookworm "$staging" "$mirror" \
        >"$cache/debootstrap.log" 2>&1; then
        log "debootstrap failed; see $cache/debootstrap.log"
        rm -rf --one-file-system "$staging"
        exit 1
    fi
    tar czf "$tarball.tmp" -C "$staging" . && mv "$tarball.tmp" "$tarball"
    rm -rf --one-file-system "$staging"
fi

root=$(mktemp -d "$cache/run.XXXXXX")
mounted=()
cleanup() {
    local i
    for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do
        umount -R "${mounted[i]}" 2>/dev/null || umount -R -l "${mounted[i]}" 2>/dev/null || true
    done
    # Never delete through a mount that is still there: a bind of the host's
    # /dev would be deleted with it.
    if grep -q " $root/" /proc/mounts; then
        log "mounts left under $root; not removing it"
    elif [ "$keep" = 1 ]; then
        log "root left in $root"
    else
        rm -rf --one-file-system "$root"
    fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

tar xzf "$tarball" -C "$root"
cp /etc/resolv.conf "$root/etc/resolv.conf" 2>/dev/null || true
# The package registries of these machines are reached through extra CA
# certificates; a fresh machine here has them too. apt uses Debian's mirror
# over plain HTTP (signed), npm needs the CAs.
mkdir -p "$root/usr/local/share/ca-certificates"
extra_ca=/etc/kvfence-extra-ca.pem
: >"$root$extra_ca"
for crt in /usr/local/share/ca-certificates/*.crt; do
    [ -f "$crt" ] || continue
    cp "$crt" "$root/usr/local/share/ca-certificates/"
    cat "$crt" >>"$root$extra_ca"
done

# The current commit, as CI sees it: committed work only.
head=$(git rev-parse --verify "$rev^{commit}")
[ "$rev" != HEAD ] || [ -z "$(git status --porcelain --untracked-files=no)" ] ||
    log "uncommitted changes are not part of the check (commit $head is)"
git clone -q --no-local "$src" "$root/src"
git -C "$root/src" checkout -q "$head"
if [ -n "$drop" ]; then
    grep -qw -- "$drop" "$root/src/scripts/install-deps.sh" ||
        { log "'$drop' is not in scripts/install-deps.sh"; exit 2; }
    sed -i -E "s/(^|[[:space:]])$drop([[:space:]]|$)/\1\2/" "$root/src/scripts/install-deps.sh"
    log "dropped '$drop' from install-deps.sh in the clone"
fi

mount -t proc proc "$root/proc" && mounted+=("$root/proc")
mount --rbind /sys "$root/sys" && mounted+=("$root/sys")
mount --make-rslave "$root/sys"
mount --rbind /dev "$root/dev" && mounted+=("$root/dev")
mount --make-rslave "$root/dev"

log "running in $root at $head: $cmd"
rc=0
chroot "$root" /usr/bin/env -i HOME=/root TERM=dumb CI=true LANG=C.UTF-8 \
    PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    NODE_EXTRA_CA_CERTS=$extra_ca \
    /bin/bash -c "cd /src && $cmd" || rc=$?
log "exit $rc"
exit $rc
