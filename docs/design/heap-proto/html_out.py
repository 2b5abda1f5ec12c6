"""One self-contained interactive flame graph HTML file: d3 (ISC) + d3-flame-graph (Apache-2.0),
both from npm, inlined with their licence headers; the profile inlined as JSON.  Works offline.
Names reach the page only through JSON and are rendered with .text()/textContent by
d3-flame-graph (its defaults), never as HTML."""
import html
import json
import os

VENDOR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vendor")


def tree(prof, value=3):
    root = {"name": "all", "value": 0, "children": {}}
    for idx, v in prof["values"].items():
        val = round(v[value])
        if val <= 0:
            continue
        node = root
        node["value"] += val
        for pc in reversed(prof["stacks"][idx]):   # root first
            name = prof["frames"][pc]["name"]
            node = node["children"].setdefault(name, {"name": name, "value": 0, "children": {}})
            node["value"] += val

    def fix(n):
        return {"name": n["name"], "value": n["value"], "children": [fix(c) for c in n["children"].values()]}
    return fix(root)


def _script(text):
    return text.replace("</script", "<\\/script")


def write(prof, path, title="pymtrace heap: in-use bytes", value=3):
    d3 = open(os.path.join(VENDOR, "d3.min.js")).read()
    fg = open(os.path.join(VENDOR, "d3-flamegraph.umd.min.js")).read()
    data = json.dumps(tree(prof, value)).replace("</", "<\\/")
    page = f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:10px}} #details{{min-height:1.5em;font-family:monospace}}</style>
</head><body>
<h3>{html.escape(title)}</h3><div id="chart"></div><div id="details"></div>
<script>/* d3 v7, ISC licence, https://d3js.org */
{_script(d3)}</script>
<script>/* d3-flame-graph 5.0.0, Apache-2.0 licence, (c) Martin Spier */
{_script(fg)}</script>
<script>
const data = {data};
const chart = flamegraph.default().width(Math.max(600, window.innerWidth - 40)).cellHeight(18)
  .label(d => d.data.name + " (" + d.value.toLocaleString() + " bytes)")
  .setDetailsElement(document.getElementById("details"));
d3.select("#chart").datum(data).call(chart);
</script></body></html>
"""
    with open(path, "w") as f:
        f.write(page)
