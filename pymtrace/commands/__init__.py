"""The commands, one module each (see pymtrace.cli); here the arguments several of them share."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Iterable

from pymtrace.errors import PymtraceError

if TYPE_CHECKING:
    from pymtrace.sources.budget import Budget


def add_report_arguments(parser: argparse.ArgumentParser) -> None:
    """The report options run and summary share (sinks.run_report.ReportOptions, and --no-faults)."""
    parser.add_argument("--json", action="store_true", help="print the report as one JSON document")
    parser.add_argument("--no-faults", action="store_true", help="do not trace page faults (no fault table)")
    parser.add_argument("-o", "--output", metavar="FILE", help="write the report to FILE")


DEFAULT_WINDOW = 1.0  # = sources.budget.DEFAULT_WINDOW (not imported: that module is loaded only when used)


def add_budget_arguments(parser: argparse.ArgumentParser, max_overhead_help: str, window_help: str) -> None:
    """--max-overhead PCT and --window SECONDS (sources.budget.Budget), as top, heap and the
    exporter take them; each command says what they mean for it."""
    parser.add_argument("--max-overhead", type=float, metavar="PCT", help=max_overhead_help)
    parser.add_argument(
        "--window",
        type=float,
        default=DEFAULT_WINDOW,
        metavar="SECONDS",
        help=f"{window_help} (default {DEFAULT_WINDOW:g})",
    )


def budget_of(args: argparse.Namespace, refusals: Iterable[tuple[object, str]] = ()) -> Budget | None:
    """--max-overhead's budget (checked), or None without it (then --window is refused); the
    first of REFUSALS, (condition, message) pairs, whose condition holds is the error: the
    options a command cannot run under a budget."""
    if args.max_overhead is None:
        if args.window != DEFAULT_WINDOW:
            raise PymtraceError("--window needs --max-overhead")
        return None
    for refused, message in refusals:
        if refused:
            raise PymtraceError(message)
    from pymtrace.sources.budget import Budget  # loaded only when a budget is asked for

    budget = Budget(args.max_overhead, args.window)
    budget.check()
    return budget
