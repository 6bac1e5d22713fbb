"""The agent's HTTP endpoints (Prometheus metrics, torchrun's health check) hold bounded
connections, on real sockets: beyond the caps a connection is refused at once, and a connection
idle or dripping its request is cut at its deadline, while probes and scrapes go on answering."""

from __future__ import annotations

import json
import socket
import time
import urllib.request

import pytest

from agent import http_endpoint, listener_limits
from agent.events import Metrics
from agent.health import HttpHealthCheckServer
from conftest import free_port


@pytest.fixture(autouse=True)
def short_deadline(monkeypatch):
    monkeypatch.setattr(listener_limits, "HANDSHAKE_TIMEOUT_S", 1.0)


def closed(sock: socket.socket) -> bool:
    """Whether the other end closed ``sock`` (a reset counts) without a byte."""
    try:
        return sock.recv(1 << 10) == b""
    except ConnectionResetError:
        return True


def test_the_metrics_endpoint_refuses_beyond_its_caps_cuts_idle_connections_and_keeps_answering(monkeypatch):
    monkeypatch.setattr(listener_limits, "HANDSHAKE_TIMEOUT_S", 5.0)  # the idle ones still held when the extra comes
    port = free_port()
    metrics = Metrics.serve("127.0.0.1", port)
    metrics.set_world_size(3)
    try:
        idle = [socket.create_connection(("127.0.0.1", port), timeout=30)
                for _ in range(http_endpoint.MAX_CONNECTIONS_PER_ADDRESS)]
        extra = socket.create_connection(("127.0.0.1", port), timeout=30)
        extra.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        assert closed(extra)  # refused: this address holds its share
        started = time.monotonic()
        assert all(closed(sock) for sock in idle)  # cut at their deadline
        assert time.monotonic() - started < 15
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert "torchrevive_world_size 3.0" in text
    finally:
        metrics.close()


def test_the_health_check_cuts_a_request_dripped_byte_by_byte_and_keeps_answering():
    server = HttpHealthCheckServer(lambda: int(time.time()), 0, 60, host="127.0.0.1")
    server.start()
    try:
        drip = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        started = time.monotonic()
        with pytest.raises(OSError):  # never silent long enough for a socket timeout: the deadline cuts it
            for byte in b"GET / HTTP/1.0\r\nX-Slow: " + b"x" * 60:  # 22 s at this pace
                drip.sendall(bytes([byte]))
                time.sleep(0.3)
        assert time.monotonic() - started < 10
        drip.close()
        answer = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{server.port}/", timeout=10).read())
        assert answer["alive"] is True
    finally:
        server.stop()
