#!/usr/bin/env bash
# Run pymtrace's test suite in the Vagrant VMs and print a pass/fail line per box.
#
#   vagrant/run-tests.sh                 fedora, ubuntu and debian, one after another
#   vagrant/run-tests.sh debian          one box
#   PYMTRACE_VM_DESTROY=1 vagrant/run-tests.sh    destroy each box after its run
#   VAGRANT_DEFAULT_PROVIDER=virtualbox vagrant/run-tests.sh   (default: libvirt if installed)
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")" || exit 1
boxes=("$@")
[ ${#boxes[@]} -eq 0 ] && boxes=(fedora ubuntu debian)
logdir=${PYMTRACE_VM_LOGS:-results}
mkdir -p "$logdir"

declare -A result
declare -A seconds
for box in "${boxes[@]}"; do
    start=$(date +%s)
    log="$logdir/$box.log"
    echo "== $box: provisioning and testing (log: vagrant/$log)"
    if vagrant up "$box" --provision >"$log" 2>&1 \
        && vagrant rsync "$box" >>"$log" 2>&1 \
        && vagrant ssh "$box" -c 'cd /pymtrace && sudo PYMTRACE_REQUIRE_BPF=1 ./install.sh --test' >>"$log" 2>&1; then
        result[$box]=PASS
    else
        result[$box]=FAIL
    fi
    seconds[$box]=$(( $(date +%s) - start ))
    if [ "${PYMTRACE_VM_DESTROY:-0}" = 1 ]; then
        vagrant destroy -f "$box" >>"$log" 2>&1
    fi
done

echo
echo "box      result  time   last test line"
failed=0
for box in "${boxes[@]}"; do
    summary=$(grep -E '[0-9]+ (passed|failed)' "$logdir/$box.log" | tail -n1)
    printf '%-8s %-7s %4ds  %s\n' "$box" "${result[$box]}" "${seconds[$box]}" "${summary:-(no pytest summary)}"
    [ "${result[$box]}" = PASS ] || failed=1
done
exit $failed
