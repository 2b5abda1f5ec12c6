#!/usr/bin/env bash
# pymtrace installer: system packages, kernel headers for BCC, tracefs, a virtual
# environment that sees the distro's BCC, and `pymtrace` on root's PATH.
# Re-running it is harmless.
#
#   sudo ./install.sh            install only
#   sudo ./install.sh --demo     install, then start `pymtrace top` on a bundled demo workload
#   sudo ./install.sh --test     install, then run the whole test suite
#   sudo ./install.sh --test tests/live/test_doctor_bpf.py ...   install, then run these tests
#
# Supported: Debian (12+), Ubuntu (22.04+), Fedora (38+). Environment:
#   PYMTRACE_VENV   where the virtual environment goes (default /opt/pymtrace/venv)
#   PYMTRACE_SKIP_PACKAGES=1   skip the distro package step (already installed)
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
venv=${PYMTRACE_VENV:-/opt/pymtrace/venv}
action="install"

log() { printf 'install.sh: %s\n' "$*" >&2; }
die() { printf 'install.sh: error: %s\n' "$*" >&2; exit 1; }

# distro_family OS_RELEASE_FILE -> prints debian | fedora, or fails.
# Kept a pure function of the file so tests can feed it every supported os-release.
distro_family() {
    local file=$1 id="" id_like=""
    [ -r "$file" ] || { echo "unknown"; return 1; }
    id=$(sed -n 's/^ID=//p' "$file" | tr -d '"' | head -n1)
    id_like=$(sed -n 's/^ID_LIKE=//p' "$file" | tr -d '"' | head -n1)
    case " $id $id_like " in
        *" debian "*|*" ubuntu "*) echo debian ;;
        *" fedora "*|*" rhel "*|*" centos "*) echo fedora ;;
        *) echo "unknown"; return 1 ;;
    esac
}

# distro_packages FAMILY -> the system packages pymtrace needs there. "a|b": the first of
# these the distribution has (resolve_packages); Debian 13 renamed some libraries.
# golang-go/golang and chromium are for the tests only: `go tool pprof` reads `heap`'s pprof
# profiles and headless Chromium renders its HTML flame graphs (real clients of the formats).
# openjdk-17 (Debian 13: 21; Fedora java-17-openjdk-headless) runs pyspark's local mode in the test that reads
# `pymtrace collect`'s dataset with Spark (a real client of the dataset, docs/collect.md).
# g++ (gcc-c++) builds the C++ test workloads (heap: operator new callers, demangled names).
# redis-server + redis-tools (Fedora: redis) for the test of a real jemalloc server driven by
# redis-benchmark (top's rates, a record replayed under jemalloc: tests/live/test_redis.py).
# sqlite3 (Fedora: sqlite) is a real program the tests trace on both paths against ground truth.
# libunwind8 (Fedora: libunwind): `record --stacks -- CMD` unwinds in the traced process with it
# (the interposer loads libunwind.so.8; without it --stacks goes through uprobes, saying why).
distro_packages() {
    case $1 in
        debian) echo "bpfcc-tools python3-bpfcc bpftool systemtap-sdt-dev gcc g++ make libc6-dev \
python3-venv libjemalloc2 libtcmalloc-minimal4|libtcmalloc-minimal4t64 libmimalloc2.0|libmimalloc3 \
prometheus libc-devtools libdw-dev \
tmux shellcheck vagrant binutils procps clang-format golang-go chromium|chromium-browser \
openjdk-17-jre-headless|openjdk-21-jre-headless redis-server redis-tools sqlite3 libunwind8" ;;
        fedora) echo "bcc bcc-tools python3-bcc bpftool systemtap-sdt-devel gcc gcc-c++ make glibc-devel \
jemalloc gperftools-libs mimalloc golang-github-prometheus glibc-utils elfutils-devel tmux ShellCheck \
binutils procps-ng kernel-devel clang-tools-extra golang chromium java-17-openjdk-headless redis sqlite libunwind" ;;
        *) return 1 ;;
    esac
}

# resolve_packages WORD... -> each word on a line, an "a|b" word replaced by the first
# alternative apt has a package for (else the first one, so apt-get names it in its error).
# A name apt only knows from another package's relations has no record (exit status 0).
resolve_packages() {
    local word alt pick
    for word in "$@"; do
        pick=""
        for alt in ${word//|/ }; do
            # grep -c reads it all: grep -q could exit first, and pipefail would then
            # count apt-cache's SIGPIPE as "not found".
            if [ "$(apt-cache show --no-all-versions "$alt" 2>/dev/null | grep -c '^Package:')" -gt 0 ]; then
                pick=$alt
                break
            fi
        done
        echo "${pick:-${word%%|*}}"
    done
}

install_packages() {
    local family=$1
    # shellcheck disable=SC2046
    case $family in
        debian)
            export DEBIAN_FRONTEND=noninteractive
            apt-get update -qq
            apt-get install -y -qq $(resolve_packages $(distro_packages debian)) >/dev/null
            # Headers for the running kernel when the distro has them, else the newest
            # generic ones (linked in below).
            apt-get install -y -qq "linux-headers-$(uname -r)" >/dev/null 2>&1 \
                || apt-get install -y -qq linux-headers-amd64 >/dev/null 2>&1 \
                || apt-get install -y -qq linux-headers-generic >/dev/null 2>&1 \
                || log "no kernel headers package found; BCC may fail to compile"
            ;;
        fedora)
            dnf install -y -q $(distro_packages fedora) "kernel-devel-$(uname -r)" >/dev/null 2>&1 \
                || dnf install -y -q $(distro_packages fedora) >/dev/null
            ;;
    esac
}

