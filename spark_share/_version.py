"""The version of spark-share: the one place it is written. ``pyproject.toml`` reads it
(``[tool.setuptools.dynamic]``) for the wheel's metadata; ``spark_share.__version__`` and
``spark-share --version`` import it, so an editable install and a wheel say the same."""
from __future__ import annotations

__version__ = "0.1.0"
