"""Who may connect to a relay's MAC-only port: the addresses of the attempt's relay tree."""

from __future__ import annotations

from refit_sidecar.transport.relay.members import admits, endpoint_host, member_addresses


def test_the_host_of_an_endpoint() -> None:
    assert endpoint_host("tcp://10.0.0.7:8472") == "10.0.0.7"
    assert endpoint_host("tcp://[fd00::7]:8473") == "fd00::7"
    assert endpoint_host("tcp://relay-0.ns.svc:8472") == "relay-0.ns.svc"
    assert endpoint_host("not an endpoint") == ""
    assert endpoint_host("tcp://[broken:1") == ""


def test_members_are_the_tree_s_addresses_and_names_resolve() -> None:
    members = member_addresses(
        ["tcp://10.0.0.7:8472", "tcp://[fd00::7]:8473", "tcp://localhost:1", "", "garbage"]
    )
    assert {"10.0.0.7", "fd00::7", "127.0.0.1"} <= members
    assert admits(members, "10.0.0.7")
    assert admits(members, "::ffff:10.0.0.7")  # an IPv4 peer on a dual-stack socket
    assert admits(members, "fd00:0::7")  # any spelling of the same address
    assert not admits(members, "10.0.0.8")
    assert not admits(members, "not-an-address")
    assert not admits(frozenset(), "10.0.0.7")  # no attempt prepared: nobody
    assert member_addresses(["tcp://no-such-host.invalid:1"]) == frozenset()
