#!/usr/bin/env bash
# Build a local Vagrant box (libvirt provider) from Debian's archive, with everything the
# test suite needs preinstalled: the test VMs have no network.
#
#   sudo vagrant/build-box.sh debian12      Debian 12 bookworm, kernel 6.1
#   sudo vagrant/build-box.sh debian13      Debian 13 trixie, kernel 6.12
#   sudo vagrant/build-box.sh --print-path debian12   only print where the cached box would be
#
# Prints the path of the built box (a .box file) on stdout; progress goes to stderr.
# Boxes are cached in $PYMTRACE_VM_CACHE (default /var/cache/pymtrace-vm, root-owned, 0700)
# under a key hashed from this script, the Debian package list (install.sh's
# distro_packages) and the project's Python requirements, so re-runs reuse them.
# Environment:
#   PYMTRACE_VM_CACHE       cache directory
#   PYMTRACE_DEBIAN_MIRROR  Debian mirror (default http://deb.debian.org/debian)
#   PYMTRACE_DEBIAN_SECURITY  security mirror (default http://deb.debian.org/debian-security)
#   PYMTRACE_VM_DISK_GB     virtual disk size (default 12)
set -euo pipefail

box_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
project=$(cd "$box_dir/.." && pwd)
cache=${PYMTRACE_VM_CACHE:-/var/cache/pymtrace-vm}
mirror=${PYMTRACE_DEBIAN_MIRROR:-http://deb.debian.org/debian}
security=${PYMTRACE_DEBIAN_SECURITY:-http://deb.debian.org/debian-security}
disk_gb=${PYMTRACE_VM_DISK_GB:-12}

log() { printf 'build-box: %s\n' "$*" >&2; }
die() { printf 'build-box: error: %s\n' "$*" >&2; exit 1; }

# What the host needs to build boxes and to run them under vagrant-libvirt. libvirt comes
# without libvirt-daemon-system: that package would define libvirt's default network (a
# bridge in the root namespace); run-tests.sh starts the daemons itself, in a namespace.
HOST_PACKAGES="mmdebstrap qemu-system-x86 qemu-utils e2fsprogs extlinux syslinux-common \
rsync iproute2 util-linux python3-pip openssh-client vagrant vagrant-libvirt libvirt-daemon \
libvirt-daemon-driver-qemu libvirt-clients dnsmasq-base iptables"

# distro -> "suite python-version"
dist_info() {
    case $1 in
        debian12) echo "bookworm 3.11" ;;
        debian13) echo "trixie 3.13" ;;
        *) return 1 ;;
    esac
}

# Everything in the image besides install.sh's own list.
base_packages() {
    echo "linux-image-amd64 linux-headers-amd64 systemd-sysv udev dbus openssh-server sudo \
rsync iproute2 extlinux initramfs-tools python3-pip ca-certificates less passwd adduser \
e2fsprogs kmod"
}

# install.sh's Debian package list, read from install.sh itself.
install_sh_packages() {
    # shellcheck disable=SC1091
    (source "$project/install.sh" && distro_packages debian)
}

# SUITE WORKDIR -> install.sh's list with its "a|b" alternatives resolved by install.sh's
# own resolve_packages against SUITE's package index (a private apt state in WORKDIR).
resolved_install_sh_packages() {
    local suite=$1 dir=$2/apt
    mkdir -p "$dir/lists/partial" "$dir/cache/archives/partial" "$dir/sources.list.d"
    apt_sources "$suite" >"$dir/sources.list"
    printf '%s\n' "Dir::Etc::sourcelist \"$dir/sources.list\";" \
        "Dir::Etc::sourceparts \"$dir/sources.list.d\";" "Dir::State::Lists \"$dir/lists\";" \
        "Dir::Cache \"$dir/cache\";" 'Dir::State::status "/dev/null";' \
        'Acquire::Check-Valid-Until "false";' >"$dir/apt.conf"
    APT_CONFIG=$dir/apt.conf apt-get update -qq >&2 || return 1
    # shellcheck disable=SC1091,SC2046
    (export APT_CONFIG=$dir/apt.conf; source "$project/install.sh" && resolve_packages $(distro_packages debian))
}

