"""``python -m spark_share.job``: the job's command line, as ``python -m`` ran the former job.py."""
import sys

from .command import main

sys.exit(main())
