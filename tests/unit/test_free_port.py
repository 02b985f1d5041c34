"""`free_port`: a rendezvous port the kernel does not hand out to other sockets meanwhile."""

from __future__ import annotations

import socket

import pytest

from poplar_ext import collectives
from poplar_ext.collectives import FIXED_PORTS_FROM, candidate_ports, free_port


@pytest.fixture
def port_range(monkeypatch, tmp_path):
    """Sets the kernel's ephemeral range as this module reads it."""

    def set_range(low: int, high: int) -> None:
        (tmp_path / "range").write_text(f"{low}\t{high}\n")
        monkeypatch.setattr(collectives, "EPHEMERAL_PORTS_FILE", tmp_path / "range")

    return set_range


@pytest.mark.skipif(not collectives.EPHEMERAL_PORTS_FILE.exists(), reason="no Linux ephemeral port range to read")
def test_on_this_machine_the_port_is_outside_the_ephemeral_range_and_can_be_bound() -> None:
    low, high = (int(v) for v in collectives.EPHEMERAL_PORTS_FILE.read_text().split())
    ports = {free_port() for _ in range(20)}
    assert all(not low <= port <= high for port in ports), (low, high, sorted(ports))
    assert len(ports) > 1  # at random: two launches side by side do not race for one port
    with socket.socket() as server:
        server.bind(("127.0.0.1", ports.pop()))


def test_below_the_range_where_it_leaves_room(port_range) -> None:
    port_range(20500, 60999)
    assert all(FIXED_PORTS_FROM <= free_port() < 20500 for _ in range(50))


def test_above_the_range_where_there_is_no_room_below(port_range) -> None:
    port_range(1024, 60999)
    assert all(61000 <= free_port() <= 65535 for _ in range(50))


def test_the_kernel_picks_where_the_range_leaves_no_room(port_range) -> None:
    port_range(1024, 65535)
    assert candidate_ports() == []
    with socket.socket() as server:
        server.bind(("127.0.0.1", free_port()))


def test_an_unreadable_range_is_taken_as_linuxs_default(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(collectives, "EPHEMERAL_PORTS_FILE", tmp_path / "absent")
    assert all(FIXED_PORTS_FROM <= port < 32768 for port in candidate_ports())


def test_a_port_taken_by_a_listener_is_passed_over(monkeypatch) -> None:
    with socket.socket() as holder, socket.socket() as probe:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
        probe.close()
        monkeypatch.setattr(collectives, "candidate_ports", lambda: [holder.getsockname()[1], free])
        assert free_port() == free