# BCC looks for headers in /lib/modules/$(uname -r)/build. Kernels without a headers
# package (custom builds) get the distro's nearest headers linked in, build -> the
# arch directory and source -> the common one (setting only BCC_KERNEL_SOURCE fails; docs/internals.md).
link_kernel_headers() {
    local mod hdr common
    mod=/lib/modules/$(uname -r)
    if [ -e "$mod/build/include/generated/autoconf.h" ] || [ -e "$mod/build/include/config/auto.conf" ]; then
        return 0
    fi
    hdr=$(find /usr/src -maxdepth 1 -name 'linux-headers-*' ! -name '*-common' ! -name '*-common-*' -type d 2>/dev/null | sort -V | tail -n1)
    [ -z "$hdr" ] && hdr=$(find /usr/src/kernels -maxdepth 1 -mindepth 1 -type d 2>/dev/null | sort -V | tail -n1)
    [ -n "$hdr" ] || { log "no kernel headers under /usr/src; BCC cannot compile"; return 0; }
    common=${hdr%-amd64}-common
    [ -d "$common" ] || common=${hdr%-*}-common
    [ -d "$common" ] || common=$hdr
    mkdir -p "$mod"
    ln -sfn "$hdr" "$mod/build"
    ln -sfn "$common" "$mod/source"
    log "kernel $(uname -r) has no headers package: linked $hdr (and $common) into $mod"
}

mount_tracefs() {
    if [ ! -e /sys/kernel/tracing/uprobe_events ]; then
        mount -t tracefs nodev /sys/kernel/tracing 2>/dev/null || log "could not mount tracefs"
    fi
    if [ ! -e /sys/kernel/debug/tracing ] && [ -d /sys/kernel/debug ]; then
        mount -t debugfs nodev /sys/kernel/debug 2>/dev/null || true
    fi
}

make_venv() {
    local py=/usr/bin/python3
    [ -x "$py" ] || die "/usr/bin/python3 is missing"
    if [ ! -x "$venv/bin/python" ]; then
        mkdir -p "$(dirname "$venv")"
        "$py" -m venv --system-site-packages "$venv"
    fi
    "$venv/bin/python" -m pip install -q --upgrade pip >/dev/null
    "$venv/bin/python" -m pip install -q -e "${here}[test]"
    # The PyPI project called `bcc` is an unrelated library; the distro's module must win.
    if "$venv/bin/python" -m pip show bcc >/dev/null 2>&1; then
        "$venv/bin/python" -m pip uninstall -y -q bcc
    fi
    "$venv/bin/python" -c 'import bcc, sys; sys.exit(0 if "/dist-packages/" in bcc.__file__ or "/site-packages/bcc" in bcc.__file__ else 1)' \
        || die "python cannot import the distro's bcc module"
    ln -sfn "$venv/bin/pymtrace" /usr/local/bin/pymtrace
}

main() {
    case ${1:-} in
        --demo) action="demo" ;;
        --test) action="test" ;;
        ""|--install) action="install" ;;
        -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
        *) die "unknown option ${1} (use --demo, --test or nothing)" ;;
    esac
    [ "$(id -u)" -eq 0 ] || die "run as root (sudo ./install.sh ${1:-})"
    local family
    family=$(distro_family /etc/os-release) || die "unsupported distribution (need Debian, Ubuntu or Fedora)"
    if [ "${PYMTRACE_SKIP_PACKAGES:-0}" != 1 ]; then
        log "installing $family packages"
        install_packages "$family"
    fi
    link_kernel_headers
    mount_tracefs
    make_venv
    log "pymtrace installed: $(command -v pymtrace)"
    case $action in
        demo) exec pymtrace top --demo ;;
        # PYTHONFAULTHANDLER: a crash of a pymtrace process a test starts (a rare SIGSEGV
        # was seen once in 66 runs of `top --always-on --batch -n 1`) leaves its Python stack.
        # --durations: every run (CI, the VMs) lists its slowest tests, to keep them lean.
        test) shift
              [ $# -gt 0 ] || set -- tests
              cd "$here" && PYTHONFAULTHANDLER=1 exec "$venv/bin/python" -m pytest -ra --durations=25 "$@" ;;
    esac
}

# Sourcing the file (tests) defines the functions without running anything.
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
    main "$@"
fi
