"""The master port of a single-node run: free, and outside the range the kernel hands out to outgoing
connections."""

from __future__ import annotations

import socket

from megatron_zaya.runtime import ephemeral_port_range, free_master_port


def test_the_master_port_skips_a_busy_port_and_the_ephemeral_range():
    low, _ = ephemeral_port_range()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        for taken in range(low - 1, 20000, -1):  # the last port before the ephemeral range that is free now
            try:
                busy.bind(("127.0.0.1", taken))
                break
            except OSError:
                continue
        busy.listen()
        port = free_master_port("127.0.0.1", start=taken)
        assert port != taken and 20000 <= port < max(low, 20001)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
            server.bind(("127.0.0.1", port))  # it is free
    assert free_master_port("127.0.0.1", start=taken) == taken  # once released, it is the first choice again
