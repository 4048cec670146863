"""A secured listener as production clusters have: SASL_SSL with SCRAM-SHA-512 on a broker of the kit
(tests/harness/kafka_kit.py; the harness makes the CA, the broker's certificate and the SCRAM users). The whole
stream works with the ``kafka.*`` security options (share consumers, the tracker's admin and metadata
clients, the dead-letter producer); a wrong password, an unknown user and a missing CA each fail within
seconds, saying which; no secret reaches a log, the progress, the status, a checkpoint file or an error."""
from __future__ import annotations

import glob
import json
import os
import subprocess
import time

import pytest

import spark_share
from harness.brokers import ExternalKafka
from harness.kafka_kit import KitCluster, free_ports
from harness.support import Workload, agent_files, check_no_loss, gid, id_col, read_stream, tracker_log, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.real_only("starts a SASL_SSL broker of the kit")]

PASSWORD = "alice-Pa55-" + os.urandom(4).hex()
ADMIN_PASSWORD = "admin-Pa55-" + os.urandom(4).hex()


def _run(*argv: str, cwd: str) -> None:
    out = subprocess.run(list(argv), cwd=cwd, capture_output=True, text=True)
    assert out.returncode == 0, f"{' '.join(argv[:3])} failed: {out.stderr[-2000:]}"


