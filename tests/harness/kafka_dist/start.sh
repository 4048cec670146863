#!/usr/bin/env bash
# Starts one node of Apache Kafka >= 4.2 (KRaft, broker and controller in one process) from the
# distribution unpacked at $KAFKA_HOME, with the broker settings the test suite needs; prints the
# bootstrap address as its last line once the broker listens. The harness (tests/harness/kafka_kit.py)
# calls it for each node it starts; by hand:
#
#   KAFKA_HOME=~/kafka_2.13-4.2.1 DATA_DIR=/tmp/k1 PORT=19092 CONTROLLER_PORT=19093 tests/harness/kafka_dist/start.sh
#
# Environment: KAFKA_HOME (required), DATA_DIR, PORT, CONTROLLER_PORT (required), NODE_ID (1),
# CLUSTER_ID (a new one when the data directory is formatted), HEAP (768M), EXTRA_PROPS (k=v lines,
# after ours: the later line of a key wins), EXTRA_PROPS_FILE (a properties file, last),
# FORMAT_ARGS (more arguments of `kafka-storage.sh format`, the first start only, e.g. --add-scram ...).
# The data directory is formatted on the first start only, so a restart keeps topics, records and
# share-group state. The broker's pid goes to $DATA_DIR/kafka.pid (stop.sh beside this file stops it;
# the harness kills it with SIGKILL by that file); its output to $DATA_DIR/server.out.
set -euo pipefail

die() { echo "kafka_dist/start.sh: $*" >&2; exit 1; }

[ -n "${KAFKA_HOME:-}" ] || die "set KAFKA_HOME to an unpacked Apache Kafka >= 4.2 distribution (the directory with bin/ and libs/)"
for tool in kafka-storage.sh kafka-server-start.sh; do
    [ -x "$KAFKA_HOME/bin/$tool" ] || die "KAFKA_HOME=$KAFKA_HOME has no bin/$tool: not an Apache Kafka distribution"
done
: "${DATA_DIR:?DATA_DIR, the data directory of the node}" "${PORT:?PORT: the client port}" "${CONTROLLER_PORT:?CONTROLLER_PORT}"
NODE_ID="${NODE_ID:-1}"
HEAP="${HEAP:-768M}"

# Share groups are generally available from Kafka 4.2 (4.1 rejects member ids librdkafka makes).
jar="$(ls "$KAFKA_HOME"/libs/kafka-clients-*.jar 2>/dev/null | head -n 1 || true)"
version="${jar##*/kafka-clients-}"; version="${version%.jar}"
if [[ "$version" =~ ^([0-9]+)\.([0-9]+) ]]; then
    major="${BASH_REMATCH[1]}"; minor="${BASH_REMATCH[2]}"
    if [ "$major" -lt 4 ] || { [ "$major" -eq 4 ] && [ "$minor" -lt 2 ]; }; then
        die "KAFKA_HOME=$KAFKA_HOME is Kafka $version; spark-share needs Kafka >= 4.2 (share groups)"
    fi
fi

mkdir -p "$DATA_DIR"
props="$DATA_DIR/server.properties"
{
    echo "process.roles=broker,controller"
    echo "node.id=$NODE_ID"
    echo "controller.quorum.voters=$NODE_ID@127.0.0.1:$CONTROLLER_PORT"
    echo "listeners=PLAINTEXT://127.0.0.1:$PORT,CONTROLLER://127.0.0.1:$CONTROLLER_PORT"
    echo "advertised.listeners=PLAINTEXT://127.0.0.1:$PORT"
    echo "controller.listener.names=CONTROLLER"
    echo "inter.broker.listener.name=PLAINTEXT"
    echo "listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT"
    echo "log.dirs=$DATA_DIR/logs"
    echo "num.partitions=1"
    echo "offsets.topic.replication.factor=1"
    echo "transaction.state.log.replication.factor=1"
    echo "transaction.state.log.min.isr=1"
    echo "share.coordinator.state.topic.replication.factor=1"
    echo "share.coordinator.state.topic.min.isr=1"
    echo "group.initial.rebalance.delay.ms=0"
    if [ -n "${EXTRA_PROPS:-}" ]; then printf '%s\n' "$EXTRA_PROPS"; fi
    if [ -n "${EXTRA_PROPS_FILE:-}" ]; then cat "$EXTRA_PROPS_FILE"; echo; fi
} > "$props"

if [ ! -f "$DATA_DIR/logs/meta.properties" ]; then
    cluster_id="${CLUSTER_ID:-$("$KAFKA_HOME/bin/kafka-storage.sh" random-uuid)}"
    read -r -a more <<< "${FORMAT_ARGS:-}"   # split on blanks, never globbed ([name=...] stays as it is)
    "$KAFKA_HOME/bin/kafka-storage.sh" format -t "$cluster_id" -c "$props" "${more[@]}" > "$DATA_DIR/format.out" 2>&1 \
        || die "kafka-storage.sh format failed for $DATA_DIR: $(tail -n 5 "$DATA_DIR/format.out")"
fi

# kafka-server-start.sh execs kafka-run-class.sh, which execs java: $! is the broker's pid.
LOG_DIR="$DATA_DIR/app-logs" KAFKA_HEAP_OPTS="-Xms$HEAP -Xmx$HEAP" \
    nohup "$KAFKA_HOME/bin/kafka-server-start.sh" "$props" > "$DATA_DIR/server.out" 2>&1 < /dev/null &
pid=$!
echo "$pid" > "$DATA_DIR/kafka.pid"

deadline=$((SECONDS + ${START_WAIT_S:-90}))
until (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null; do
    kill -0 "$pid" 2>/dev/null || die "the broker exited before it listened on $PORT: $(tail -n 20 "$DATA_DIR/server.out")"
    [ "$SECONDS" -lt "$deadline" ] || die "the broker did not listen on 127.0.0.1:$PORT within ${START_WAIT_S:-90} s: $(tail -n 20 "$DATA_DIR/server.out")"
    sleep 0.2
done
echo "127.0.0.1:$PORT"
