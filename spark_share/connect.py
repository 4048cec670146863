"""What spark-share needs to know of Spark Connect, in one place.

Under Connect (Databricks serverless, standard access mode, ``start-connect-server.sh``) the user's
process is a client without a SparkContext, foreachBatch runs in a Python process the server starts
on the driver host, and the Spark jobs that function triggers carry neither the query id nor the
batch id as local properties. What they carry is the job tag of the Connect session that runs the
batch (one cloned session per query run, ``batch.sparkSession.session_id`` in foreachBatch): that
session id is how read tasks and ``reject()`` name the batch, and how the tracker matches them.

Owns: telling a Connect session from a classic one, reading the Connect session id of a task's job,
knowing whether this process is the server's foreachBatch worker, and installing a listener on the
server (where it runs next to the tracker, not in a client that may be on another machine).

Must never: import grpc or Connect modules unless the session is a Connect one (classic users need
not install pyspark's connect extra).
"""
from __future__ import annotations

import re
import sys
import uuid

# ExecuteJobTag: SparkConnect_OperationTag_User_<user>_Session_<session id>_Operation_<operation id>
_SESSION_TAG = re.compile(r"SparkConnect_OperationTag_User_.*?_Session_([0-9a-fA-F-]{36})_Operation_")
FOREACH_BATCH_WORKER = "pyspark.sql.connect.streaming.worker.foreach_batch_worker"

_listeners_installed: set[str] = set()


def is_connect(spark) -> bool:
    """Is ``spark`` (a session, or a query) a Spark Connect one?"""
    return type(spark).__module__.startswith("pyspark.sql.connect")


def active_session():
    """The active Spark Connect session of this thread, if Connect is in use in this process."""
    module = sys.modules.get("pyspark.sql.connect.session")
    return module.SparkSession.getActiveSession() if module is not None else None


def session_of_job_tags(tags: str | None) -> str | None:
    """The Connect session id in a task's ``spark.job.tags`` (None for jobs not run through Connect)."""
    m = _SESSION_TAG.search(tags or "")
    return m.group(1) if m else None


def in_foreach_batch_worker() -> bool:
    """Is this the Python process a Connect server runs foreachBatch functions in?"""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return (getattr(spec, "name", "") or "") == FOREACH_BATCH_WORKER


def install_server_listener(spark, listener) -> bool:
    """Run ``listener`` (a StreamingQueryListener importable by reference) on the Connect server, in a
    Python process the server starts on the driver host, once per client session. The 4.x client's
    own ``addListener`` runs callbacks in the client; the server still accepts this form (Spark
    3.5's). False when the server refused it."""
    if spark.session_id in _listeners_installed:
        return True
    from pyspark.serializers import CloudPickleSerializer
    from pyspark.sql.connect import proto
    from pyspark.sql.connect.utils import get_python_ver

    cmd = proto.Command()
    add = cmd.streaming_query_manager_command.add_listener
    add.python_listener_payload.command = CloudPickleSerializer().dumps(listener)
    add.python_listener_payload.python_ver = get_python_ver()
    add.id = uuid.uuid4().hex
    try:
        spark.client.execute_command(cmd)
    except Exception:
        return False
    _listeners_installed.add(spark.session_id)
    return True
