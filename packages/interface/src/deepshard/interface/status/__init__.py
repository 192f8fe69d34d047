"""What DeepShard runs today, as data: one table of packages, one of config features.

The engine refuses what a config asks for that is ``planned`` and reports what it accepts but
ignores; the README, the docs index and the config reference are generated from the same
tables (``tools/status_tables.py``), so the documentation cannot claim more than the code does.
Torch-free, like the rest of `deepshard.interface`.
"""

from deepshard.interface.status._features import FEATURES
from deepshard.interface.status._model import FeatureStatus, PackageStatus, When
from deepshard.interface.status._packages import PACKAGES
from deepshard.interface.status._query import (
    asked_features,
    ignored_keys,
    planned_problems,
    status_of,
)

__all__ = [
    "FEATURES",
    "PACKAGES",
    "FeatureStatus",
    "PackageStatus",
    "When",
    "asked_features",
    "ignored_keys",
    "planned_problems",
    "status_of",
]
