#!/usr/bin/env bash
# EMR bootstrap action (runs on every node): install spark-share from the wheel you built and uploaded.
#
#   aws emr create-cluster ... --bootstrap-actions \
#     Path=s3://<your-bucket>/spark-share/conf/emr-bootstrap.sh,Args=[s3://<your-bucket>/spark-share/spark_share-0.1.0-py3-none-any.whl]
#
# The wheel declares no PySpark: pip installs it with its requirements and leaves the cluster's own
# PySpark (Spark 4.0.2 on emr-spark-8.0.0) as it is. The optional second argument is the Python to
# install into (default python3).
set -euo pipefail
whl_uri="${1:?usage: emr-bootstrap.sh s3://<your-bucket>/spark-share/spark_share-<version>-py3-none-any.whl [python]}"
python="${2:-python3}"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
whl="$work/$(basename "$whl_uri")"
aws s3 cp --quiet "$whl_uri" "$whl"
sudo "$python" -m pip install "$whl"
