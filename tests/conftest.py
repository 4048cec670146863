"""The real pass (``./dev test`` runs the suite on the embedded broker, then on a real Kafka) runs the
integration tests only: the unit tests need no broker and ran in the embedded pass."""
from __future__ import annotations

import os
from pathlib import Path

UNIT = Path(__file__).parent / "unit"


def pytest_ignore_collect(collection_path: Path, config):
    if os.environ.get("SPARK_SHARE_TEST_REAL_PASS") and UNIT in (collection_path, *collection_path.parents):
        return True
    return None
