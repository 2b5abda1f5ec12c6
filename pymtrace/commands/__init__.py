"""The commands, one module each (see pymtrace.cli); here the arguments several of them share."""

import argparse


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
