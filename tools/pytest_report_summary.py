"""Summarise a pytest-reportlog file (``tools/gpu_check.sh`` writes one as the tests run): counts,
each failure with the end of its traceback, and the slowest tests.

    python tools/pytest_report_summary.py gpu-check/tests.jsonl

The log holds every test that finished, also when the run was cut off by a time limit, so this
says what failed even where pytest never printed its own summary.
"""

from __future__ import annotations

import argparse
import collections
import json

from _pytest.reports import TestReport  # rebuilds a report from its JSON form, as pytest-xdist does

TRACEBACK_LINES = 30


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log", help="the file pytest's --report-log wrote")
    parser.add_argument("--slowest", type=int, default=15, help="how many of the slowest tests to list")
    args = parser.parse_args(argv)

    reports = []
    with open(args.log) as lines:
        for line in lines:
            data = json.loads(line)
            if data.get("$report_type") == "TestReport":
                # Under pytest-xdist, "node" is the worker's name as a string, which pytest's own
                # rendering of a failure would take for the worker object ("worker_id" stays).
                data.pop("node", None)
                reports.append(TestReport._from_json(data))

    outcomes = collections.Counter()
    durations = collections.Counter()
    problems = []
    for report in reports:
        durations[report.nodeid] += report.duration
        if report.when == "call" or report.outcome != "passed":  # a setup failure is an error, a skip is decided there
            outcomes["error" if report.failed and report.when != "call" else report.outcome] += 1
        if report.failed:
            problems.append(report)

    print("tests finished: " + ", ".join(f"{count} {outcome}" for outcome, count in sorted(outcomes.items())))
    for report in problems:
        kind = "FAILED" if report.when == "call" else f"ERROR in {report.when}"
        print(f"\n== {kind}: {report.nodeid}")
        print("\n".join(report.longreprtext.splitlines()[-TRACEBACK_LINES:]))
    print(f"\n== slowest {args.slowest} (setup + call + teardown)")
    for nodeid, seconds in durations.most_common(args.slowest):
        print(f"{seconds:8.1f} s  {nodeid}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
