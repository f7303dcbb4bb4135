"""The object store flags both servers take (SPEC §14)."""

from __future__ import annotations

from typing import Any

from net.service import UsageError
from net.settings import Option

from .store import ObjectStoreSettings


def object_store_options() -> tuple[Option, Option]:
    """``--object-store`` and ``--object-store-endpoint``."""
    return (
        Option(
            "object-store",
            "keep sealed ranges of tiered streams (local_retention_ms >= 0) in this S3 "
            "bucket and prefix, e.g. s3://sbp/cluster1; credentials come from the AWS_* "
            "environment variables (default: no object store)",
            metavar="s3://BUCKET/PREFIX",
        ),
        Option(
            "object-store-endpoint",
            "the S3 API's address when it is not AWS (SeaweedFS, MinIO, Ceph), "
            "e.g. http://127.0.0.1:8333",
            metavar="URL",
        ),
    )


def object_store_settings(values: dict[str, Any]) -> ObjectStoreSettings | None:
    """The object store the flags name; None without one; ``UsageError``
    with a one-line reason for a bad value."""
    url, endpoint = values["object_store"], values["object_store_endpoint"]
    if not url:
        if endpoint:
            raise UsageError("--object-store-endpoint needs --object-store")
        return None
    try:
        return ObjectStoreSettings.parse(url, endpoint or "")
    except ValueError as error:
        raise UsageError(str(error)) from None
