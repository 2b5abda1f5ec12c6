#!/usr/bin/env bash
# Run pymtrace's test suite in booted VMs and print one PASS/FAIL line per box.
#
#   sudo vagrant/run-tests.sh                  debian12 and debian13 (same as "all")
#   sudo vagrant/run-tests.sh debian12         one box: Debian 12, kernel 6.1
#   sudo vagrant/run-tests.sh debian13         Debian 13, kernel 6.12
#   vagrant/run-tests.sh fedora|ubuntu         public boxes: need network and a working
#                                              Vagrant provider on the host (not used here)
#
# The Debian boxes are built locally from Debian's archive by build-box.sh (cached, see
# there) and need no network at all. For each of them this script, as root:
#   - creates a network namespace and a private mount namespace, and starts libvirtd and
#     virtlogd in them with their own /etc/libvirt, /run/libvirt, /var/lib/libvirt, so
#     vagrant-libvirt's management network (an isolated bridge) exists only in there: the
#     VM can reach nothing but that bridge, and nothing outside reaches the VM;
#   - `vagrant up` (libvirt, QEMU's TCG emulator: no KVM needed), rsyncs the project and
#     ../shared in, runs `install.sh --test` with PYMTRACE_REQUIRE_BPF=1 (and the Python-frame
#     tests on the box's own python3: PYMTRACE_TEST_PYTHONS=/usr/bin/python3), then destroys
#     the VM, stops the daemons and deletes the namespace.
# Environment:
#   PYMTRACE_VM_LOGS     where the per-box logs go (default vagrant/results)
#   PYMTRACE_VM_CACHE    build-box.sh's cache (also holds Vagrant's box store and the pool)
#   PYMTRACE_VM_NICE     niceness of libvirtd and so of QEMU (default 10)
#   PYMTRACE_VM_KEEP=1   do not destroy the VM (debugging; the namespace stays too)
#   PYMTRACE_VM_TIMEOUT  limit in seconds for install.sh --test inside (default 14400)
#   PYMTRACE_VM_PARALLEL 0 runs several local boxes one after the other (default 1: at once)
#   PYMTRACE_VM_CPUS     vCPUs per VM (default 1: multi-threaded TCG crashes guests now and then)
#   PYMTRACE_VM_MEMORY   MB per VM (default 4096)
# The guest's serial console goes to BOX-TIME.console.log next to the log.
#   PYMTRACE_SHARED      host directory synced to /shared (default ../../shared)
#   PYMTRACE_VM_TESTS    pytest arguments instead of the whole suite, e.g. a smoke run:
#                        "tests/live/test_doctor_bpf.py tests/live/test_top_slab.py"
# Ctrl-C, TERM or HUP stops every box's run (VM destroyed, namespace removed); exit 128+N.
set -uo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cache=${PYMTRACE_VM_CACHE:-/var/cache/pymtrace-vm}
LOCAL_BOXES=(debian12 debian13)

log() { printf 'run-tests: %s\n' "$*" >&2; }
die() { printf 'run-tests: error: %s\n' "$*" >&2; exit 2; }
now() { date +%s; }

# PID -> waits for that child to end, through the traps signals run meanwhile (a trapped
# signal makes `wait` return early); its exit status, or 128+N if a signal cut the wait.
wait_child() {
    local rc
    while :; do
        wait "$1"; rc=$?
        kill -0 "$1" 2>/dev/null || return $rc
    done
}

# CMD... -> runs the program CMD in a process group of its own and waits for it, so that
# the TERM or HUP trap of run_box can pass the signal to that whole group (bash runs a trap
# only once its foreground command ends: CMD runs in the background). There the box's run
# ends its current step, and its EXIT trap stops the guest and the daemons.
group_pid=
run_group() {
    local rc
    setsid "$@" &
    group_pid=$!
    wait_child "$group_pid"; rc=$?
    group_pid=
    return $rc
}

is_local_box() {
    case $1 in debian12|debian13) return 0 ;; *) return 1 ;; esac
}

# ---------------------------------------------------------------------------------------
# Inside the namespaces (run as: ip netns exec NS unshare --mount ... run-tests.sh --inside)

