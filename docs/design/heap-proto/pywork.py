import json, time, sys
time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 1.0)
def rec(d):
    return {k: [rec(v) if isinstance(v, dict) else str(v) * 3 for _ in range(3)] for k, v in d.items()} if d else {}
data = {f"k{i}": {f"j{j}": j for j in range(20)} for i in range(200)}
for i in range(30):
    s = json.dumps(rec(data)); json.loads(s)
print("py done")
