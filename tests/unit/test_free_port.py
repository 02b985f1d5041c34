"""`free_port`: a rendezvous port the kernel does not hand out to other sockets meanwhile."""

from __future__ import annotations

import socket

import pytest

from poplar_ext import collectives
from poplar_ext.collectives import free_port


def _ephemeral_low() -> int:
    return int(collectives.EPHEMERAL_PORTS_FILE.read_text().split()[0])


@pytest.mark.skipif(not collectives.EPHEMERAL_PORTS_FILE.exists(), reason="no Linux ephemeral port range to read")
def test_the_port_is_below_the_ephemeral_range_and_can_be_bound() -> None:
    low = _ephemeral_low()
    ports = {free_port() for _ in range(20)}
    assert all(20000 <= port < low for port in ports), (low, sorted(ports))
    assert len(ports) > 1  # picked at random: two launches side by side do not race for one port
    with socket.socket() as server:
        server.bind(("127.0.0.1", ports.pop()))


def test_a_port_taken_by_a_listener_is_passed_over(monkeypatch, tmp_path) -> None:
    (tmp_path / "range").write_text("20002\t60999\n")  # room for 20000 and 20001, tried in order
    monkeypatch.setattr(collectives, "EPHEMERAL_PORTS_FILE", tmp_path / "range")
    monkeypatch.setattr(collectives.random, "Random", lambda seed: _InOrder())
    with socket.socket() as holder:
        try:
            holder.bind(("127.0.0.1", 20000))
        except OSError:
            pytest.skip("port 20000 is in use on this machine")
        holder.listen()
        assert free_port() == 20001


def test_an_unreadable_range_falls_back_to_linuxs_default(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(collectives, "EPHEMERAL_PORTS_FILE", tmp_path / "absent")
    assert 20000 <= free_port() < 32768


class _InOrder:
    def shuffle(self, values: list) -> None:
        pass
