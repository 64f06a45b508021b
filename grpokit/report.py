"""`grpokit.report.write_report` (docs/report.md) lives in grpokit/observe/report.py; this documented path stays."""

from grpokit.observe.report import write_report

__all__ = ["write_report"]
