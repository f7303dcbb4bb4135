"""A small etcd v3 client for trio, over etcd's JSON gateway (``/v3/...`` on
the client port) with httpx: what a PM on etcd needs and nothing more
(SPEC §8; docs/pm.md says why this and not a library).

- ``get``, ``get_prefix``, ``put``, ``delete``: the key-value calls;
- ``txn``: compares, then operations on success or on failure, in one
  atomic step (how every metadata write is guarded by the leader key);
- ``lease_grant``, ``lease_keepalive``, ``lease_revoke``: leases, whose
  keys vanish when they are not kept alive;
- ``watch``: the events of a key or a prefix from a revision on.

Keys and values are bytes (base64 on the wire, as the gateway wants), int64
fields arrive as strings, and fields at their zero value are left out of
answers (proto3 JSON): the parsing below fills them in.

Every call goes to one member; a member that cannot be reached, or does not
answer within the call's timeout, is left for the next one in the list.
When none answers, ``EtcdUnavailable`` (retriable: etcd has lost its
majority, or the network has) is raised promptly, never a hang.
"""

from __future__ import annotations

import base64
import json
import ssl
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Final

import httpx
import trio

from sbp.stats import Buckets

#: how long one call waits for a member before trying the next
DEFAULT_TIMEOUT_S: Final = 2.0
#: upper bounds of the call latency buckets, seconds
CALL_SECONDS_BOUNDS: Final = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
)  # fmt: skip


class EtcdError(Exception):
    """etcd refused a call (a bad request, a lease that is gone …)."""


class EtcdUnavailable(EtcdError):
    """No member answered in time: etcd has no majority, or cannot be
    reached. Retriable."""


@dataclass(frozen=True, slots=True)
class KeyValue:
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int = 0


@dataclass(frozen=True, slots=True)
class TxnResult:
    succeeded: bool
    #: the store's revision after the transaction
    revision: int
    #: per operation run, its answer as the gateway gave it
    responses: tuple[dict[str, Any], ...]


@dataclass(frozen=True, slots=True)
class WatchEvent:
    kind: str  # "PUT" or "DELETE"
    kv: KeyValue


# -- compares and operations of a transaction ----------------------------------


def version_is(key: bytes, version: int) -> dict[str, Any]:
    """Compare a key's version (0: the key is absent)."""
    return {"key": _b64(key), "target": "VERSION", "result": "EQUAL", "version": str(version)}


def create_revision_is(key: bytes, revision: int) -> dict[str, Any]:
    """Compare the revision a key was created at (who holds a leader key)."""
    return {
        "key": _b64(key),
        "target": "CREATE",
        "result": "EQUAL",
        "create_revision": str(revision),
    }


def value_is(key: bytes, value: bytes) -> dict[str, Any]:
    return {"key": _b64(key), "target": "VALUE", "result": "EQUAL", "value": _b64(value)}


def put_op(key: bytes, value: bytes, lease: int = 0) -> dict[str, Any]:
    request: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
    if lease:
        request["lease"] = str(lease)
    return {"request_put": request}


def delete_op(key: bytes) -> dict[str, Any]:
    return {"request_delete_range": {"key": _b64(key)}}


def delete_prefix_op(prefix: bytes) -> dict[str, Any]:
    """Delete every key under ``prefix``."""
    return {"request_delete_range": {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))}}


def get_op(key: bytes) -> dict[str, Any]:
    return {"request_range": {"key": _b64(key)}}


# -- the client ------------------------------------------------------------------


