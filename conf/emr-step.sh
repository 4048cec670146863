#!/usr/bin/env bash
# EMR step (conf/emr-step.json runs it on the master node): run jobs/queue_to_table.py with conf/emr.json.
#
#   bash emr-step.sh s3://<your-bucket>/spark-share [secret-id]
#
# Expects, under the S3 prefix: jobs/queue_to_table.py and conf/emr.json (copied from this repository),
# and spark-share installed on every node (conf/emr-bootstrap.sh). The Kafka credentials come from the
# AWS Secrets Manager secret <secret-id> (default spark-share/kafka: a JSON object with the keys
# bootstrap_servers, username and password) into the environment of the driver, where conf/emr.json
# reads them (${env:KAFKA_BOOTSTRAP_SERVERS}, ${env:KAFKA_USERNAME}, ${env:KAFKA_PASSWORD}).
# They are never written to a file or put on a command line; that is why the driver runs here
# (client mode, it inherits this environment) rather than in a YARN container (cluster mode would
# need the values on the spark-submit command line, as spark.yarn.appMasterEnv.*).
set -euo pipefail
prefix="${1:?usage: emr-step.sh s3://<your-bucket>/spark-share [secret-id]}"
secret_id="${2:-spark-share/kafka}"
prefix="${prefix%/}"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
aws s3 cp --quiet "$prefix/jobs/queue_to_table.py" "$work/queue_to_table.py"
aws s3 cp --quiet "$prefix/conf/emr.json" "$work/emr.json"

secret_json="$(aws secretsmanager get-secret-value --secret-id "$secret_id" --query SecretString --output text)"
field() { python3 -c 'import json, sys; print(json.load(sys.stdin)[sys.argv[1]])' "$1" <<<"$secret_json"; }
KAFKA_BOOTSTRAP_SERVERS="$(field bootstrap_servers)"
KAFKA_USERNAME="$(field username)"
KAFKA_PASSWORD="$(field password)"
export KAFKA_BOOTSTRAP_SERVERS KAFKA_USERNAME KAFKA_PASSWORD
unset secret_json

spark-submit --deploy-mode client \
  --conf spark.executorEnv.SPARK_SHARE_RUNTIME_DIR=/mnt/tmp/spark-share \
  "$work/queue_to_table.py" --config "$work/emr.json"
