"""Authorization (SPEC §9): ACL entries, read from a JSON file, and the one
question servers ask of them: may this principal do this operation on this
resource?

The file::

    {"acls": [
      {"principal": "alice", "operations": ["APPEND", "FETCH"],
       "resource": "streams:1-100", "effect": "allow"},
      {"principal": "*", "operations": ["DELETE"], "resource": "streams:*",
       "effect": "deny"}
    ]}

- ``resource`` is ``cluster``, ``streams:*``, ``streams:N`` or ``streams:N-M``
  (inclusive). ``CLUSTER`` is an operation on ``cluster`` only; ``DELETE``
  on ``cluster`` deletes consumer groups (SPEC §11); the others are on
  streams.
- Deny wins; nothing is allowed without an allow entry.
- ``DESCRIBE`` of a stream is implied by any other operation allowed on it
  (as in Kafka: who may read or write a stream may look it up), unless
  denied outright.
- ``CREATE`` names no stream yet: only ``streams:*`` entries speak of it.

Parsing is strict (an unknown key, operation or resource is an error naming
the entry), so that a typo never widens or narrows access unseen.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

#: the principal of a peer without a certificate (plain text, or TLS
#: without --tls-ca)
ANONYMOUS: Final = "ANONYMOUS"

OPERATIONS: Final = ("APPEND", "FETCH", "CREATE", "DELETE", "ALTER", "DESCRIBE", "CLUSTER")
EFFECTS: Final = ("allow", "deny")
#: the operations on the resource ``cluster``: CLUSTER, and DELETE of
#: consumer groups (SPEC §11)
CLUSTER_OPERATIONS: Final = frozenset({"CLUSTER", "DELETE"})
#: the operations that let a principal describe a stream as well
_IMPLY_DESCRIBE: Final = ("APPEND", "FETCH", "DELETE", "ALTER")
_ENTRY_KEYS: Final = frozenset({"principal", "operations", "resource", "effect"})
_STREAMS = re.compile(r"^streams:(?:(\*)|(\d+)(?:-(\d+))?)$")


class AclError(ValueError):
    """An ACL file that cannot be used; the message says where and why."""


@dataclass(frozen=True, slots=True)
class Resource:
    """``cluster`` (``first`` and ``last`` None, ``cluster`` True), or the
    streams ``first..last`` (both None: every stream)."""

    cluster: bool = False
    first: int | None = None
    last: int | None = None

    @property
    def every_stream(self) -> bool:
        return not self.cluster and self.first is None

    def holds(self, stream_id: int | None) -> bool:
        """Whether this resource speaks of ``stream_id`` (None: a stream not
        yet numbered, which only ``streams:*`` covers)."""
        if self.cluster:
            return False
        if self.first is None or self.last is None:
            return True
        return stream_id is not None and self.first <= stream_id <= self.last

    def __str__(self) -> str:
        if self.cluster:
            return "cluster"
        if self.first is None:
            return "streams:*"
        return f"streams:{self.first}" + ("" if self.first == self.last else f"-{self.last}")


def parse_resource(text: str) -> Resource:
    if text == "cluster":
        return Resource(cluster=True)
    match = _STREAMS.match(text)
    if match is None:
        raise ValueError(f"resource {text!r} is not cluster, streams:*, streams:N or streams:N-M")
    star, first, last = match.groups()
    if star:
        return Resource()
    low = int(first)
    high = int(last) if last is not None else low
    if high < low:
        raise ValueError(f"resource {text!r}: the range ends before it starts")
    return Resource(first=low, last=high)


def resource_of(operation: str, stream_id: int | None) -> str:
    """How a checked resource is named in messages."""
    if operation == "CLUSTER":
        return "cluster"
    return "streams:*" if stream_id is None else f"streams:{stream_id}"


@dataclass(frozen=True, slots=True)
class Entry:
    principal: str  # "*": everyone
    operations: frozenset[str]
    resource: Resource
    allow: bool


class Acl:
    """A parsed ACL file. The entries that apply to a (principal, operation)
    are gathered once, on its first check, so that a check is a dictionary
    lookup and a few comparisons however long the file (an APPEND item is
    checked in well under a microsecond; ``python -m bench tls``)."""

    #: (principal, operation) pairs remembered; principals come from
    #: certificates, so there are few, but a bound keeps memory bounded anyway
    MAX_REMEMBERED: Final = 10_000

    def __init__(self, entries: Iterable[Entry]) -> None:
        self.entries = tuple(entries)
        #: (principal, operation) -> (the resources denied, the resources allowed)
        self._rules: dict[tuple[str, str], tuple[tuple[Resource, ...], tuple[Resource, ...]]] = {}

    def __len__(self) -> int:
        return len(self.entries)

    def allows(self, principal: str, operation: str, stream_id: int | None = None) -> bool:
        """Deny wins; nothing without an allow; DESCRIBE implied (see above)."""
        denied, allowed = self._rules_for(principal, operation)
        if _covers(denied, operation, stream_id):
            return False
        if _covers(allowed, operation, stream_id):
            return True
        if operation == "DESCRIBE":
            return any(self.allows(principal, implying, stream_id) for implying in _IMPLY_DESCRIBE)
        return False

    def allows_on_cluster(self, principal: str, operation: str) -> bool:
        """Whether ``operation`` is allowed on the resource ``cluster``."""
        denied, allowed = self._rules_for(principal, operation)
        if any(r.cluster for r in denied):
            return False
        return any(r.cluster for r in allowed)

    def allows_some_stream(self, principal: str, operation: str) -> bool:
        """Whether ``operation`` is allowed on at least one stream (INIT_PRODUCER
        asks this of APPEND, SPEC §10): an allow that a deny of every
        stream does not take back."""
        denied, allowed = self._rules_for(principal, operation)
        if any(r.every_stream for r in denied):
            return False
        return any(not r.cluster for r in allowed)

    def _rules_for(
        self, principal: str, operation: str
    ) -> tuple[tuple[Resource, ...], tuple[Resource, ...]]:
        key = (principal, operation)
        rules = self._rules.get(key)
        if rules is None:
            applying = [
                e
                for e in self.entries
                if e.principal in ("*", principal) and operation in e.operations
            ]
            rules = (
                tuple(e.resource for e in applying if not e.allow),
                tuple(e.resource for e in applying if e.allow),
            )
            if len(self._rules) < self.MAX_REMEMBERED:
                self._rules[key] = rules
        return rules


def _covers(resources: tuple[Resource, ...], operation: str, stream_id: int | None) -> bool:
    if operation == "CLUSTER":
        return any(r.cluster for r in resources)
    return any(r.holds(stream_id) for r in resources)


def parse_acl(text: str) -> Acl:
    """An ``Acl`` from the file's text; ``AclError`` names the first problem."""
    try:
        document = json.loads(text)
    except json.JSONDecodeError as error:
        raise AclError(f"not valid JSON: {error}") from None
    if not isinstance(document, dict) or set(document) != {"acls"}:
        raise AclError('the file must be one object with the key "acls" and nothing else')
    listed = document["acls"]
    if not isinstance(listed, list):
        raise AclError('"acls" must be a list of entries')
    return Acl(_entry(number, raw) for number, raw in enumerate(listed, start=1))


