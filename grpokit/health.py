"""`grpokit.health` (docs/report.md: HealthMonitor, check_run) lives in grpokit/observe/health.py; this documented
path stays."""

from grpokit.observe.health import ALARM_TITLES, Alarm, HealthMonitor, check_run

__all__ = ["ALARM_TITLES", "Alarm", "HealthMonitor", "check_run"]
