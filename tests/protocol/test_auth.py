"""HTTP bearers: clients send a one-way derivation of the token, servers take it or the token."""

from __future__ import annotations

from refit_protocol.keys import payload_mac_key
from refit_protocol.kit.auth import bearer_header, bearer_ok, http_bearer

TOKEN = "a-policy-token-of-32-characters!"


def test_clients_never_send_the_token_itself() -> None:
    header = bearer_header(TOKEN)["Authorization"]
    assert TOKEN not in header
    assert header == f"Bearer {http_bearer(TOKEN)}"
    assert http_bearer(TOKEN) != http_bearer(TOKEN + "x")
    assert payload_mac_key(TOKEN).hex() not in header  # another derivation than the MAC key's
    assert bearer_header(None) == {}


def test_servers_take_the_bearer_or_the_token_and_nothing_else() -> None:
    assert bearer_ok(TOKEN, bearer_header(TOKEN)["Authorization"])
    assert bearer_ok(TOKEN, f"Bearer {TOKEN}")  # curl with the Secret's value
    for wrong in ("", "Bearer ", f"Bearer {http_bearer('other')}", f"Basic {TOKEN}", TOKEN):
        assert not bearer_ok(TOKEN, wrong), wrong
    assert bearer_ok(None, "")  # no token configured: loopback-only servers
