"""The bearer token of the producer services that the producer's HTTP tests serve."""

from __future__ import annotations

TOKEN = "producer-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
