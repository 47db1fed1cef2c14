"""Tensor parallelism across machines: two network namespaces joined by a veth pair stand
for two nodes. Node 0 (`tidal serve --nnodes 2 --master-addr ...`) serves the API and holds
rank 0; node 1 (`tidal serve --headless --node-rank 1`) holds rank 1 in the other namespace.
The served model answers as one process does; a rank killed on node 1 fails its step, node
0's engine core restarts and node 1's rank starts again, and the model answers again; node
1 stopped takes its rank with it; with `--distributed-executor-backend ray`, a Ray cluster of
a head here and a worker node there places rank 1 on node 1, with the same tokens; a node
started with other flags is refused by name; flags that cannot span nodes are refused
before anything loads."""

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
from pathlib import Path

import pytest

from model_fixtures import small_folder
from server_fixtures import Server, openai_client

from tidal import LLM, SamplingParams
from tidal.model.hosts import free_port

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None,
    reason="network namespaces need root and iproute2")
PROMPT = [5, 9, 33, 7, 100, 3]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture(scope="module")
def netns():
    """(namespace name, node 0's address, node 1's address): a namespace joined to this
    one by a veth pair on a subnet of its own."""
    tag = f"{os.getpid() % 100000}{random.randrange(100)}"
    name, here, there = f"tidal-n{tag}", f"tv{tag}a", f"tv{tag}b"
    subnet = f"10.{random.randrange(64, 128)}.{random.randrange(256)}"
    try:
        _ip("netns", "add", name)
    except subprocess.CalledProcessError as e:
        pytest.skip(f"cannot create a network namespace here: {e.stderr.decode().strip()}")
    try:
        _ip("link", "add", here, "type", "veth", "peer", "name", there)
        _ip("link", "set", there, "netns", name)
        _ip("addr", "add", f"{subnet}.1/24", "dev", here)
        _ip("link", "set", here, "up")
        for cmd in (("addr", "add", f"{subnet}.2/24", "dev", there), ("link", "set", there, "up"),
                    ("link", "set", "lo", "up")):
            _ip("netns", "exec", name, "ip", *cmd)
        yield name, f"{subnet}.1", f"{subnet}.2"
    finally:
        subprocess.run(["ip", "link", "del", here], capture_output=True)
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return small_folder(tmp_path_factory.mktemp("multinode"), "llama", "llama")