# Private libvirt state: nothing the daemons define (networks, pools) outlives the run or
# is seen by a libvirtd in the root namespace.
private_libvirt() {
    local state=$1 d
    for d in etc run lib log cache; do mkdir -p "$state/libvirt-$d"; done
    cp -a /etc/libvirt/. "$state/libvirt-etc/" 2>/dev/null || true
    # No libvirt-qemu user or cgroup manager on the host: QEMU runs as root, unconfined.
    cat >"$state/libvirt-etc/qemu.conf" <<'EOF'
user = "root"
group = "root"
dynamic_ownership = 0
remember_owner = 0
security_driver = "none"
cgroup_controllers = [ ]
EOF
    printf 'unix_sock_group = "root"\nunix_sock_rw_perms = "0700"\n' >"$state/libvirt-etc/libvirtd.conf"
    mkdir -p /etc/libvirt /run/libvirt /var/lib/libvirt /var/log/libvirt /var/cache/libvirt
    mount --bind "$state/libvirt-etc" /etc/libvirt
    mount --bind "$state/libvirt-run" /run/libvirt
    mount --bind "$state/libvirt-lib" /var/lib/libvirt
    mount --bind "$state/libvirt-log" /var/log/libvirt
    mount --bind "$state/libvirt-cache" /var/cache/libvirt
}

start_daemons() {
    local state=$1 nice=${PYMTRACE_VM_NICE:-10}
    ip link set lo up
    # QEMU inherits libvirtd's niceness: the machine is shared.
    nice -n "$nice" virtlogd -d -p "$state/virtlogd.pid" || return 1
    nice -n "$nice" libvirtd -d -p "$state/libvirtd.pid" || return 1
    for _ in $(seq 60); do
        virsh -c qemu:///system version >/dev/null 2>&1 && return 0
        sleep 1
    done
    log "libvirtd did not come up"
    return 1
}

