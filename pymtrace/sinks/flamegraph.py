"""`pymtrace heap --format html`: one self-contained interactive flame graph file.

d3 7.9.2 (ISC) and d3-flame-graph 5.0.0 (Apache-2.0), vendored in sinks/vendor/ as package
data, are inlined with the profile, so the file opens offline in any browser. A selector
switches between the profile's values (the four, or the two alloc ones under an overhead
budget; `FILE#alloc_space` opens on one). Frame names reach the page only as JSON data rendered with
d3's .text() (d3-flame-graph's default; its HTML tooltips are not enabled), so a hostile
symbol name cannot inject markup; the JSON escapes '<', '>' and '&' so it cannot end the
script element either.
"""

from __future__ import annotations

import html
import json
from importlib import resources
from typing import Any, BinaryIO

from pymtrace.sources.heapprofile import (
    DEFAULT_VALUE,
    VALUE_UNITS,
    FrameSource,
    HeapProfile,
    frame_label,
    frames_root_first,
)

VENDOR_FILES = ("d3.min.js", "d3-flamegraph.umd.min.js")
_LICENCES = {
    "d3.min.js": "d3 7.9.2, https://d3js.org, ISC licence (c) Mike Bostock",
    "d3-flamegraph.umd.min.js": "d3-flame-graph 5.0.0, https://github.com/spiermar/d3-flame-graph, Apache-2.0 licence (c) Martin Spier",
}


def vendored(name: str) -> str:
    """The text of the vendored file NAME (sinks/vendor/)."""
    return (resources.files("pymtrace.sinks") / "vendor" / name).read_text(encoding="utf-8")


def flame_tree(profile: HeapProfile, symbolizer: FrameSource) -> tuple[list[str], list[Any]]:
    """The stacks merged into one tree, root "all", compactly: (names, root), each node a list
    [index into names, [the profile's values, inclusive of its children, in its value_types
    order], [children]] (names repeat across the tree: the table keeps the file small)."""
    types = profile.value_types
    names: dict[str, int] = {"all": 0}
    root: list[Any] = [0, [0.0] * len(types), {}]
    for entry in profile.stacks():
        amounts = [entry.value(name) for name in types]
        node = root
        for i, amount in enumerate(amounts):
            node[1][i] += amount
        for frame in frames_root_first(entry.stack, symbolizer):
            index = names.setdefault(frame_label(frame), len(names))
            child = node[2].get(index)
            if child is None:
                child = node[2][index] = [index, [0.0] * len(types), {}]
            node = child
            for i, amount in enumerate(amounts):
                node[1][i] += amount

    def settle(node: list[Any]) -> list[Any]:
        return [node[0], [round(x) for x in node[1]], [settle(c) for c in node[2].values()]]

    return list(names), settle(root)


def _script_json(data: object) -> str:
    """DATA as JSON that is safe inside a <script> element (no '<', '>' or '&' left)."""
    text = json.dumps(data, ensure_ascii=True, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>{title}</title>
<style>
body {{ font-family: sans-serif; margin: 12px; }}
h1 {{ font-size: 1.2em; margin: 0 0 6px 0; }}
pre {{ margin: 0 0 8px 0; color: #444; }}
#details {{ min-height: 1.4em; font-family: monospace; margin-top: 4px; }}
</style>
</head><body>
<h1>{title}</h1>
<pre id="summary">{summary}</pre>
<label>value <select id="value">{options}</select></label>
<div id="chart"></div>
<div id="details"></div>
<!-- vendored, unmodified: {licence_d3}; {licence_fg}. Full licence texts: pymtrace/sinks/vendor/ -->
<script>{d3}</script>
<script>{flamegraph}</script>
<script>
"use strict";
const TYPES = {types};
const UNITS = {units};
const NAMES = {names};
const TREE = {tree};  // [index into NAMES, [values in TYPES order], [children]]
function pick(node, i) {{
  const children = [];
  for (const c of node[2]) {{ if (c[1][i] > 0) children.push(pick(c, i)); }}
  return {{ name: NAMES[node[0]], value: node[1][i], children: children }};
}}
function draw() {{
  const i = TYPES.indexOf(document.getElementById("value").value);
  const unit = UNITS[i];
  const chart = flamegraph.default()
    .width(Math.max(600, window.innerWidth - 40))
    .cellHeight(18)
    .label(d => d.data.name + " (" + d.value.toLocaleString() + " " + unit + ")")
    .setDetailsElement(document.getElementById("details"));
  const box = document.getElementById("chart");
  box.textContent = "";
  d3.select(box).datum(pick(TREE, i)).call(chart);
}}
// heap.html#alloc_space opens on that value (a link to one view)
if (TYPES.includes(location.hash.slice(1))) document.getElementById("value").value = location.hash.slice(1);
document.getElementById("value").addEventListener("change", draw);
draw();
</script>
</body></html>
"""


def render_html(profile: HeapProfile, symbolizer: FrameSource, value: str = DEFAULT_VALUE) -> str:
    """The HTML page of PROFILE, showing VALUE first."""
    types = profile.value_types
    if value not in types:
        raise ValueError(f"unknown value {value!r}; choose one of {', '.join(types)}")
    options = "".join(f'<option value="{name}"{" selected" if name == value else ""}>{name}</option>' for name in types)
    names, tree = flame_tree(profile, symbolizer)
    scripts = {}
    for name in VENDOR_FILES:
        text = vendored(name)
        if "</script" in text.lower():  # would end the inline script element early
            raise ValueError(f"vendored {name} contains '</script'")
        scripts[name] = text
    return _PAGE.format(
        title=html.escape(profile.title()),
        summary=html.escape("\n".join(profile.summary_lines())),
        options=options,
        licence_d3=_LICENCES["d3.min.js"],
        licence_fg=_LICENCES["d3-flamegraph.umd.min.js"],
        d3=scripts["d3.min.js"],
        flamegraph=scripts["d3-flamegraph.umd.min.js"],
        types=_script_json(list(types)),
        units=_script_json([VALUE_UNITS[name] for name in types]),
        names=_script_json(names),
        tree=_script_json(tree),
    )


def write_html(profile: HeapProfile, symbolizer: FrameSource, out: BinaryIO, value: str = DEFAULT_VALUE) -> None:
    """Write PROFILE as one self-contained HTML flame graph to the binary file OUT."""
    out.write(render_html(profile, symbolizer, value).encode("utf-8"))
