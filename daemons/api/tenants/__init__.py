"""Tenants: who a request belongs to, and the limits and share it has.

A tenant comes from ``--api-key-file`` (a single key, or a TOML file of
tenants). Requests carry their Tenant as ``request["tenant"]`` once the auth
middleware has accepted them; DEFAULT_TENANT stands for the single-key and
no-key cases.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    weight: float = 1.0
    priority: int = 0
    requests_per_s: float | None = None
    tokens_per_min: int | None = None
    max_concurrent: int | None = None
    max_tokens: int | None = None


DEFAULT_TENANT = Tenant(name="default")

__all__ = ["DEFAULT_TENANT", "Tenant"]
