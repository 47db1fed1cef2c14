"""Where a model's processes run, torch-free: a free port to listen on, the network
interface that reaches another machine, and what identifies a machine (the ranks of a
tensor-parallel group share memory only on one)."""

from __future__ import annotations

import os
import socket
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (another process may take it before it is bound)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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
