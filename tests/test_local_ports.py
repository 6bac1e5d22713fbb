"""Ports for servers the tests and the harness start: held from the moment they are chosen."""

from __future__ import annotations

import errno
import socket

import pytest
from conftest import free_port
from torch.distributed import TCPStore


def test_a_chosen_port_is_held_until_its_server_binds_it():
    port = free_port()
    with socket.socket() as other, pytest.raises(OSError) as refused:
        other.bind(("127.0.0.1", port))  # anyone else: refused (nor handed out as an ephemeral port)
    assert refused.value.errno == errno.EADDRINUSE
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # its user: at once
    assert store.port == port
