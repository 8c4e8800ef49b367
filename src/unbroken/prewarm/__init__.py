"""Page-cache pre-warming and residency of weight files (`unbroken prewarm`)."""

from unbroken.prewarm.files import PrewarmError, find_weight_files
from unbroken.prewarm.reader import ReadStats, warm_files
from unbroken.prewarm.residency import evict, memory_available, residency

__all__ = [
    "PrewarmError",
    "ReadStats",
    "evict",
    "find_weight_files",
    "memory_available",
    "residency",
    "warm_files",
]
