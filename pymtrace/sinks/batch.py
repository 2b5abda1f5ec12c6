"""`pymtrace top --batch` and `--json`: one report per interval on stdout, from two snapshots
(plain tables like `top -b`, or one JSON document holding the views and the raw snapshot)."""

import json
import sys
import time
from dataclasses import dataclass
from typing import List, Optional

from pymtrace.sinks import views
from pymtrace.sinks.text import printable


@dataclass(frozen=True)
class BatchOptions:
    """How top reports without its full screen: every INTERVAL seconds, as one JSON document
    (JSON) or as plain tables of at most LIMIT rows (0: all)."""

    interval: float
    json: bool = False
    limit: int = 0


class Reporter:
    """Formats one interval for --batch or --json as OPTIONS say; WANTED: the view names to
    print (views.VIEWS and "totals"); PIDS: the watched processes (their rows only in
    per-process views), or empty for every process."""

    def __init__(self, options: BatchOptions, wanted: List[str], pids: List[int]):
        self.options = options
        self.wanted = wanted
        self.pids = pids
        self.iteration = 0

    def warm_up(self) -> None:
        """Import what report() needs (tabulate: ~40 ms, most of it importlib.metadata), so
        that top calls it while waiting for its first report rather than after."""
        if not self.options.json:
            import tabulate  # noqa: F401

    def report(self, prev: Optional[views.Snap], cur: views.Snap) -> None:
        self.iteration += 1
        tables = {}
        for name in self.wanted:
            if name == "totals":
                continue
            table = views.build(name, prev, cur, interval=self.options.interval)
            if self.pids:
                self._filter(table)
            tables[name] = table
        if self.options.json:
            doc = {
                "iteration": self.iteration,
                "time": cur.get("time"),
                "wall_time": time.time(),
                "interval": tables[next(iter(tables))].interval if tables else self.options.interval,
                "pids": self.pids,
                "views": {name: views.to_json(t) for name, t in tables.items()},
                "snapshot": cur,
            }
            if "totals" in self.wanted:
                keys = [k for k, _ in views.TOTAL_COLUMNS]
                doc["views"]["totals"] = {
                    "view": "totals",
                    "columns": keys,
                    "rows": [dict(zip(keys, r)) for r in views.totals_rows(cur, self.pids)],
                    "estimated": bool(cur.get("budget")),  # --max-overhead: estimates, not exact counts
                }
            sys.stdout.write(json.dumps(doc, default=str) + "\n")
        else:
            from tabulate import tabulate

            out = [
                f"pymtrace top - {time.strftime('%H:%M:%S')}  iteration {self.iteration}"
                f"  interval {self.options.interval:g}s"
                + (f"  pids {','.join(map(str, self.pids))}" if self.pids else "  all processes")
            ]
            for name in self.wanted:
                if name == "totals":
                    rows = views.totals_rows(cur, self.pids)
                    out.append(
                        "== since attach (ESTIMATED counts under --max-overhead; live bytes not measured)"
                        if cur.get("budget")
                        else "== since attach (exact counts, bytes)"
                    )
                    out.append(
                        tabulate(
                            views.printable_rows(rows[: self.options.limit or None]),
                            headers=[t for _, t in views.TOTAL_COLUMNS],
                            tablefmt="simple",
                            disable_numparse=True,
                        )
                        if rows
                        else "(no activity)"
                    )
                    continue
                table = tables[name]
                if self.options.limit:
                    table.rows = table.rows[: self.options.limit]
                    if table.groups:
                        table.groups = table.groups[: self.options.limit]
                        table.leaders = table.leaders[: self.options.limit]
                out.append(views.text_table(table))
            errors = cur.get("errors")
            if errors:
                out.extend(f"note: {k}: {v}" for k, v in sorted(errors.items()))
            sys.stdout.write(printable("\n\n".join(out), keep="\n") + "\n\n")  # the errors' names too
        sys.stdout.flush()

    def _filter(self, table: views.Table) -> None:
        """Keep only rows of the watched PIDs in per-process views (slab is system-wide)."""
        try:
            i = table.column_index("pid")
        except KeyError:
            return
        keep = [k for k, r in enumerate(table.rows) if r[i] in self.pids or r[i] in ("", None)]
        table.rows = [table.rows[k] for k in keep]
        if table.groups:
            table.groups = [table.groups[k] for k in keep]
            table.leaders = [table.leaders[k] for k in keep] if table.leaders else None
