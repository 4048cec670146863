#!/usr/bin/env bash
# EMR bootstrap action (runs on every node): install spark-share from the wheel you built and uploaded.
#
#   aws emr create-cluster ... --bootstrap-actions \
#     Path=s3://<your-bucket>/spark-share/conf/emr-bootstrap.sh,Args=[s3://<your-bucket>/spark-share/spark_share-0.1.0-py3-none-any.whl]
#
# The wheel is installed without its pyspark requirement (the cluster's own PySpark, which must be
# >= 4.2, is the one Spark uses); its other requirements are read from the wheel and installed.
set -euo pipefail
whl_uri="${1:?usage: emr-bootstrap.sh s3://<your-bucket>/spark-share/spark_share-<version>-py3-none-any.whl [python]}"
python="${2:-python3}"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
whl="$work/$(basename "$whl_uri")"
aws s3 cp --quiet "$whl_uri" "$whl"
reqs="$("$python" - "$whl" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    for line in z.read(meta).decode().splitlines():
        if line.startswith("Requires-Dist:"):
            req = line.split(":", 1)[1].strip()
            if "extra ==" not in req and not req.lower().startswith("pyspark"):
                print(req)
PY
)"
sudo "$python" -m pip install --no-deps "$whl"
mapfile -t deps <<<"$reqs"
sudo "$python" -m pip install "${deps[@]}"