def _make_certificates(d: str) -> None:
    """A CA and the broker's certificate for 127.0.0.1 (librdkafka checks the host name), as PKCS12."""
    _run("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
         "-days", "2", "-subj", "/CN=spark-share-test-ca", "-addext", "basicConstraints=critical,CA:TRUE",
         "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=d)
    _run("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
         "-subj", "/CN=127.0.0.1", cwd=d)
    with open(os.path.join(d, "ext.cnf"), "w") as f:
        f.write("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _run("openssl", "x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
         "-out", "server.pem", "-days", "2", "-extfile", "ext.cnf", cwd=d)
    _run("openssl", "pkcs12", "-export", "-in", "server.pem", "-inkey", "server.key", "-certfile", "ca.pem",
         "-name", "broker", "-out", "server.p12", "-passout", "pass:changeit", cwd=d)
    _run("keytool", "-importcert", "-noprompt", "-alias", "ca", "-file", "ca.pem", "-keystore", "truststore.p12",
         "-storetype", "PKCS12", "-storepass", "changeit", cwd=d)


@pytest.fixture(scope="module")
def secured(broker_choice, tmp_path_factory):
    """A single SASL_SSL broker (SCRAM-SHA-512; users admin and alice) and the client options of alice."""
    if broker_choice.start_script is None:
        pytest.skip("starts its own SASL_SSL broker: needs SPARK_SHARE_TEST_KAFKA_START")
    d = str(tmp_path_factory.mktemp("tls"))
    _make_certificates(d)
    port, controller = free_ports(2)
    props = os.path.join(d, "sasl.properties")
    with open(props, "w") as f:
        f.write(f"""listeners=SASL_SSL://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller}
advertised.listeners=SASL_SSL://127.0.0.1:{port}
listener.security.protocol.map=CONTROLLER:PLAINTEXT,SASL_SSL:SASL_SSL
inter.broker.listener.name=SASL_SSL
sasl.enabled.mechanisms=SCRAM-SHA-512
sasl.mechanism.inter.broker.protocol=SCRAM-SHA-512
listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required username="admin" password="{ADMIN_PASSWORD}";
ssl.keystore.type=PKCS12
ssl.keystore.location={d}/server.p12
ssl.keystore.password=changeit
ssl.key.password=changeit
ssl.truststore.type=PKCS12
ssl.truststore.location={d}/truststore.p12
ssl.truststore.password=changeit
""")
    users = (f"--add-scram SCRAM-SHA-512=[name=admin,password={ADMIN_PASSWORD}] "
             f"--add-scram SCRAM-SHA-512=[name=alice,password={PASSWORD}]")
    kit = KitCluster(broker_choice.start_script, props_file=props, format_args=users, heap="512M",
                     ports=(port, controller))
    kit.start()
    options = {"security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-512", "sasl.username": "alice",
               "sasl.password": PASSWORD, "ssl.ca.location": os.path.join(d, "ca.pem")}
    try:
        yield kit.bootstrap_servers, options
    finally:
        kit.close()


@pytest.fixture
def skafka(secured):
    bootstrap, options = secured
    with ExternalKafka(bootstrap, options) as cluster:
        yield cluster


def _leaks(texts: list[str]) -> list[str]:
    return [t[:200] for t in texts if PASSWORD in t or ADMIN_PASSWORD in t]


def test_a_stream_over_sasl_ssl_works_and_no_secret_leaks(spark, skafka, tmp_path):
    """AvailableNow over SASL_SSL: every record arrives; the poison ones go to a dead-letter topic (the
    producer authenticates too); the password is in no log, progress, status, checkpoint file or error."""
    w = Workload(skafka, "secure", partitions=2)
    w.produce(400)
    dlt = skafka.create_topic("secure-dlt", 1)
    seen: list[int] = []
    statuses: list[str] = []

    def process(df, batch_id):
        ids = df.select(id_col().alias("id"), "topic", "partition", "offset")
        bad = ids.where("id % 100 = 7")
        spark_share.reject(bad, reason="test poison")
        seen.extend(r[0] for r in ids.where("id % 100 != 7").collect())

    def status_while_running() -> bool:
        if q.isActive:
            try:
                statuses.append(json.dumps(spark_share.status(q)))
            except Exception as e:  # before the tracker registered, or as the query ends: kept as text
                statuses.append(f"{type(e).__name__}: {e}")
        return not q.isActive

    ckpt = str(tmp_path / "ck")
    q = (read_stream(spark, skafka, skafka.group(gid()), w.topic, deadLetterTopic=dlt).writeStream
         .foreachBatch(process).option("checkpointLocation", ckpt).trigger(availableNow=True).start())
    wait_until(status_while_running, timeout=180, interval=0.5, message="the AvailableNow run did not end")
    assert q.exception() is None
    assert any(s.startswith("{") for s in statuses), f"status() never answered while the query ran: {statuses}"
    rejected = [i for i in w.ids if i % 100 == 7]
    check_no_loss(w.ids, seen, rejected)
    texts = [tracker_log(q), json.dumps([json.loads(p.json) for p in q.recentProgress]), *statuses]
    for path in glob.glob(os.path.join(ckpt, "**", "*"), recursive=True):
        if os.path.isfile(path):
            texts.append(open(path, errors="replace").read())
    from spark_share.runtime import runtime_dir

    logs = glob.glob(os.path.join(runtime_dir(), "*.log")) + agent_files(spark, "agent-*.log")
    assert any(os.path.basename(p).startswith("agent-") for p in logs), "no agent log was searched"
    for path in logs:
        texts.append(open(path, errors="replace").read())
    assert not _leaks(texts)


@pytest.mark.parametrize("case", ["wrong password", "unknown user", "no CA"])
def test_bad_credentials_fail_within_seconds_saying_which(spark, skafka, secured, case, tmp_path):
    topic = skafka.create_topic("auth", 1)
    bootstrap, good = secured
    options = dict(good)
    if case == "wrong password":
        options["sasl.password"] = "not-" + PASSWORD
    elif case == "unknown user":
        options["sasl.username"] = "mallory"
    else:
        del options["ssl.ca.location"]
    reader = spark.readStream.format("kafka-share").option("kafka.bootstrap.servers", bootstrap)
    for k, v in options.items():
        reader = reader.option(f"kafka.{k}", v)
    df = reader.option("kafka.group.id", gid()).option("subscribe", topic).load()
    t0 = time.monotonic()
    q = df.writeStream.format("noop").option("checkpointLocation", str(tmp_path / "ck")).start()
    with pytest.raises(Exception) as failed:
        q.awaitTermination(60)
    took = time.monotonic() - t0
    text = str(failed.value)
    print(f"{case}: failed after {took:.1f} s: {text[text.find('spark-share') if 'spark-share' in text else 0:][:300]}")
    assert bootstrap in text
    if case == "no CA":
        assert "TLS with the Kafka cluster" in text and "ssl.ca.location" in text, text[-2000:]
    else:
        user = "mallory" if case == "unknown user" else "alice"
        assert f"authentication to the Kafka cluster at kafka.bootstrap.servers='{bootstrap}' failed for user " \
               f"'{user}' with SCRAM-SHA-512" in text, text[-2000:]
    assert PASSWORD not in text and ADMIN_PASSWORD not in text
    assert took < 15, f"took {took:.1f} s"
