"""Aggregate unwound samples into a profile: Poisson weights, four sample types, symbolized
frames (libdwfl names, demangled with cxxfilt = libstdc++'s __cxa_demangle)."""
import math

try:
    import cxxfilt
except ImportError:  # pragma: no cover
    cxxfilt = None

ROOTS = {"_start", "__libc_start_main", "clone3", "clone", "start_thread", "__clone3"}


def demangle(name):
    if name and name.startswith("_Z") and cxxfilt is not None:
        try:
            return cxxfilt.demangle(name)
        except cxxfilt.InvalidName:
            return name
    return name


def weight(size, mean):
    """(objects, bytes) one sample stands for: 1/p with p = 1 - exp(-size/mean); blocks of at
    least `mean` bytes are always sampled (p = 1)."""
    if mean <= 0 or size >= mean:
        return 1.0, float(size)
    p = -math.expm1(-size / mean)
    return 1.0 / p, size / p


def build(proc, samples, stacks, live_ids, mean):
    frames = {}  # pc -> dict
    for key in stacks:
        for pc in key:
            if pc not in frames:
                name, off, file, line, mod, bid = proc.symbolize(pc)
                frames[pc] = dict(pc=pc, name=demangle(name) or f"0x{pc:x}", off=off, file=file,
                                  line=line, module=mod, build_id=bid, mapping=proc.module_of(pc))
    vals = {}  # stack idx -> [alloc_objects, alloc_space, inuse_objects, inuse_space]
    complete = total = 0
    by_idx = {i: k for k, i in stacks.items()}
    for sid, tid, size, ts, idx, why in samples:
        n, by = weight(size, mean)
        v = vals.setdefault(idx, [0.0, 0.0, 0.0, 0.0])
        v[0] += n
        v[1] += by
        if sid in live_ids:
            v[2] += n
            v[3] += by
        total += 1
        key = by_idx[idx]
        if key and frames[key[-1]]["name"] in ROOTS:
            complete += 1
    return dict(frames=frames, stacks=by_idx, values=vals, complete=complete, total=total,
                mean=mean)


def folded_name(fr):
    return fr["name"]


def write_folded(prof, path, value=3):
    with open(path, "w") as f:
        for idx, v in sorted(prof["values"].items()):
            if round(v[value]) == 0:
                continue
            names = [folded_name(prof["frames"][pc]) for pc in reversed(prof["stacks"][idx])]
            f.write(";".join(names) + f" {round(v[value])}\n")


def write_text(prof, path, top=10):
    with open(path, "w") as f:
        f.write(f"{prof['complete']}/{prof['total']} samples complete root-to-leaf\n")
        items = sorted(prof["values"].items(), key=lambda kv: -kv[1][1])[:top]
        for idx, v in items:
            f.write(f"{v[1]:.0f} bytes in {v[0]:.0f} allocations ({v[3]:.0f} B in use):\n")
            for pc in prof["stacks"][idx]:
                fr = prof["frames"][pc]
                loc = f" {fr['file']}:{fr['line']}" if fr["file"] else ""
                f.write(f"    {fr['name']}+0x{fr['off']:x} [{fr['module']}]{loc}\n")