class Node:
    """`tidal serve --headless` in namespace `ns`, its output in a file."""

    def __init__(self, ns: str, *flags: str) -> None:
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, "-m", "tidal.cli", "serve",
             "--headless", "--num-threads", "1", *flags],
            stdout=self.log, stderr=subprocess.STDOUT, text=True, start_new_session=True)

    def ranks(self) -> list[int]:
        """The node's rank processes (children of its serve process)."""
        out = subprocess.run(["pgrep", "-f", "-s", str(self.proc.pid), "tidal.engine.tp_executor"],
                             capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    def stop(self) -> str:
        with_group = os.getpgid(self.proc.pid) if self.proc.poll() is None else None
        if with_group is not None:
            os.killpg(with_group, signal.SIGKILL)
        self.proc.wait()
        self.log.seek(0)
        return self.log.read()


def group_flags(addr: str, port: int, size: int = 2) -> list[str]:
    return ["--tensor-parallel-size", str(size), "--nnodes", "2", "--master-addr", addr,
            "--master-port", str(port), "--distributed-timeout", "10"]


def _free_port_pair() -> int:
    return free_port("", span=2)


def test_free_ports_are_drawn_outside_the_kernels_ephemeral_range():
    """Where the kernel puts outgoing connections and port-0 listeners (gloo's, zmq's), a
    picked port could be taken before the server binds it: picks land below that range."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    picks = [free_port("127.0.0.1", span=2) for _ in range(20)]
    assert all(20000 <= p and p + 1 < low for p in picks) and len(set(picks)) > 1
    with socket.socket() as held:  # a port in use is never picked
        held.bind(("127.0.0.1", picks[0]))
        with socket.socket() as other:
            other.bind(("127.0.0.1", picks[0] + 1))
            assert not any(p in (picks[0], picks[0] + 1) or p + 1 == picks[0]
                           for p in (free_port(span=2) for _ in range(200)))


def test_two_nodes_serve_one_processs_tokens_and_survive_a_lost_rank(netns, folder):
    ns, addr, _ = netns
    port = _free_port_pair()
    flags = ["--model", str(folder), "--dtype", "float32", *group_flags(addr, port)]
    node1 = Node(ns, "--node-rank", "1", *flags)
    server = None
    try:
        server = Server(*flags)
        want = _one_process_text(folder)

        def answer() -> str:
            return _served_texts(server, folder, 1)[0]
        assert answer() == want
        # the ranks sum over gloo, in the C++ decoder too (its sums call torch.distributed)
        assert "decode steps through the C++ decoder" in server.output()
        (rank,) = node1.ranks()
        here = os.readlink("/proc/self/ns/net")
        assert os.readlink(f"/proc/{rank}/ns/net") != here  # it runs on the other "machine"
        os.kill(rank, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while True:  # the step fails, node 0's core restarts, node 1's rank comes back
            try:
                if answer() == want:
                    break
            except Exception:
                pass
            assert time.monotonic() < deadline, server.output()[-3000:]
            time.sleep(1)
        assert node1.ranks() and node1.ranks() != [rank]
        assert "restarting it" in server.output()
        ranks = node1.ranks()
        node1.proc.send_signal(signal.SIGTERM)  # a stopped node takes its ranks with it
        node1.proc.wait(30)
        assert not [r for r in ranks if os.path.exists(f"/proc/{r}")]
    finally:
        if server is not None:
            server.stop()
        node1.stop()


def test_a_node_started_with_other_flags_is_refused_by_name(netns, folder):
    ns, addr, _ = netns
    port = _free_port_pair()
    server = subprocess.Popen(
        [sys.executable, "-m", "tidal.cli", "serve", "--model", str(folder), "--port",
         str(_free_port_pair()), "--num-kv-blocks", "64", *group_flags(addr, port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    node1 = Node(ns, "--model", str(folder), "--node-rank", "1", *group_flags(addr, port, 4))
    try:
        deadline = time.monotonic() + 60
        while "refused this node" not in (out := _peek(node1)):
            assert time.monotonic() < deadline, out[-2000:]
            time.sleep(0.5)
        assert "--tensor-parallel-size, --nnodes and --master-* flags" in out
    finally:
        os.killpg(os.getpgid(server.pid), signal.SIGKILL)
        server.wait()
        node1.stop()


# Two ranks as Ray actors; a rank's first start may build tidal's C++ extension for its
# checkout (a minute or two) while rank 0 waits in the first collective.
RAY_RANKS = ("--tensor-parallel-size", "2", "--distributed-executor-backend", "ray",
             "--distributed-timeout", "300")
RAY_READY_S = 330  # the server may take its --distributed-timeout to gather its ranks


def _ray_node(*argv: str) -> subprocess.Popen:
    """`ray start --block` (argv: where it runs, "--", then its flags), its processes one
    group; the Ray CLI beside this Python's."""
    ray = str(Path(sys.executable).with_name("ray"))
    cut = argv.index("--")
    return subprocess.Popen([*argv[:cut], ray, "start", "--block", "--disable-usage-stats",
                             *argv[cut + 1:]], stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT, start_new_session=True)


def _ray_active_nodes(address: str) -> int:
    out = subprocess.run([str(Path(sys.executable).with_name("ray")), "status", "--address",
                          address], capture_output=True, text=True).stdout
    return out.partition("Active:")[2].partition("Pending:")[0].count("node_")


def _ray_actors() -> list[str]:
    """The processes of tidal's Ray actors (Ray names them after the class)."""
    return subprocess.run(["pgrep", "-f", r"ray::_(Rank|Core)Actor"], capture_output=True,
                          text=True).stdout.split()


@contextlib.contextmanager
def ray_cluster(monkeypatch, head: tuple[str, int], worker: tuple[str, str, int] | None):
    """A Ray head at head's (address, CPUs) and, given (namespace, address, CPUs), a worker
    node there; RAY_ADDRESS names the cluster for the servers started meanwhile. Its files
    lie apart from any other Ray's (its address file too); the nodes, their CLI and the
    servers all run without Ray's token authentication."""
    address = f"{head[0]}:{_free_port_pair()}"
    files = tempfile.mkdtemp(prefix="tidal-ray")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setenv("RAY_ADDRESS", address)
    nodes = [_ray_node("--", "--head", "--node-ip-address", head[0], "--port",
                       address.split(":")[1], "--num-cpus", str(head[1]),
                       "--include-dashboard", "false", "--temp-dir", files)]
    if worker is not None:
        nodes.append(_ray_node("ip", "netns", "exec", worker[0], "--", "--address", address,
                               "--node-ip-address", worker[1], "--num-cpus", str(worker[2]),
                               "--temp-dir", files))
    try:
        deadline = time.monotonic() + 120
        while _ray_active_nodes(address) < len(nodes):
            assert time.monotonic() < deadline, "the Ray nodes did not come up"
            time.sleep(1)
        yield address
    finally:
        for node in nodes:
            os.killpg(os.getpgid(node.pid), signal.SIGKILL)
            node.wait()
        deadline = time.monotonic() + 30  # Ray's workers leave once their raylet is gone
        while _ray_actors() and time.monotonic() < deadline:
            time.sleep(0.5)
        shutil.rmtree(files, ignore_errors=True)


def _one_process_text(folder) -> str:
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=64, num_threads=1)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    try:
        return llm.generate([{"prompt_token_ids": PROMPT}], params,
                            use_tqdm=False)[0].outputs[0].text
    finally:
        llm.close()


