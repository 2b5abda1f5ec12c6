"""The commands, one module each (see pymtrace.cli); here the arguments several of them share."""

import argparse


def add_report_arguments(parser: argparse.ArgumentParser) -> None:
    """The report options run and summary share (sinks.run_report.ReportOptions, and --no-faults)."""
    parser.add_argument("--json", action="store_true", help="print the report as one JSON document")
    parser.add_argument("--no-faults", action="store_true", help="do not trace page faults (no fault table)")
    parser.add_argument("-o", "--output", metavar="FILE", help="write the report to FILE")