# shellcheck disable=SC2317  # called from a trap
stop_daemons() {
    local state=$1 pidfile pid dom net
    # Guests and dnsmasq outlive libvirtd: stop them first.
    for dom in $(virsh list --name 2>/dev/null); do virsh -q destroy "$dom" >/dev/null 2>&1; done
    for net in $(virsh net-list --name 2>/dev/null); do virsh -q net-destroy "$net" >/dev/null 2>&1; done
    for pidfile in "$state/libvirtd.pid" "$state/virtlogd.pid"; do
        [ -r "$pidfile" ] || continue
        pid=$(cat "$pidfile")
        kill "$pid" 2>/dev/null || continue
        for _ in $(seq 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    done
}

ensure_pool() {
    local target=$1
    mkdir -p "$target"
    chmod 0700 "$target"
    virsh -q pool-define-as default dir --target "$target" >/dev/null &&
        virsh -q pool-start default >/dev/null
}

stamp_lines() {
    local line
    while IFS= read -r line; do printf '%(%H:%M:%S)T %s\n' -1 "$line"; done
}

# VM_NAME BOX_FILE BOX_NAME STATE TIMINGS
inside() {
    local name=$1 box_file=$2 box_name=$3 state=$4 timings=$5 rc=0 t
    private_libvirt "$state"
    # shellcheck disable=SC2064
    trap "stop_daemons '$state'" EXIT
    # A TERM or HUP (run_group's whole process group gets it: the vagrant step under way ends
    # too) skips the rest and destroys the VM. The suite's step runs under `timeout`, which
    # puts itself in a process group of its own: the trap passes the signal on to it.
    interrupted=0 suite_pid=
    trap 'interrupted=1; [ -z "$suite_pid" ] || kill -TERM "$suite_pid" 2>/dev/null' TERM HUP
    start_daemons "$state" || return 1
    ensure_pool "$cache/pool" || return 1
    export VAGRANT_HOME=$cache/vagrant.d VAGRANT_DEFAULT_PROVIDER=libvirt
    export VAGRANT_DOTFILE_PATH=$state/dot-vagrant VAGRANT_CHECKPOINT_DISABLE=1
    export "PYMTRACE_BOX_${name^^}=$box_name"
    cd "$here" || return 1
    # One change to Vagrant's box store at a time: runs of other boxes share it.
    local store_lock
    exec {store_lock}>"$cache/.box-store.lock"
    flock "$store_lock"
    if ! vagrant box list 2>/dev/null | grep -q "^$box_name "; then
        t=$(now)
        vagrant box add --name "$box_name" "$box_file" || return 1
        echo "box_add $(( $(now) - t ))" >>"$timings"
        remove_stale_boxes "$name" "$box_name"
    else
        echo "box_add 0" >>"$timings"  # added by an earlier run
    fi
    exec {store_lock}>&-
    t=$(now)
    # Time-stamped: the log then shows how long the boot took ("Starting domain" to
    # "Machine booted and ready").
    [ "$interrupted" = 0 ] && vagrant up "$name" --provider libvirt --no-provision 2>&1 | stamp_lines || rc=1
    echo "vagrant_up $(( $(now) - t ))" >>"$timings"
    if [ $rc = 0 ] && [ "$interrupted" = 0 ]; then
        # shellcheck disable=SC2016  # expanded in the guest
        vagrant ssh "$name" -c 'echo "guest: $(uname -r), up $(cut -d" " -f1 /proc/uptime)s"; systemd-analyze 2>/dev/null | head -n1' || true
        t=$(now)
        # A guest that stops answering (a debian13 guest hung once, its kernel spinning)
        # ends the run: SSH keepalives, and an overall limit. In the background, so that a
        # TERM's trap runs at once rather than when the suite ends (bash runs a trap only
        # once its foreground command is done).
        timeout --kill-after=60 "${PYMTRACE_VM_TIMEOUT:-14400}" \
            vagrant ssh "$name" -c "cd /srv/pymtrace && sudo PYMTRACE_REQUIRE_BPF=1 PYMTRACE_TEST_PYTHONS=/usr/bin/python3 ./install.sh --test ${PYMTRACE_VM_TESTS:-}" \
            -- -o ServerAliveInterval=60 -o ServerAliveCountMax=10 &
        suite_pid=$!
        [ "$interrupted" = 0 ] || kill -TERM "$suite_pid" 2>/dev/null  # a TERM before $! was known
        wait_child "$suite_pid" || rc=1
        suite_pid=
        echo "suite $(( $(now) - t ))" >>"$timings"
    fi
    [ "$interrupted" = 0 ] || { log "interrupted"; rc=1; }
    if [ "${PYMTRACE_VM_KEEP:-0}" = 1 ]; then
        log "PYMTRACE_VM_KEEP=1: leaving the VM running"
        trap - EXIT
        return $rc
    fi
    vagrant destroy -f "$name" || true
    return $rc
}

# Older builds of the same box (another cache key) in Vagrant's store and the pool.
remove_stale_boxes() {
    local name=$1 current=$2 b
    for b in $(vagrant box list 2>/dev/null | awk '{print $1}' | grep "^pymtrace/$name-"); do
        [ "$b" = "$current" ] && continue
        vagrant box remove --force --all "$b" >/dev/null 2>&1 || true
        find "$cache/pool" -maxdepth 1 -name "${b//\//-VAGRANTSLASH-}_vagrant_box_image_*" -delete
    done
}

# ---------------------------------------------------------------------------------------
# On the host

# libvirt's QEMU driver needs its build-time user to exist even when qemu.conf says root
# (libvirt-daemon-system would create it; it is not installed, see build-box.sh).
ensure_libvirt_user() {
    getent passwd libvirt-qemu >/dev/null && return 0
    useradd --system --user-group --no-create-home --home-dir /var/lib/libvirt \
        --shell /usr/sbin/nologin libvirt-qemu
}

# PATH -> whether a process has the file open.
open_by_a_process() {
    local fd
    for fd in /proc/[0-9]*/fd/*; do
        [ "$(readlink "$fd" 2>/dev/null)" = "$1" ] && return 0
    done
    return 1
}

# NAME -> removes what a killed run of this box left: its network namespace, its daemons and
# its state directory. Called holding the box's lock with its disk unused, so no run of this
# box is alive (a kept VM's namespace and state go too once its VM is gone).
remove_killed_runs() {
    local name=$1 ns state pidfile pid
    for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^pymtrace-vm-[0-9]+-$name\$"); do
        log "$name: removing the namespace left by an earlier run: $ns"
        ip netns delete "$ns" || true
    done
    for state in "$cache"/run."$name".*; do
        [ -d "$state" ] || continue
        for pidfile in "$state/libvirtd.pid" "$state/virtlogd.pid"; do
            pid=$(cat "$pidfile" 2>/dev/null) || continue
            # 2>/dev/null first: redirections apply left to right, and a vanished pid's
            # cmdline must not print an error.
            case $(tr '\0' ' ' 2>/dev/null <"/proc/$pid/cmdline") in
                *libvirtd*|*virtlogd*) kill "$pid" 2>/dev/null || true ;;
            esac
        done
        log "$name: removing the state left by an earlier run: $state"
        rm -rf "$state"
    done
}

# NAME -> the path of its box (built, or the cached one), on stdout.
build_box() { "$here/build-box.sh" "$1"; }

# NAME LOG -> runs one local box; exit status 0 = suite passed.
run_local_box() {
    local name=$1 logfile=$2 box_file key ns state rc
    local t0
    t0=$(now)
    box_file=$(build_box "$name" 2>>"$logfile") || { log "$name: building the box failed"; return 1; }
    echo "box_ready $(( $(now) - t0 ))" >>"$timings"
    key=$(basename "$box_file" .box)
    key=${key#"$name"-}
    ensure_libvirt_user || return 1
    # One run per box at a time: runs share the pool (the VM's disk is named after the box).
    local lock
    exec {lock}>"$cache/.run-$name.lock"
    flock "$lock"
    # The VM disk of a run that was killed, or kept (PYMTRACE_VM_KEEP=1) and never destroyed,
    # makes `vagrant up` fail ("Volume for domain is already created"): remove it unless a
    # process (a kept VM's QEMU) still has it open.
    local disk=$cache/pool/vagrant_$name.img
    if [ -e "$disk" ]; then
        if open_by_a_process "$disk"; then
            log "$name: $disk is in use (a kept VM?): destroy it first"
            exec {lock}>&-
            return 1
        fi
        log "$name: removing the disk left by an earlier run: $disk"
        rm -f "$disk"
    fi
    remove_killed_runs "$name"
    state=$(mktemp -d "$cache/run.$name.XXXXXX")
    ns=pymtrace-vm-$$-$name
    ip netns add "$ns" || { rm -rf "$state"; return 1; }
    rc=1
    if [ "$interrupted" = 0 ]; then
        run_group ip netns exec "$ns" unshare --mount --propagation private \
            env PYMTRACE_VM_CACHE="$cache" PYMTRACE_VM_CONSOLE_LOG="${logfile%.log}.console.log" \
            "$here/run-tests.sh" --inside "$name" "$box_file" \
            "pymtrace/$name-$key" "$state" "$timings" >>"$logfile" 2>&1
        rc=$?
    fi
    if [ "${PYMTRACE_VM_KEEP:-0}" != 1 ]; then
        ip netns delete "$ns"
        rm -rf "$state"
    else
        log "kept namespace $ns and state $state"
    fi
    exec {lock}>&-
    return $rc
}

# NAME LOG -> a public box with the host's own Vagrant setup (needs network).
run_network_box() {
    local name=$1 logfile=$2
    # shellcheck disable=SC2016  # expanded by that bash
    run_group bash -c 'cd "$1" && vagrant up "$2" --provision && vagrant rsync "$2" &&
        vagrant ssh "$2" -c "cd /srv/pymtrace && sudo PYMTRACE_REQUIRE_BPF=1 PYMTRACE_TEST_PYTHONS=/usr/bin/python3 ./install.sh --test"' \
        run-network-box "$here" "$name" >>"$logfile" 2>&1
}

timing() { awk -v k="$1" '$1 == k {print $2}' "$timings" | tail -n1; }

main() {
    if [ "${1:-}" = --inside ]; then
        shift
        inside "$@"
        exit $?
    fi
    local boxes=("$@")
    if [ ${#boxes[@]} -eq 0 ] || [ "${boxes[0]}" = all ]; then boxes=("${LOCAL_BOXES[@]}"); fi
    local b
    for b in "${boxes[@]}"; do
        case $b in debian12|debian13|fedora|ubuntu) ;; *) die "unknown box $b (debian12, debian13, all, fedora, ubuntu)" ;; esac
    done
    if is_local_box "${boxes[0]}"; then
        [ "$(id -u)" -eq 0 ] || die "run as root (it builds images and starts libvirtd in a namespace)"
    fi
    local logdir=${PYMTRACE_VM_LOGS:-$here/results} stamp
    mkdir -p "$logdir"
    stamp=$(date -u +%Y%m%dT%H%M%SZ)
    export PYMTRACE_SHARED=${PYMTRACE_SHARED:-$(cd "$here/../.." && pwd)/shared}
    if [ ! -d "$PYMTRACE_SHARED/glibc-sdt" ]; then
        # (a checkout elsewhere, e.g. a git worktree: set PYMTRACE_SHARED)
        log "warning: no $PYMTRACE_SHARED/glibc-sdt: the tests that need a glibc with malloc probes fail in the VM"
    fi

    # Local boxes run at once (PYMTRACE_VM_PARALLEL, default 1 when there are several): on a
    # 2-core machine a guest running the suite keeps about one core busy (the suite is
    # mostly sequential), so two guests side by side take little longer than one, and
    # `all` fits in about the time of one box. Their boxes are built first, one after the
    # other (build-box.sh installs host packages with apt, which allows one at a time).
    local parallel=${PYMTRACE_VM_PARALLEL:-1} results failed=0 pid
    [ ${#boxes[@]} -gt 1 ] || parallel=0
    for b in "${boxes[@]}"; do is_local_box "$b" || parallel=0; done
    results=$(mktemp -d)
    # Ctrl-C, TERM or HUP: every box's run stops its guest, daemons and namespace, prints
    # its FAIL line, and the script exits 128+N. Each run is a background subshell (see
    # run_group) that gets TERM from here; a box build under way finishes first (minutes).
    pids=() signal=0
    trap 'on_signal 2' INT
    trap 'on_signal 15' TERM
    trap 'on_signal 1' HUP
    if [ "$parallel" = 1 ]; then
        for b in "${boxes[@]}"; do
            [ "$signal" = 0 ] || break
            log "$b: building or reusing its box (log in $logdir/$b-$stamp.log)"
            build_box "$b" >/dev/null 2>>"$logdir/$b-$stamp.log" || true
        done
        for b in "${boxes[@]}"; do
            [ "$signal" = 0 ] || break
            run_box "$b" "$logdir/$b-$stamp.log" >"$results/$b" &
            pids+=($!)
        done
        for pid in "${pids[@]}"; do wait_child "$pid" || failed=1; done
    else
        for b in "${boxes[@]}"; do
            [ "$signal" = 0 ] || break
            run_box "$b" "$logdir/$b-$stamp.log" >"$results/$b" &
            pids=("$!")
            wait_child "${pids[0]}" || failed=1
        done
    fi
    for b in "${boxes[@]}"; do cat "$results/$b" 2>/dev/null; done
    rm -rf "$results"
    [ "$signal" = 0 ] || exit $(( 128 + signal ))
    exit $failed
}

# N -> the script got signal N: pass TERM to the boxes' runs under way.
on_signal() {
    signal=$1
    log "signal $1: stopping the runs (guests destroyed, namespaces removed)"
    [ ${#pids[@]} = 0 ] || kill -TERM "${pids[@]}" 2>/dev/null
}

# BOX LOG -> runs one box; prints its PASS/FAIL line on stdout, its timings on stderr;
# exit status 0 = PASS.
run_box() {
    local b=$1 logfile=$2 result=PASS start summary
    timings=$(mktemp)
    start=$(now)
    log "$b: log in $logfile"
    # This runs in a subshell of main's: main passes its signals on as TERM.
    interrupted=0
    trap 'interrupted=1; [ -z "$group_pid" ] || kill -TERM -- "-$group_pid" 2>/dev/null' TERM HUP
    if is_local_box "$b"; then
        run_local_box "$b" "$logfile" || result=FAIL
    else
        run_network_box "$b" "$logfile" || result=FAIL
    fi
    summary=$(grep -E '^=+ .*[0-9]+ (passed|failed|error)' "$logfile" | tail -n1 | tr -d '=' | sed 's/^ *//; s/ *$//')
    [ "$interrupted" = 0 ] || { result=FAIL summary="interrupted${summary:+; $summary}"; }
    printf '%-9s %s %5ds  %s\n' "$b" "$result" $(( $(now) - start )) "${summary:-(no pytest summary)}"
    log "$b: $result; box ready $(timing box_ready)s, box add $(timing box_add)s, vagrant up $(timing vagrant_up)s, suite $(timing suite)s"
    rm -f "$timings"
    [ "$result" = PASS ]
}

# Sourcing the file (tests) defines the functions without running anything.
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
    main "$@"
fi
