"""A Spark standalone cluster whose driver and workers are separate "hosts" on this machine.

A host is a network namespace (its own address on a bridge, its own ports and loopback) entered
together with a UTS namespace (its own hostname) and a mount namespace (its own ``/tmp``, so
spark-share's runtime directory, agents and logs are per host, as on real machines; the Spark workers and
their executors see a read-only root file system besides, writable only under /tmp and the shared
directory, as executor pods often do; a driver program a test starts on a worker host does not). The embedded
broker stays in the test's process; socat makes each of its ports reachable at the same
``127.0.0.1:port`` on every host (the address the broker advertises). A directory outside ``/tmp``
plays the shared filesystem (sink, checkpoint, dead letters, the driver program's results).

Owns: the bridge, the namespaces, the forwarders, the master and the workers, and stopping every
process it started (a host's processes are found by its network namespace, so executors, Python
workers and agents go too). Needs root (``ip netns``, ``unshare``) and socat; without them it fails
saying so. Sends traffic only to loopback and to the namespaces' addresses.

By hand (what the fixture does), e.g. for a driver host and one worker::

    ip link add ssb0 type bridge && ip addr add 10.231.7.1/24 dev ssb0 && ip link set ssb0 up
    ip netns add ss-w1 && ip link add ssv1 type veth peer name eth0 netns ss-w1
    ip link set ssv1 master ssb0 up && ip -n ss-w1 addr add 10.231.7.11/24 dev eth0
    ip -n ss-w1 link set eth0 up && ip -n ss-w1 link set lo up
    ip netns exec ss-w1 unshare --uts --mount --propagation private \\
        sh -c 'hostname w1; mount -t tmpfs tmpfs /tmp; exec $SPARK_HOME/bin/spark-class \\
               org.apache.spark.deploy.worker.Worker spark://10.231.7.10:7077 --host 10.231.7.11'
"""
from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

# $1 the host's name, $2 the cluster's hosts file (names resolve on every host, as with DNS), $3 the
# host's own /tmp (kept in the shared directory, so its logs can be read after a failure), $4 where the
# machine's /tmp stays visible, $5 the shared directory, $6 "ro" for a read-only root file system; then
# paths under /tmp the host must still see (the repository, the virtualenv: a clone under /tmp), "--", and
# the command. A read-only root leaves writable only what is mounted apart: the host's /tmp, the paths kept
# under it, and the shared directory (a volume, as a pod's emptyDir or a cluster's shared storage). The
# remount is a bind remount: it changes this mount namespace's view of /, never the machine's.
HOST_SHELL = """
host="$1"; hosts="$2"; own_tmp="$3"; stage="$4"; shared="$5"; root="$6"; shift 6
hostname "$host" && mount --bind "$hosts" /etc/hosts && mount --bind /tmp "$stage" && mount --bind "$own_tmp" /tmp || exit 1
while [ "$1" != "--" ]; do mkdir -p "/tmp/$1" && mount --bind "$stage/$1" "/tmp/$1" || exit 1; shift; done
shift
if [ "$root" = ro ]; then mount --bind "$shared" "$shared" && mount -o remount,bind,ro / || exit 1; fi
exec "$@"
"""
MASTER_PORT = 7077


