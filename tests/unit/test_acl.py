"""ACL files (SPEC §9): what parses, what is refused and why, how entries
decide, and who a certificate names."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from net.acl import Acl, AclError, parse_acl
from net.authz import ANONYMOUS, AccessControl, principal_of_certificate
from sbp.enums import ErrorCode

ISSUE_EXAMPLE = {
    "acls": [
        {
            "principal": "alice",
            "operations": ["CREATE", "APPEND", "FETCH", "DESCRIBE"],
            "resource": "streams:*",
            "effect": "allow",
        },
        {
            "principal": "bob",
            "operations": ["FETCH"],
            "resource": "streams:1-100",
            "effect": "allow",
        },
        {"principal": "*", "operations": ["DELETE"], "resource": "streams:*", "effect": "deny"},
    ]
}


def acl(document: Any) -> Acl:
    return parse_acl(json.dumps(document))


def entry(**fields: Any) -> dict[str, Any]:
    base = {"principal": "alice", "operations": ["FETCH"], "resource": "streams:*"}
    return {**base, "effect": "allow", **fields}


def test_the_example_decides_as_documented() -> None:
    rules = acl(ISSUE_EXAMPLE)
    assert rules.allows("alice", "APPEND", 7)
    assert rules.allows("alice", "CREATE", None)
    assert not rules.allows("alice", "DELETE", 7)  # "*" deny wins, and no allow anyway
    assert rules.allows("bob", "FETCH", 1) and rules.allows("bob", "FETCH", 100)
    assert not rules.allows("bob", "FETCH", 101)
    assert not rules.allows("bob", "APPEND", 5)
    assert not rules.allows("carol", "FETCH", 5)  # nothing without an allow entry
    assert not rules.allows("alice", "CLUSTER")


def test_deny_wins_over_allow() -> None:
    rules = acl(
        {
            "acls": [
                entry(operations=["APPEND", "FETCH"]),
                entry(operations=["APPEND"], resource="streams:5", effect="deny"),
            ]
        }
    )
    assert rules.allows("alice", "APPEND", 4)
    assert not rules.allows("alice", "APPEND", 5)
    assert rules.allows("alice", "FETCH", 5)


def test_describe_is_implied_by_other_stream_operations_unless_denied() -> None:
    rules = acl({"acls": [entry(principal="bob", resource="streams:1-100")]})
    assert rules.allows("bob", "DESCRIBE", 50)
    assert not rules.allows("bob", "DESCRIBE", 150)
    denied = acl(
        {
            "acls": [
                entry(principal="bob"),
                entry(principal="bob", operations=["DESCRIBE"], effect="deny"),
            ]
        }
    )
    assert not denied.allows("bob", "DESCRIBE", 1)


def test_create_is_spoken_of_only_by_every_stream_entries() -> None:
    ranged = acl({"acls": [entry(operations=["CREATE"], resource="streams:1-100")]})
    assert not ranged.allows("alice", "CREATE", None)
    everywhere = acl({"acls": [entry(operations=["CREATE"])]})
    assert everywhere.allows("alice", "CREATE", None)


def test_cluster_resource() -> None:
    rules = acl({"acls": [entry(principal="ops", operations=["CLUSTER"], resource="cluster")]})
    assert rules.allows("ops", "CLUSTER")
    assert not rules.allows("ops", "FETCH", 1)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("{", "not valid JSON"),
        ("[]", 'the key "acls"'),
        ('{"acls": {}}', "must be a list"),
        (json.dumps({"acls": [entry(operations=["READ"])]}), "entry 1: unknown operation READ"),
        (json.dumps({"acls": [entry(resource="topics:*")]}), "entry 1: resource 'topics:*'"),
        (json.dumps({"acls": [entry(resource="streams:9-3")]}), "ends before it starts"),
        (json.dumps({"acls": [entry(effect="maybe")]}), "effect must be allow or deny"),
        (json.dumps({"acls": [entry(), {"principal": "x"}]}), "entry 2: missing effect"),
        (json.dumps({"acls": [entry(extra=1)]}), "unknown key extra"),
        (json.dumps({"acls": [entry(principal="")]}), "principal must be"),
        (json.dumps({"acls": [entry(operations=[])]}), "non-empty list"),
        (json.dumps({"acls": [entry(operations=["CLUSTER"])]}), "the resource cluster takes"),
        (json.dumps({"acls": [entry(resource="cluster")]}), "the resource cluster takes"),
    ],
)
def test_a_bad_file_is_refused_with_where_and_why(text: str, problem: str) -> None:
    with pytest.raises(AclError, match=problem.replace("(", r"\(").replace("*", r"\*")):
        parse_acl(text)


def test_delete_on_the_cluster_is_for_consumer_groups_alone() -> None:
    rules = acl(
        {
            "acls": [
                entry(principal="ops", operations=["DELETE"], resource="cluster"),
                entry(principal="dev", operations=["DELETE"], resource="streams:*"),
            ]
        }
    )
    assert rules.allows_on_cluster("ops", "DELETE")
    assert not rules.allows("ops", "DELETE", 1)  # no stream
    assert not rules.allows_on_cluster("dev", "DELETE")  # every stream is not the cluster
    assert rules.allows("dev", "DELETE", 1)


def test_operations_are_case_insensitive() -> None:
    assert acl({"acls": [entry(operations=["fetch"])]}).allows("alice", "FETCH", 3)


def test_principals_from_certificates() -> None:
    with_cn = {
        "subject": ((("organizationName", "x"),), (("commonName", "alice"),)),
        "subjectAltName": (("DNS", "other"),),
    }
    assert principal_of_certificate(with_cn) == "alice"
    without_cn = {"subject": ((("organizationName", "x"),),), "subjectAltName": (("DNS", "bob"),)}
    assert principal_of_certificate(without_cn) == "bob"
    assert principal_of_certificate({}) == ANONYMOUS
    assert principal_of_certificate(None) == ANONYMOUS


def test_access_control_counts_denials_and_exempts_the_cluster(tmp_path: Path) -> None:
    path = tmp_path / "acl.json"
    path.write_text(json.dumps(ISSUE_EXAMPLE))
    access = AccessControl(path)
    error = access.check("bob", "APPEND", 5)
    assert error is not None and error.code == ErrorCode.AUTHORIZATION_FAILED
    assert "'bob'" in error.message and "APPEND" in error.message and "streams:5" in error.message
    assert access.check("bob", "FETCH", 5) is None
    assert access.check("datanode", "DELETE", 5) is None  # the cluster's own processes
    assert access.check_internal("alice", "SYNC_RANGES") is not None
    assert access.check_internal("pm", "SYNC_RANGES") is None
    assert access.denied == {"APPEND": 1, "SYNC_RANGES": 1}
    assert AccessControl().check("anyone", "DELETE", 1) is None  # no file: no authorization


def test_a_bad_reload_keeps_the_previous_entries(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "acl.json"
    path.write_text(json.dumps(ISSUE_EXAMPLE))
    access = AccessControl(path)
    path.write_text('{"acls": [')
    with caplog.at_level(logging.ERROR):
        assert not access.reload()
    assert access.entries == 3 and access.check("bob", "FETCH", 5) is None
    assert len([r for r in caplog.records if "ACL file refused" in r.getMessage()]) == 1
    grant = {"acls": [*ISSUE_EXAMPLE["acls"], entry(principal="bob", operations=["APPEND"])]}
    path.write_text(json.dumps(grant))
    assert access.reload()
    assert access.check("bob", "APPEND", 5) is None and access.reloads == 1
