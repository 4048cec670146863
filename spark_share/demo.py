"""``spark-share demo``: the scheduled job (``jobs/queue_to_table.py``) on the embedded broker."""
from __future__ import annotations


def main(argv=None) -> int:
    from .job.command import main as job_main

    return job_main(argv, prog="spark-share demo")
