"""Ports for servers started a few seconds later: distinct, free, and below the kernel's
ephemeral range, which other processes' `port 0` binds and outgoing connections draw from."""

from __future__ import annotations

import socket
from pathlib import Path

from diloco.server.ops.launch import free_ports

RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    ports = free_ports(5)
    assert len(set(ports)) == 5
    if RANGE.exists():
        low = int(RANGE.read_text().split()[0])
        assert all(10_000 <= port < low for port in ports), (ports, low)
    held = []
    try:
        for port in ports:  # free now: each binds
            sock = socket.socket()
            sock.bind(("127.0.0.1", port))
            held.append(sock)
    finally:
        for sock in held:
            sock.close()
