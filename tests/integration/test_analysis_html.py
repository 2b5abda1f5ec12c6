"""`pymtrace analyze --html` drawn by headless Chromium: the page shows the totals of the
JSON report and is not blank. The report's own tests are tests/unit/test_analysis.py."""

import html
import re

import pytest
from support import synthetic
from support.cli import analyze_json
from support.clients import chromium, screenshot_colours


@pytest.fixture(scope="module")
def html_report(tmp_path_factory):
    """(the HTML report, the JSON report) of a synthetic trace."""
    d = tmp_path_factory.mktemp("html")
    trace = d / "synth.parquet"
    synthetic.write(str(trace), 30_000, 500, 4)
    out = d / "report.html"
    return out, analyze_json(trace, "--html", out)


def test_html_in_chromium_shows_the_json_totals(html_report, tmp_path):
    out, rep = html_report
    dom = html.unescape(chromium(tmp_path, "--dump-dom", out.as_uri()).decode())
    totals = re.search(r'<table class="big totals">(.*?)</table>', dom, re.S).group(1)
    cells = [c.replace(",", "") for c in re.findall(r"<td>(.*?)</td>", totals)]
    assert cells[:5] == [
        str(rep["totals"]["events"]),
        str(rep["totals"]["threads"]),
        str(rep["totals"]["requested_bytes"]),
        str(rep["live"]["peak_bytes"]),
        str(rep["never_freed"]["count"]),
    ]
    for name, c in rep["calls"].items():
        assert f"<td>{name}</td><td>{c['count']:,}</td>" in dom
    assert dom.count('class="bar"') >= 10 and 'class="area"' in dom and 'class="cell"' in dom


def test_html_screenshot_is_not_blank(html_report, tmp_path):
    out, _ = html_report
    colours, total = screenshot_colours(tmp_path, out.as_uri(), "900,1400")
    assert colours is not None and len(colours) >= 16, "too few colours: blank page?"
    white = sum(n for n, c in colours if c == (255, 255, 255))
    bars = sum(n for n, (r, g, b) in colours if b > r + 40)  # the blue bars and timeline cells
    assert white < total * 0.97 and bars > total * 0.01