def _served_texts(server: Server, folder, n: int) -> list[str]:
    client = openai_client(server)
    return [client.completions.create(model=folder.name, prompt=PROMPT, max_tokens=10,
                                      temperature=0, extra_body={"ignore_eos": True}
                                      ).choices[0].text for _ in range(n)]


def _elsewhere(pids: list[str]) -> list[str]:
    """Those of pids in another network namespace than this process ("on node 1")."""
    here = os.readlink("/proc/self/ns/net")
    return [p for p in pids if os.readlink(f"/proc/{p}/ns/net") != here]


def test_ray_places_a_rank_on_the_other_node_and_it_gives_one_processs_tokens(
        netns, folder, monkeypatch):
    """`tidal serve --distributed-executor-backend ray` across the two "machines": a Ray head
    here that offers no CPU and a worker node in the other namespace, so Ray places rank 1's
    actor there; it meets rank 0 at this node's address, and the answer is one process's."""
    pytest.importorskip("ray")
    ns, addr, there = netns
    want = _one_process_text(folder)
    with ray_cluster(monkeypatch, (addr, 0), (ns, there, 1)):
        server = Server("--model", str(folder), "--dtype", "float32", *RAY_RANKS,
                        ready_s=RAY_READY_S)
        try:
            assert _served_texts(server, folder, 1) == [want]
            assert _elsewhere(_ray_actors())
        finally:
            server.stop()


def test_data_parallel_cores_of_two_ranks_each_placed_by_ray_on_both_nodes(
        netns, folder, monkeypatch):
    """DP x TP on Ray: two engine cores as actors, each with a rank actor of its own, on a
    cluster of two CPUs here and two in the other namespace, so two of the four actors run
    on node 1; every answer is one process's."""
    pytest.importorskip("ray")
    ns, addr, there = netns
    want = _one_process_text(folder)
    with ray_cluster(monkeypatch, (addr, 2), (ns, there, 2)):
        server = Server("--model", str(folder), "--dtype", "float32",
                        "--data-parallel-size", "2", "--dp-backend", "ray", *RAY_RANKS,
                        ready_s=RAY_READY_S)
        try:
            assert _served_texts(server, folder, 4) == [want] * 4
            assert len(_ray_actors()) == 4 and len(_elsewhere(_ray_actors())) == 2
        finally:
            server.stop()


def test_a_rank_ray_cannot_place_fails_the_start_naming_why(folder, monkeypatch):
    """A Ray cluster with no free CPU for rank 1's actor: the server does not wait forever
    but fails to start within --distributed-timeout, saying so."""
    pytest.importorskip("ray")
    with ray_cluster(monkeypatch, ("127.0.0.1", 0), None):
        out = subprocess.run(
            [sys.executable, "-m", "tidal.cli", "serve", "--model", str(folder), "--port",
             str(_free_port_pair()), "--num-threads", "1", "--tensor-parallel-size", "2",
             "--distributed-executor-backend", "ray", "--distributed-timeout", "5"],
            capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "Ray started no actor for a tensor-parallel rank within 5 s" in out.stderr


def _peek(node: Node) -> str:
    node.log.seek(0)
    return node.log.read()


@pytest.mark.parametrize("flags, message", [
    (["--headless"], "--headless is for the nodes of --node-rank 1"),
    (["--nnodes", "2", "--node-rank", "1", "--tensor-parallel-size", "2"],
     "--headless is for the nodes of --node-rank 1"),
    (["--nnodes", "2", "--tensor-parallel-size", "3"], "--nnodes 2 must divide"),
    (["--nnodes", "2", "--node-rank", "2", "--tensor-parallel-size", "2"],
     "node_rank must be in 0..nnodes-1"),
    (["--nnodes", "2", "--tensor-parallel-size", "2", "--data-parallel-size", "2"],
     "--data-parallel-size must be 1"),
])
def test_flags_that_cannot_span_nodes_are_refused(folder, flags, message):
    out = subprocess.run([sys.executable, "-m", "tidal.cli", "serve", "--model", str(folder),
                          *flags], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and message in out.stderr, out.stderr[-2000:]

