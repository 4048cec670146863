"""One error hierarchy, and our own errors keep their class across a socket."""
import pytest

import spark_share
from spark_share import errors
from spark_share.transport import wire


def test_every_error_has_the_common_base_and_its_builtin_parent():
    assert issubclass(spark_share.OptionError, ValueError) and issubclass(spark_share.ConfigError, ValueError)
    for cls in (spark_share.SourceError, spark_share.BatchRefused, spark_share.VerdictError,
                spark_share.DeadLetterError, spark_share.EmbeddedKafkaError, spark_share.RemoteError):
        assert issubclass(cls, RuntimeError)
    assert issubclass(spark_share.AuthError, ConnectionError)
    for name in spark_share.__all__:
        obj = getattr(spark_share, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, spark_share.SparkShareError), name
    from spark_share.options import OptionError
    from spark_share.user.verdicts import VerdictError
    assert OptionError is errors.OptionError and VerdictError is errors.VerdictError


def test_our_errors_cross_a_socket_as_themselves_others_as_remote_error(tmp_path):
    def handler(conn, header, blob):
        if header["op"] == "refused":
            raise errors.BatchRefused("batch 3 is already committed")
        raise KeyError("nothing here")

    server = wire.RpcServer(str(tmp_path / "s.sock"), "k" * 64, handler)
    conn = wire.connect(server.address, "k" * 64)
    try:
        with pytest.raises(errors.BatchRefused) as e:
            conn.call({"op": "refused"}, timeout=5)
        assert str(e.value) == "batch 3 is already committed"
        with pytest.raises(errors.RemoteError, match="KeyError: 'nothing here'"):
            conn.call({"op": "other"}, timeout=5)
    finally:
        conn.close()
        server.close()