def _run(*argv: str) -> None:
    out = subprocess.run(list(argv), capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({out.returncode}): {out.stderr.strip()}")


def _wait_port(ns: str, ip: str, port: int, timeout: float, proc: subprocess.Popen, what: str, log: str) -> None:
    deadline = time.monotonic() + timeout
    probe = f"import socket; socket.create_connection(({ip!r}, {port}), 1).close()"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited ({proc.returncode}); its log: {_tail(log)}")
        if subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", probe], capture_output=True).returncode == 0:
            return
        time.sleep(0.5)
    raise RuntimeError(f"{what} did not listen on {ip}:{port} within {timeout:.0f} s; its log: {_tail(log)}")


def _tail(path: str, n: int = 3000) -> str:
    try:
        return open(path, errors="replace").read()[-n:]
    except OSError:
        return "(no log)"


# What the namespace-cluster tests need beyond the venv: ./dev test installs it when it runs as root.
INSTALL_HINT = ("as root, ./dev test installs them; or apt-get install iproute2 util-linux socat iptables "
                "libnetfilter-queue-dev gcc, then .venv/bin/pip install NetfilterQueue")


def missing_requirements() -> list[str]:
    """What this machine lacks for the namespace-cluster tests: root, the tools, NetfilterQueue."""
    missing = [] if os.geteuid() == 0 else ["root (network namespaces)"]
    missing += [f"`{tool}`" for tool in ("ip", "unshare", "socat", "iptables") if shutil.which(tool) is None]
    try:
        import netfilterqueue  # noqa: F401
    except ImportError:
        missing.append("NetfilterQueue (libnetfilter-queue)")
    return missing


def kept_under_tmp(*more: str) -> list[str]:
    """Paths under /tmp that a process with a /tmp of its own must still see, relative to /tmp: this
    repository and the virtualenv (with pyspark), and ``more``, when they are there (a CI clone)."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/harness/ -> the repository
    found = sorted({os.path.realpath(p) for p in (repo, sys.prefix, *more)})
    under = [p for p in found if p.startswith("/tmp/")]
    outer = [p for p in under if not any(p != q and p.startswith(q + "/") for q in under)]
    return [p[len("/tmp/"):] for p in outer]


def private_tmp_command(argv: list[str], stage: str, *more: str) -> list[str] | None:
    """``argv`` in a mount namespace of its own whose /tmp is an empty tmpfs but for this repository, its
    virtualenv and ``more`` when they are under /tmp (a CI clone, a test's shared directory), bound there
    from ``stage``, a directory outside /tmp (None where this process may not make one: not root, or no
    ``unshare``)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return None
    script = ('stage="$1"; shift; mount --bind /tmp "$stage" && mount -t tmpfs -o mode=1777 tmpfs /tmp || exit 1\n'
              'while [ "$1" != "--" ]; do mkdir -p "/tmp/$1" && mount --bind "$stage/$1" "/tmp/$1" || exit 1; shift; done\n'
              'shift; exec "$@"')
    return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script, "sh", stage,
            *kept_under_tmp(*more), "--", *argv]


class NamespaceCluster:
    """``workers`` worker hosts (``cores`` each) and a driver host that also runs the master."""

    def __init__(self, workers: int = 2, cores: int = 1, memory: str = "1g"):
        missing = missing_requirements()
        if missing:
            raise RuntimeError(f"the cluster tests need {', '.join(missing)} ({INSTALL_HINT})")
        import pyspark

        self.spark_home = os.path.dirname(pyspark.__file__)
        self.tag = f"{os.getpid() % 10000:04d}{random.randrange(100):02d}"  # interface names: <= 15 chars
        self.subnet = self._free_subnet()
        self.bridge_ip = f"{self.subnet}.1"
        self.hosts = {"driver": f"{self.subnet}.10"}
        self.hosts.update({f"w{i}": f"{self.subnet}.{10 + i}" for i in range(1, workers + 1)})
        self.cores, self.memory = cores, memory
        self.shared = tempfile.mkdtemp(prefix="spark-share-cluster-", dir="/var/tmp")
        os.chmod(self.shared, 0o755)
        self.logs = os.path.join(self.shared, "logs")
        os.makedirs(self.logs)
        self.hosts_file = os.path.join(self.shared, "hosts")
        with open(self.hosts_file, "w") as f:
            f.write("127.0.0.1 localhost\n" + "".join(f"{ip} {h}\n" for h, ip in self.hosts.items()))
        self._procs: list[subprocess.Popen] = []
        self._broker_links: dict[str, list[subprocess.Popen]] = {}  # host -> its socat forwards to the broker
        self._forwarded: set[int] = set()
        self._made_bridge = False
        self._made_ns: list[str] = []

    # names -------------------------------------------------------------------------------
    def ns(self, host: str) -> str:
        return f"ss{self.tag}-{host}"

    def host_tmp(self, host: str) -> str:
        """``host``'s /tmp, as seen from this process (spark-share's runtime dir and logs are under it)."""
        path = os.path.join(self.shared, "tmp", host)
        if not os.path.isdir(path):
            os.makedirs(path)
            os.chmod(path, 0o1777)
        return path

    def _stage(self, host: str) -> str:
        path = os.path.join(self.shared, "stage", host)
        os.makedirs(path, exist_ok=True)
        return path

    @property
    def master_url(self) -> str:
        return f"spark://{self.hosts['driver']}:{MASTER_PORT}"

    @staticmethod
    def _free_subnet() -> str:
        used = subprocess.run(["ip", "-4", "addr"], capture_output=True, text=True).stdout
        for _ in range(50):
            subnet = f"10.{random.randrange(200, 250)}.{random.randrange(1, 250)}"
            if f" {subnet}." not in used:
                return subnet
        raise RuntimeError("no free 10.x.y.0/24 subnet for the cluster's bridge")

    # life cycle ---------------------------------------------------------------------------
    def start(self) -> NamespaceCluster:
        try:
            self._network()
            self._start_master_and_workers()
        except BaseException:
            self.stop()
            raise
        return self

    def _network(self) -> None:
        br = f"ssb{self.tag}"
        try:
            _run("ip", "link", "add", br, "type", "bridge")
        except RuntimeError as e:
            raise RuntimeError(f"cannot create network namespaces for the cluster tests (root and CAP_NET_ADMIN "
                               f"are needed): {e}") from None
        self._made_bridge = True
        _run("ip", "addr", "add", f"{self.bridge_ip}/24", "dev", br)
        _run("ip", "link", "set", br, "up")
        for i, (host, ip) in enumerate(self.hosts.items()):
            ns, veth = self.ns(host), f"ssv{self.tag}{i}"
            _run("ip", "netns", "add", ns)
            self._made_ns.append(ns)
            _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _run("ip", "link", "set", veth, "master", br, "up")
            _run("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")

    def spawn(self, host: str, argv: list[str], env: dict | None = None, log_name: str | None = None,
              cwd: str | None = None, read_only_root: bool = False) -> subprocess.Popen:
        """A process on ``host`` (its own hostname and /tmp; with ``read_only_root`` a read-only root file
        system, as executor pods' images often have), logging to the shared logs directory."""
        log_path = os.path.join(self.logs, log_name or f"{host}-{os.path.basename(argv[0])}.log")
        full_env = dict(os.environ, **(env or {}))
        with open(log_path, "ab") as log:
            p = subprocess.Popen(["ip", "netns", "exec", self.ns(host), "unshare", "--uts", "--mount",
                                  "--propagation", "private", "sh", "-c", HOST_SHELL, "sh", host, self.hosts_file,
                                  self.host_tmp(host), self._stage(host), self.shared,
                                  "ro" if read_only_root else "rw", *kept_under_tmp(self.spark_home), "--", *argv],
                                 env=full_env, stdout=log, stderr=subprocess.STDOUT, cwd=cwd or self.shared,
                                 start_new_session=True)
        p.log_path = log_path  # type: ignore[attr-defined]
        self._procs.append(p)
        return p

    def _spark_env(self, host: str) -> dict:
        ip = self.hosts[host]
        return {"SPARK_HOME": self.spark_home, "SPARK_LOCAL_IP": ip, "SPARK_LOCAL_HOSTNAME": ip,
                "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable,
                "SPARK_NO_DAEMONIZE": "1"}

    def _start_master_and_workers(self) -> None:
        spark_class = os.path.join(self.spark_home, "bin", "spark-class")
        drv = self.hosts["driver"]
        master = self.spawn("driver", [spark_class, "org.apache.spark.deploy.master.Master", "--host", drv,
                                       "--port", str(MASTER_PORT), "--webui-port", "8080"],
                            env=self._spark_env("driver"), log_name="master.log")
        _wait_port(self.ns("driver"), drv, MASTER_PORT, 120, master, "the Spark master", master.log_path)
        self.master = master
        self.workers = {}
        for host in self.hosts:
            if host != "driver":
                self.workers[host] = self._start_worker(host)
        for host in self.workers:
            self._wait_worker(host, registrations=1)

    def _start_worker(self, host: str) -> subprocess.Popen:
        spark_class = os.path.join(self.spark_home, "bin", "spark-class")
        return self.spawn(host, [spark_class, "org.apache.spark.deploy.worker.Worker", self.master_url,
                                 "--host", self.hosts[host], "--port", "7078", "--webui-port", "8081",
                                 "--cores", str(self.cores), "--memory", self.memory, "--work-dir", "/tmp/spark-work"],
                          env=self._spark_env(host), log_name=f"worker-{host}.log", read_only_root=True)

    def _wait_worker(self, host: str, registrations: int) -> None:
        """Until ``host``'s worker listens and the master has registered it ``registrations`` times (an app
        asks for executors only once the master has them all)."""
        w = self.workers[host]
        _wait_port(self.ns(host), self.hosts[host], 7078, 120, w, f"the Spark worker on {host}", w.log_path)
        deadline = time.monotonic() + 120
        line = f"Registering worker {self.hosts[host]}:7078"
        while _tail(self.master.log_path, 1 << 22).count(line) < registrations:
            if time.monotonic() > deadline or self.master.poll() is not None:
                raise RuntimeError(f"the worker on {host} did not register with the master: {_tail(w.log_path)}")
            time.sleep(0.5)  # a bounded poll of a log file: nothing to wait on

    def revive(self, host: str) -> None:
        """``host`` comes back after ``kill_host``: the broker forwarded to it again, its Spark worker
        started and registered with the master."""
        for port in sorted(self._forwarded):
            self._forward_into(host, port)
        for port in sorted(self._forwarded):
            self._wait_forwarded_on(host, port)
        before = _tail(self.master.log_path, 1 << 22).count(f"Registering worker {self.hosts[host]}:7078")
        self.workers[host] = self._start_worker(host)
        self._wait_worker(host, registrations=before + 1)

    def forward(self, bootstrap_servers: str) -> None:
        """Make each broker of ``bootstrap_servers`` (127.0.0.1:port in this process's namespace)
        reachable at the same address on every host."""
        for addr in bootstrap_servers.split(","):
            port = int(addr.rsplit(":", 1)[1])
            if port in self._forwarded:
                continue
            self._forwarded.add(port)
            root = subprocess.Popen(["socat", f"TCP-LISTEN:{port},bind={self.bridge_ip},fork,reuseaddr",
                                     f"TCP:127.0.0.1:{port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                    start_new_session=True)
            self._procs.append(root)
            for host in self.hosts:
                self._forward_into(host, port)
            for host in self.hosts:
                self._wait_forwarded_on(host, port)

    def _forward_into(self, host: str, port: int) -> None:
        p = subprocess.Popen(["ip", "netns", "exec", self.ns(host), "socat",
                              f"TCP-LISTEN:{port},bind=127.0.0.1,fork,reuseaddr", f"TCP:{self.bridge_ip}:{port}"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        self._procs.append(p)
        self._broker_links.setdefault(host, []).append(p)

    @contextlib.contextmanager
    def broker_links_frozen(self, host: str):
        """``host``'s connections to the broker go silent, as a host lost with them: its forwards (each
        connection a forked child in the listener's process group) are stopped, so nothing the host's
        processes do, their death included, reaches the broker, which keeps their connections open until
        its own timeouts. Resumed at the end (what the host's processes closed then closes)."""
        groups = [p.pid for p in self._broker_links.get(host, [])]
        assert groups, f"nothing of {host} reaches a broker: forward() first"
        for g in groups:
            os.killpg(g, signal.SIGSTOP)
        try:
            yield
        finally:
            for g in groups:
                os.killpg(g, signal.SIGCONT)

    def _wait_forwarded_on(self, host: str, port: int) -> None:
        probe = f"import socket; socket.create_connection(('127.0.0.1', {port}), 1).close()"
        deadline = time.monotonic() + 30
        while subprocess.run(["ip", "netns", "exec", self.ns(host), sys.executable, "-c", probe],
                             capture_output=True).returncode != 0:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the broker port {port} is not reachable from {host}")
            time.sleep(0.2)

    @contextlib.contextmanager
    def tcp_backoff_capped(self, rto_max_ms: int = 1000, outlast_s: int = 60):
        """Within: connections opened on any host retransmit at least every ``rto_max_ms`` (the kernel's
        ``net.ipv4.tcp_rto_max_ms``, Linux 6.15 on; 120 s by default), and give up only after about
        ``outlast_s`` without an answer (``tcp_retries2`` raised to match: a lower cap alone shortens the
        time a connection survives a cut, to 14 s at 1 s and the default 15 retries). What a host whose
        jobs must resume promptly after a network cut would set. Yields False, changing nothing, on a
        kernel without the setting."""
        if not os.path.exists("/proc/sys/net/ipv4/tcp_rto_max_ms"):
            yield False
            return
        retries = 2 + outlast_s * 1000 // rto_max_ms  # the first doublings (0.2 s .. the cap) come on top
        was = {h: {k: self._sysctl(h, k) for k in ("tcp_rto_max_ms", "tcp_retries2")} for h in self.hosts}
        for h in self.hosts:
            self._sysctl(h, "tcp_rto_max_ms", rto_max_ms)
            self._sysctl(h, "tcp_retries2", retries)
        try:
            yield True
        finally:
            for h, values in was.items():
                for k, v in values.items():
                    self._sysctl(h, k, v)

    def _sysctl(self, host: str, key: str, value: int | None = None) -> int:
        """``net.ipv4.<key>`` in ``host``'s network namespace: read, or set to ``value``."""
        argv = ["ip", "netns", "exec", self.ns(host), "sysctl", "-n"]
        argv += [f"net.ipv4.{key}"] if value is None else ["-w", f"net.ipv4.{key}={value}"]
        out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
        return int(out.split()[-1]) if value is None else value

    def pids(self, host: str) -> list[int]:
        """Every process on ``host`` (in its network namespace)."""
        out = subprocess.run(["ip", "netns", "pids", self.ns(host)], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    def kill_host(self, host: str) -> list[int]:
        """SIGKILL everything on ``host``: its worker, executors, Python workers and agents (a machine
        that died)."""
        pids = self.pids(host)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids

    def stop(self) -> None:
        for host in list(self.hosts):
            if self.ns(host) in self._made_ns:
                self.kill_host(host)
        for p in self._procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                pass
        for ns in self._made_ns:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made_ns.clear()
        if self._made_bridge:
            subprocess.run(["ip", "link", "del", f"ssb{self.tag}"], capture_output=True)
            self._made_bridge = False
        shutil.rmtree(self.shared, ignore_errors=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
