"""--api-key-file: one key (its first line), or a TOML file of tenants.

Owns parsing and checking the file into a KeyBook, and finding the tenant a
presented key belongs to. Keys are held only as SHA-256 digests and compared
with hmac.compare_digest against every tenant's digest (no early exit), so the
time a lookup takes says nothing about which key came close. No message this
module builds ever holds a key or a digest: errors name the tenant and field.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass, field

import tomllib
from dpserve.daemons.api.tenants import DEFAULT_TENANT, Tenant

NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # a metrics label and a log field: short, plain
_HEX_RE = re.compile(r"[0-9a-fA-F]{64}")
# field -> (type check, what it must be): every limit is optional
_LIMITS = {
    "weight": (lambda v: _number(v) and v > 0, "a number > 0"),
    "priority": (lambda v: _int(v), "an integer"),
    "requests_per_s": (lambda v: _number(v) and v > 0, "a number > 0"),
    "tokens_per_min": (lambda v: _int(v) and v > 0, "an integer > 0"),
    "max_concurrent": (lambda v: _int(v) and v > 0, "an integer > 0"),
    "max_tokens": (lambda v: _int(v) and v > 0, "an integer > 0"),
}
_KEY_FIELDS = ("key", "key_sha256")


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and v != float("inf")


def digest(key: str | bytes) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape") if isinstance(key, str) else key).digest()


def check_key_text(key: str, source: str) -> str:
    """A key a client can send in 'Authorization: Bearer <key>': printable ASCII, no space."""
    bad = next((ch for ch in key if not "!" <= ch <= "~"), None)
    if bad is not None:
        raise ValueError(f"{source}: the API key holds {bad!r} (U+{ord(bad):04X}); a key must be printable ASCII "
                         "without spaces (clients send it in an HTTP header)")
    return key


@dataclass(slots=True)
class KeyBook:
    """The tenants of one reading of the file, and their key digests (index-aligned)."""

    tenants: dict[str, Tenant] = field(default_factory=dict)
    digests: list[bytes] = field(default_factory=list)
    owners: list[Tenant] = field(default_factory=list)

    def lookup(self, presented: bytes) -> Tenant | None:
        """The tenant whose key is `presented`, or None. Every digest is compared, whatever matched."""
        got = hashlib.sha256(presented).digest()
        found = None
        for want, tenant in zip(self.digests, self.owners):
            if hmac.compare_digest(got, want):
                found = tenant
        return found


def is_tenants_text(text: str) -> bool:
    """A tenants file has a TOML table header; a single-key file is one bare line."""
    return any(line.lstrip().startswith("[") for line in text.splitlines())


def read_key_file(path: str) -> tuple[str | None, KeyBook | None]:
    """(the single key, None) or (None, the tenants' KeyBook); ValueError naming what is wrong."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read --api-key-file {path!r}: {getattr(exc, 'strerror', None) or exc}") from None
    if is_tenants_text(text):
        return None, parse_tenants(text, path)
    key = text.splitlines()[0].strip() if text.strip() else ""
    if not key:
        raise ValueError(f"--api-key-file {path!r} is empty")
    return check_key_text(key, f"--api-key-file {path!r}"), None


def parse_tenants(text: str, path: str = "<tenants>") -> KeyBook:
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:  # its message quotes no value, only where
        raise ValueError(f"--api-key-file {path!r} is not valid TOML: {exc}") from None
    extra = sorted(set(doc) - {"tenants"})
    if extra:
        raise ValueError(f"--api-key-file {path!r}: unknown top-level entry {extra[0]!r} (only [tenants.NAME] tables)")
    tables = doc.get("tenants")
    if not isinstance(tables, dict) or not tables:
        raise ValueError(f"--api-key-file {path!r}: no [tenants.NAME] table")
    book = KeyBook()
    seen: dict[bytes, str] = {}
    for name, entry in tables.items():
        tenant, key_digest = _tenant(name, entry, path)
        if key_digest in seen:
            raise ValueError(f"--api-key-file {path!r}: tenants {seen[key_digest]!r} and {name!r} have the same key")
        seen[key_digest] = name
        book.tenants[name] = tenant
        book.digests.append(key_digest)
        book.owners.append(tenant)
    return book


def _tenant(name: str, entry, path: str) -> tuple[Tenant, bytes]:
    where = f"--api-key-file {path!r}, tenant {name!r}"
    if not NAME_RE.fullmatch(name):
        raise ValueError(f"--api-key-file {path!r}: tenant name {name[:70]!r} must be 1-64 of A-Z a-z 0-9 _ . -")
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: must be a table ([tenants.{name}])")
    unknown = sorted(set(entry) - set(_LIMITS) - set(_KEY_FIELDS))
    if unknown:
        raise ValueError(f"{where}: unknown field {unknown[0]!r} (known: {', '.join((*_KEY_FIELDS, *_LIMITS))})")
    given = [k for k in _KEY_FIELDS if k in entry]
    if len(given) != 1:
        raise ValueError(f"{where}: give exactly one of key or key_sha256")
    secret = entry[given[0]]
    if not isinstance(secret, str):
        raise ValueError(f"{where}: {given[0]} must be a string")
    if given[0] == "key":
        key_digest = digest(check_key_text(secret, where))
    elif _HEX_RE.fullmatch(secret):
        key_digest = bytes.fromhex(secret)
    else:
        raise ValueError(f"{where}: key_sha256 must be 64 hex digits (sha256sum of the key)")
    for limit, (ok, what) in _LIMITS.items():
        if limit in entry and not ok(entry[limit]):
            raise ValueError(f"{where}: {limit} must be {what}; got {entry[limit]!r}")
    values = {k: entry[k] for k in _LIMITS if k in entry}
    if "weight" in values:
        values["weight"] = float(values["weight"])
    if "requests_per_s" in values:
        values["requests_per_s"] = float(values["requests_per_s"])
    return Tenant(name=name, **values), key_digest


def single_key_book(key: str) -> KeyBook:
    """The single-key form as a book of one: the default tenant."""
    return KeyBook({DEFAULT_TENANT.name: DEFAULT_TENANT}, [digest(key)], [DEFAULT_TENANT])


_DESCRIBED = ("weight", "priority", "requests_per_s", "tokens_per_min", "max_concurrent", "max_tokens")


def changes(old: dict[str, Tenant], new: dict[str, Tenant]) -> list[tuple[str, str, dict]]:
    """What a reload changed, for the journal: (tenant, 'added'|'removed'|'changed', fields).
    Names and limits only; a key's change is said as a flag, never its value."""
    out = []
    for name in sorted(set(old) | set(new)):
        before, after = old.get(name), new.get(name)
        if before is None:
            out.append((name, "added", {f: getattr(after, f) for f in _DESCRIBED}))
        elif after is None:
            out.append((name, "removed", {}))
        elif before != after:
            diff = {f: f"{getattr(before, f)} -> {getattr(after, f)}" for f in _DESCRIBED if getattr(before, f) != getattr(after, f)}
            out.append((name, "changed", diff))
    return out
