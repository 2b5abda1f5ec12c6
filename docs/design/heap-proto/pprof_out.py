"""Write the prototype's profile as gzip'd pprof profile.proto with protobuf's runtime and the
protoc-generated profile_pb2 (from pymtrace/sinks/profile.proto, which replaced the prototype's copy)."""
import gzip
import time

import profile_pb2

TYPES = (("alloc_objects", "count"), ("alloc_space", "bytes"),
         ("inuse_objects", "count"), ("inuse_space", "bytes"))


def write(prof, path, main=None):
    p = profile_pb2.Profile()
    strings = {"": 0}
    p.string_table.append("")

    def s(x):
        x = x or ""
        i = strings.get(x)
        if i is None:
            i = strings[x] = len(p.string_table)
            p.string_table.append(x)
        return i

    for t, u in TYPES:
        vt = p.sample_type.add()
        vt.type, vt.unit = s(t), s(u)
    p.period_type.type, p.period_type.unit = s("space"), s("bytes")
    p.period = prof["mean"] or 1
    p.default_sample_type = s("inuse_space")
    p.time_nanos = time.time_ns()

    mappings = {}   # (module name, build id) -> id
    functions = {}  # (name, file) -> id
    locations = {}  # pc -> id
    # the main executable's mapping first: pprof names the profile after mapping 1
    order = sorted(prof["frames"].items(),
                   key=lambda kv: not (kv[1]["mapping"] and kv[1]["mapping"][1] == main))
    for pc, fr in order:
        m = fr["mapping"]
        mid = 0
        if m:
            _, mname, lo, hi, bid = m
            key = (mname, bid)
            mid = mappings.get(key)
            if mid is None:
                mid = mappings[key] = len(p.mapping) + 1
                mp = p.mapping.add()
                mp.id, mp.memory_start, mp.memory_limit, mp.file_offset = mid, lo, hi, 0
                mp.filename, mp.build_id = s(mname), s(bid)
                mp.has_functions = mp.has_filenames = mp.has_line_numbers = True
        fkey = (fr["name"], fr["file"])
        fid = functions.get(fkey)
        if fid is None:
            fid = functions[fkey] = len(p.function) + 1
            fn = p.function.add()
            fn.id, fn.name, fn.system_name, fn.filename = fid, s(fr["name"]), s(fr["name"]), s(fr["file"])
        lid = locations[pc] = len(p.location) + 1
        loc = p.location.add()
        loc.id, loc.mapping_id, loc.address = lid, mid, pc
        ln = loc.line.add()
        ln.function_id, ln.line = fid, fr["line"] or 0

    for idx, v in prof["values"].items():
        smp = p.sample.add()
        smp.location_id.extend(locations[pc] for pc in prof["stacks"][idx])  # leaf first
        smp.value.extend(round(x) for x in v)
    with gzip.open(path, "wb") as f:
        f.write(p.SerializeToString())