apt_sources() {
    local suite=$1
    printf 'deb %s %s main\n' "$mirror" "$suite" "$mirror" "$suite-updates" "$security" "$suite-security"
}

# The project's Python requirements (runtime + test extra) and the build backend, one a line.
python_requirements() {
    /usr/bin/python3 - "$project/pyproject.toml" <<'EOF'
import sys, tomllib
with open(sys.argv[1], "rb") as f:
    data = tomllib.load(f)
reqs = list(data["build-system"]["requires"]) + ["wheel", "pip"]
reqs += data["project"]["dependencies"]
for extra in data["project"].get("optional-dependencies", {}).values():
    reqs += extra
for r in sorted(set(reqs)):
    print(r)
EOF
}

ensure_host_packages() {
    local missing=() p
    for p in $HOST_PACKAGES; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing+=("$p")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    log "installing host packages: ${missing[*]}"
    # No service may start while installing (a libvirtd started now would run in the root
    # network namespace).
    local policy=/usr/sbin/policy-rc.d had_policy=0
    [ -e "$policy" ] && had_policy=1
    if [ $had_policy = 0 ]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy"
        chmod 0755 "$policy"
    fi
    local rc=0
    apt_install "${missing[@]}" || { apt-get update -qq >&2 && apt_install "${missing[@]}"; } || rc=$?
    [ $had_policy = 0 ] && rm -f "$policy"
    [ $rc = 0 ] || die "could not install the host packages"
}

apt_install() {
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >&2
}

# Vagrant's well-known insecure public key (the box's initial login; vagrant replaces it
# with a fresh key on first `vagrant up`).
vagrant_pubkey() {
    local k
    for k in /usr/share/rubygems-integration/all/gems/vagrant-*/keys/vagrant.pub \
             /opt/vagrant/embedded/gems/gems/vagrant-*/keys/vagrant.pub \
             /usr/share/vagrant/keys/vagrant.pub; do
        [ -r "$k" ] && { echo "$k"; return 0; }
    done
    return 1
}

cache_key() {
    local dist=$1
    {
        echo "$dist"
        cat "${BASH_SOURCE[0]}"
        base_packages
        install_sh_packages
        python_requirements
    } | sha256sum | cut -c1-16
}

make_cache_dir() {
    mkdir -p "$cache"
    [ "$(stat -c '%u' "$cache")" = 0 ] || die "$cache is not owned by root"
    chmod 0700 "$cache"
    [ -L "$cache" ] && die "$cache is a symlink"
    return 0
}

build_wheelhouse() {
    local pyver=$1 dest=$2 reqfile
    reqfile=$(mktemp)
    python_requirements >"$reqfile"
    log "downloading wheels for Python $pyver"
    # Binary wheels only: the guest has no compiler toolchain for Python extensions' build
    # dependencies and no network to fetch them. pyspark is published as a source archive
    # only: its wheel (pure Python) is built here, with its dependencies (py4j, pure Python).
    grep -v '^pyspark' "$reqfile" >"$reqfile.binary"
    /usr/bin/python3 -m pip download -q --disable-pip-version-check --dest "$dest" \
        --only-binary=:all: --python-version "$pyver" --implementation cp \
        -r "$reqfile.binary" >&2
    if grep -q '^pyspark' "$reqfile"; then
        /usr/bin/python3 -m pip wheel -q --disable-pip-version-check -w "$dest" \
            "$(grep '^pyspark' "$reqfile")" >&2
    fi
    rm -f "$reqfile" "$reqfile.binary"
}