class Etcd:
    """``async with Etcd(["http://127.0.0.1:2379", ...]) as etcd: ...``"""

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        if not endpoints:
            raise ValueError("no etcd endpoint given")
        self.endpoints = [e.rstrip("/") for e in endpoints]
        self.timeout = timeout
        #: the member that answered last: asked first
        self._current = 0
        #: seconds per call that a member answered (watches aside), for /metrics
        self.latency = Buckets(CALL_SECONDS_BOUNDS)
        self._http: httpx.AsyncClient | None = None
        #: checks https:// members (and presents a client certificate); None:
        #: the system's CAs
        self._tls = tls

    async def __aenter__(self) -> Etcd:
        self._http = httpx.AsyncClient(timeout=self.timeout, verify=self._tls or True)
        return self

    async def __aexit__(self, *_exc: object) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    # -- key-value ---------------------------------------------------------------

    async def get(self, key: bytes) -> KeyValue | None:
        answer = await self._call("/v3/kv/range", {"key": _b64(key)})
        kvs = answer.get("kvs", [])
        return _kv(kvs[0]) if kvs else None

    async def get_prefix(self, prefix: bytes) -> tuple[list[KeyValue], int]:
        """Every key under ``prefix``, in key order, and the revision read at."""
        answer = await self._call(
            "/v3/kv/range", {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))}
        )
        return [_kv(kv) for kv in answer.get("kvs", [])], _revision(answer)

    async def put(self, key: bytes, value: bytes, *, lease: int = 0) -> int:
        """The store's revision after the put."""
        request = put_op(key, value, lease)["request_put"]
        return _revision(await self._call("/v3/kv/put", request))

    async def delete(self, key: bytes) -> int:
        """How many keys were deleted (0 or 1)."""
        answer = await self._call("/v3/kv/deleterange", {"key": _b64(key)})
        return int(answer.get("deleted", 0))

    async def txn(
        self,
        compare: Sequence[dict[str, Any]],
        success: Sequence[dict[str, Any]],
        failure: Sequence[dict[str, Any]] = (),
    ) -> TxnResult:
        answer = await self._call(
            "/v3/kv/txn",
            {"compare": list(compare), "success": list(success), "failure": list(failure)},
        )
        return TxnResult(
            succeeded=bool(answer.get("succeeded", False)),
            revision=_revision(answer),
            responses=tuple(answer.get("responses", ())),
        )

    # -- leases --------------------------------------------------------------------

    async def lease_grant(self, ttl_s: int) -> int:
        answer = await self._call("/v3/lease/grant", {"TTL": str(ttl_s), "ID": "0"})
        if answer.get("error"):
            raise EtcdError(str(answer["error"]))
        return int(answer["ID"])

    async def lease_keepalive(self, lease: int) -> int:
        """Renew a lease; its remaining TTL in seconds, 0 when it is gone."""
        answer = await self._call("/v3/lease/keepalive", {"ID": str(lease)})
        result = answer.get("result", answer)
        return int(result.get("TTL", 0))

    async def lease_revoke(self, lease: int) -> None:
        """Revoke a lease (its keys go with it); a lease already gone is fine."""
        try:
            await self._call("/v3/lease/revoke", {"ID": str(lease)})
        except EtcdError as error:
            if "not found" not in str(error):
                raise

    # -- watch ----------------------------------------------------------------------

    async def watch(
        self, key: bytes, *, prefix: bool = False, start_revision: int = 0
    ) -> AsyncIterator[WatchEvent]:
        """The events of ``key`` (or every key under it), from
        ``start_revision`` on (0: from now), until the caller stops or the
        member goes away (``EtcdUnavailable``; watch again from the last
        revision seen plus one)."""
        request: dict[str, Any] = {"key": _b64(key)}
        if prefix:
            request["range_end"] = _b64(prefix_end(key))
        if start_revision:
            request["start_revision"] = str(start_revision)
        http = self._client()
        url = self.endpoints[self._current] + "/v3/watch"
        try:
            async with http.stream(
                "POST",
                url,
                json={"create_request": request},
                timeout=httpx.Timeout(self.timeout, read=None),
            ) as response:
                if response.status_code != 200:
                    raise EtcdError(f"watch refused: HTTP {response.status_code}")
                async for line in response.aiter_lines():
                    if not line.strip():
                        continue
                    result = json.loads(line).get("result", {})
                    for event in result.get("events", ()):
                        yield WatchEvent(event.get("type", "PUT"), _kv(event["kv"]))
        except (httpx.TransportError, trio.TooSlowError) as error:
            self._current = (self._current + 1) % len(self.endpoints)
            raise EtcdUnavailable(
                f"watch on {url} ended: {error or type(error).__name__}"
            ) from None

    # -- plumbing --------------------------------------------------------------------

    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            raise RuntimeError("use `async with Etcd(...)`")
        return self._http

    async def _call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        http = self._client()
        failures: list[str] = []
        for attempt in range(len(self.endpoints)):
            index = (self._current + attempt) % len(self.endpoints)
            url = self.endpoints[index] + path
            started = trio.current_time()
            try:
                with trio.fail_after(self.timeout):
                    response = await http.post(url, json=body)
            except (httpx.TransportError, trio.TooSlowError) as error:
                why = str(error) or f"no answer in {self.timeout:g} s"
                failures.append(f"{self.endpoints[index]}: {why}")
                continue
            self.latency.observe(trio.current_time() - started)
            answer: dict[str, Any] = response.json() if response.content else {}
            if response.status_code == 200:
                self._current = index
                return answer
            message = str(answer.get("message") or answer.get("error") or response.text)
            if response.status_code >= 500 and _unavailable(message):
                failures.append(f"{self.endpoints[index]}: {message}")
                continue
            raise EtcdError(f"{path}: {message}")
        raise EtcdUnavailable(f"no etcd member answered {path}: " + "; ".join(failures))


def prefix_end(prefix: bytes) -> bytes:
    """The key just past every key that starts with ``prefix``."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"  # every key


def _unavailable(message: str) -> bool:
    """etcd's answers that mean "no majority now": try another member."""
    return any(
        text in message
        for text in ("timed out", "no leader", "leader changed", "not capable", "unavailable")
    )


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def _kv(raw: dict[str, Any]) -> KeyValue:
    return KeyValue(
        key=_unb64(raw.get("key")),
        value=_unb64(raw.get("value")),
        create_revision=int(raw.get("create_revision", 0)),
        mod_revision=int(raw.get("mod_revision", 0)),
        version=int(raw.get("version", 0)),
        lease=int(raw.get("lease", 0)),
    )


def _revision(answer: dict[str, Any]) -> int:
    return int(answer.get("header", {}).get("revision", 0))