def load_acl(path: Path) -> Acl:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise AclError(f"cannot read {path}: {getattr(error, 'strerror', None) or error}") from None
    try:
        return parse_acl(text)
    except AclError as error:
        raise AclError(f"{path}: {error}") from None


def _entry(number: int, raw: Any) -> Entry:
    where = f"entry {number}"
    if not isinstance(raw, dict):
        raise AclError(f"{where} is not an object")
    missing = sorted(_ENTRY_KEYS - set(raw))
    unknown = sorted(set(raw) - _ENTRY_KEYS)
    if missing or unknown:
        what = [f"missing {', '.join(missing)}"] if missing else []
        what += [f"unknown key {', '.join(unknown)}"] if unknown else []
        raise AclError(f"{where}: {'; '.join(what)}")
    principal, operations = raw["principal"], raw["operations"]
    if not isinstance(principal, str) or not principal:
        raise AclError(f'{where}: principal must be a non-empty string (or "*")')
    if (
        not isinstance(operations, list)
        or not operations
        or not all(isinstance(o, str) for o in operations)
    ):
        raise AclError(f"{where}: operations must be a non-empty list of names")
    names = [o.upper() for o in operations]
    bad = [o for o in names if o not in OPERATIONS]
    if bad:
        raise AclError(f"{where}: unknown operation {bad[0]} (one of {', '.join(OPERATIONS)})")
    if not isinstance(raw["resource"], str):
        raise AclError(f"{where}: resource must be a string")
    try:
        resource = parse_resource(raw["resource"])
    except ValueError as error:
        raise AclError(f"{where}: {error}") from None
    if ("CLUSTER" in names and not resource.cluster) or (
        resource.cluster and not set(names) <= CLUSTER_OPERATIONS
    ):
        raise AclError(
            f"{where}: the resource cluster takes CLUSTER and DELETE (of consumer groups), "
            "and CLUSTER no other resource"
        )
    effect = raw["effect"]
    if effect not in EFFECTS:
        raise AclError(f"{where}: effect must be allow or deny, not {effect!r}")
    return Entry(principal, frozenset(names), resource, effect == "allow")


def describe(acl: Acl) -> Sequence[str]:
    """One line per entry, for ``sbp acl check``."""
    return [
        f"{'allow' if e.allow else 'deny ':5} {e.principal:<16} "
        f"{','.join(o for o in OPERATIONS if o in e.operations):<40} {e.resource}"
        for e in acl.entries
    ]