# The hook mmdebstrap runs in the finished root filesystem ($1).
customize_rootfs() {
    local root=$1 wheels=$2 pubkey=$3 name=$4
    echo "pymtrace-$name" >"$root/etc/hostname"
    printf '127.0.0.1\tlocalhost\n127.0.1.1\tpymtrace-%s\n' "$name" >"$root/etc/hosts"
    echo "/dev/vda / ext4 errors=remount-ro 0 1" >"$root/etc/fstab"
    # DHCP on the first NIC (vagrant-libvirt's management network).
    mkdir -p "$root/etc/systemd/network"
    printf '[Match]\nName=eth* en*\n\n[Network]\nDHCP=yes\n' >"$root/etc/systemd/network/20-wired.network"
    chroot "$root" systemctl enable systemd-networkd >/dev/null 2>&1
    # Fresh SSH host keys per VM instead of the ones made while building.
    rm -f "$root"/etc/ssh/ssh_host_*
    cat >"$root/etc/systemd/system/ssh-hostkeys.service" <<'EOF'
[Unit]
Description=Generate SSH host keys
Before=ssh.service
ConditionPathExists=!/etc/ssh/ssh_host_ed25519_key

[Service]
Type=oneshot
ExecStart=/usr/bin/ssh-keygen -A

[Install]
WantedBy=multi-user.target
EOF
    chroot "$root" systemctl enable ssh-hostkeys.service >/dev/null 2>&1
    echo "UseDNS no" >"$root/etc/ssh/sshd_config.d/vagrant.conf"
    # The vagrant user: insecure key, passwordless sudo.
    chroot "$root" useradd -m -s /bin/bash vagrant
    echo 'vagrant:vagrant' | chroot "$root" chpasswd
    echo 'vagrant ALL=(ALL) NOPASSWD: ALL' >"$root/etc/sudoers.d/vagrant"
    chmod 0440 "$root/etc/sudoers.d/vagrant"
    install -d -m 0700 "$root/home/vagrant/.ssh"
    install -m 0600 "$pubkey" "$root/home/vagrant/.ssh/authorized_keys"
    chroot "$root" chown -R vagrant:vagrant /home/vagrant/.ssh
    # Python packages come from the wheelhouse only.
    mkdir -p "$root/opt/wheelhouse"
    cp "$wheels"/* "$root/opt/wheelhouse/"
    printf '[global]\nno-index = true\nfind-links = /opt/wheelhouse\n' >"$root/etc/pip.conf"
    # No network: apt's sources would only make `apt-get update` wait and fail.
    local src
    for src in "$root/etc/apt/sources.list" "$root"/etc/apt/sources.list.d/*.list "$root"/etc/apt/sources.list.d/*.sources; do
        [ -e "$src" ] && mv "$src" "$src.no-network"
    done
    # Boot loader: extlinux in the boot sector of the whole-disk ext4 (installed later).
    local kernel initrd
    kernel=$(find "$root/boot" -maxdepth 1 -name 'vmlinuz-*' -printf '%f\n' | sort -V | tail -n1)
    initrd=$(find "$root/boot" -maxdepth 1 -name 'initrd.img-*' -printf '%f\n' | sort -V | tail -n1)
    { [ -n "$kernel" ] && [ -n "$initrd" ]; } || die "no kernel or initrd in $root/boot"
    mkdir -p "$root/boot/extlinux"
    cat >"$root/boot/extlinux/extlinux.conf" <<EOF
DEFAULT linux
TIMEOUT 1
PROMPT 0
LABEL linux
  LINUX /boot/$kernel
  INITRD /boot/$initrd
  APPEND root=/dev/vda rw console=ttyS0 net.ifnames=0 quiet
EOF
    rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin
}

# Unmount whatever a failed build left mounted under WORK (the loop mount, mmdebstrap's
# /proc, /sys, /dev), then delete it.
cleanup_work() {
    local work=$1 m
    awk -v w="$work/" 'index($2, w) == 1 {print $2}' /proc/mounts | sort -r |
        while read -r m; do umount -l "$m" 2>/dev/null; done
    rm -rf --one-file-system "$work"
}

build_box() {
    local dist=$1 box=$2 suite pyver work pubkey start
    read -r suite pyver < <(dist_info "$dist")
    pubkey=$(vagrant_pubkey) || die "Vagrant's insecure public key not found (is vagrant installed?)"
    work=$(mktemp -d "$cache/build.XXXXXX")
    # shellcheck disable=SC2064
    trap "cleanup_work '$work'" EXIT
    build_wheelhouse "$pyver" "$work/wheels"

    local packages resolved
    resolved=$(resolved_install_sh_packages "$suite" "$work") || die "could not read $suite's package index"
    packages=$(printf '%s %s' "$(base_packages)" "$resolved" | tr -s ' \n' ',,' | sed 's/,$//')
    log "mmdebstrap $suite ($dist) into $work/rootfs"
    start=$(date +%s)
    mmdebstrap --mode=root --variant=apt --format=directory --components=main \
        --aptopt='Acquire::Check-Valid-Until "false"' \
        --aptopt='APT::Install-Recommends "false"' \
        --include="$packages" \
        --customize-hook="bash '$box_dir/build-box.sh' --customize \"\$1\" '$work/wheels' '$pubkey' '$dist'" \
        "$suite" "$work/rootfs" "$work/apt/sources.list" >&2
    log "mmdebstrap took $(( $(date +%s) - start ))s; rootfs $(du -sh "$work/rootfs" | cut -f1)"

    start=$(date +%s)
    # ext4 on the whole disk, no partition table: SeaBIOS runs extlinux from the
    # filesystem's boot sector. (Loop devices get no partition devices without udev.)
    truncate -s "${disk_gb}G" "$work/disk.raw"
    mkfs.ext4 -q -F -L root -O ^64bit,^metadata_csum -d "$work/rootfs" "$work/disk.raw"
    rm -rf "$work/rootfs"
    mkdir "$work/mnt"
    mount -o loop "$work/disk.raw" "$work/mnt"
    extlinux --install "$work/mnt/boot/extlinux" >&2
    umount "$work/mnt"
    mkdir "$work/box"
    qemu-img convert -O qcow2 "$work/disk.raw" "$work/box/box.img"
    rm -f "$work/disk.raw"
    printf '{"provider":"libvirt","format":"qcow2","virtual_size":%s}\n' "$disk_gb" >"$work/box/metadata.json"
    cat >"$work/box/Vagrantfile" <<'EOF'
# Box built by pymtrace's vagrant/build-box.sh: no network, everything preinstalled.
Vagrant.configure("2") do |config|
  config.vm.boot_timeout = 900
  config.vm.provider "libvirt" do |lv|
    lv.driver = "qemu"
    lv.cpu_mode = "maximum"
    lv.disk_bus = "virtio"
    lv.nic_model_type = "virtio"
    lv.graphics_type = "none"
    lv.video_type = "none"
  end
end
EOF
    tar -C "$work/box" -cf "$box.tmp" metadata.json Vagrantfile box.img
    mv "$box.tmp" "$box"
    log "image and box took $(( $(date +%s) - start ))s; box $(du -h "$box" | cut -f1)"
    rm -rf "$work"
    trap - EXIT
}

main() {
    if [ "${1:-}" = --customize ]; then shift; customize_rootfs "$@"; return; fi
    local print_only=0
    if [ "${1:-}" = --print-path ]; then print_only=1; shift; fi
    local dist=${1:-}
    dist_info "$dist" >/dev/null || die "usage: $0 [--print-path] debian12|debian13"
    [ "$(id -u)" -eq 0 ] || die "run as root (mmdebstrap, loop mounts, the cache in $cache)"
    ensure_host_packages
    make_cache_dir
    local box
    box="$cache/$dist-$(cache_key "$dist").box"
    if [ $print_only = 1 ] || [ -s "$box" ]; then
        echo "$box"
        return 0
    fi
    # One build per box at a time.
    exec 9>"$cache/.$dist.lock"
    flock 9
    if [ ! -s "$box" ]; then
        build_box "$dist" "$box"
    fi
    echo "$box"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
    main "$@"
fi
