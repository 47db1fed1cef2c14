"""Where a model's processes run, torch-free: a free port to listen on, the network
interface that reaches another machine, and what identifies a machine (the ranks of a
tensor-parallel group share memory only on one)."""

from __future__ import annotations

import contextlib
import os
import random
import socket
from pathlib import Path


_LOWEST_PICK = 20000  # below it live well-known services' ports (databases, caches, ...)


def free_port(host: str = "127.0.0.1", span: int = 1) -> int:
    """A TCP port free on `host` now, and the `span - 1` ports after it. Drawn below the
    kernel's ephemeral range, where it never puts the ports of outgoing connections and of
    port-0 listeners (gloo's, zmq's), so the port stays free until it is bound in all but a
    race with another explicit pick; outside Linux, the kernel's pick."""
    draw = random.SystemRandom()  # not the process's seeded generator: two servers differ
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 0
    for _ in range(200 if ephemeral - span > _LOWEST_PICK else 0):
        port = draw.randrange(_LOWEST_PICK, ephemeral - span + 1)
        if _bindable(host, range(port, port + span)):
            return port
    while True:  # the kernel's pick
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port + span <= 65536 and _bindable(host, range(port, port + span)):
            return port


def _bindable(host: str, ports: range) -> bool:
    with contextlib.ExitStack() as held:
        try:
            for port in ports:
                s = held.enter_context(socket.socket())
                s.bind((host, port))
        except OSError:
            return False
    return True


def machine_id() -> str:
    """What ranks that may share memory have in common: the kernel they run on (its boot
    id) and their network namespace (the tests' nodes are namespaces of one kernel)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}:{os.readlink('/proc/self/ns/net')}"
    except OSError:
        return socket.gethostname()


def interface_towards(host: str) -> str:
    """The name of this machine's network interface whose address reaches `host`."""
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))  # no packet is sent: the kernel only picks a route
        mine = probe.getsockname()[0]
        for _, name in socket.if_nameindex():
            try:  # SIOCGIFADDR: the interface's IPv4 address
                raw = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if socket.inet_ntoa(raw[20:24]) == mine:
                return name
    raise ValueError(f"no network interface of this machine reaches {host}")
