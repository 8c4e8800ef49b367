"""The verifier (`unbroken bench`, `unbroken demo`): load, scenarios, measurement, report."""

from unbroken.bench.load import LoadConfig, LoadRun, Record
from unbroken.bench.stats import summarize

__all__ = ["LoadConfig", "LoadRun", "Record", "summarize"]
