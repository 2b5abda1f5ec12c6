#!/bin/sh
# Cost per malloc+free pair on the storm (CPU time of the traced process: robust to load),
# interleaved rounds.  The BPF program's own time per sample comes from bpf_ktime_get_ns.
cd "$(dirname "$0")"
PY=../venv/bin/python
N=${N:-100000}
for round in 1 2 3; do
  echo "round $round load: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "untraced: $(./storm $N 0)"
  for mode in "--mean 1099511627776" "--mean 524288 --pages 4" "--nocopy" "--pages 1" "--pages 2" "--pages 4" "--pages 8" "--pages 8 --varlen"; do
    out=$(timeout 300 $PY heapstack.py --unwinder none $mode -- ./storm $N 1500 2>&1)
    echo "$mode: $(echo "$out" | grep storm) | $(echo "$out" | grep -E 'calls=|BPF copy' | tr '\n' ' ')"
  done
done
