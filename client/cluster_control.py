"""Changing a running ``sbp-cluster`` from another shell: stop one data
node (and keep it stopped), start it again, add a node, or list them.

The launcher listens on a loopback port of its own and writes it to
``DATA_DIR/launcher.json``; ``sbp-cluster stop-node 2`` (and the others)
read it, send one JSON line and print the one-line answer. A node stopped
this way is stopped gracefully and not restarted until ``start-node``; a
node added is ``node-N`` for the next N, on the port the launcher's port
base gives it, and the launcher starts it again on its next run (it runs
every ``node-N`` directory under its data directory).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Final

import trio

from net.address import format_address, parse_address

#: the file, under the data directory, that says where the launcher listens
CONTROL_FILE: Final = "launcher.json"
COMMANDS: Final = ("stop-node", "start-node", "add-node", "list-nodes")
#: how long a command waits for the launcher's answer (a node's graceful
#: stop, or a new node's start and registration, happens before it)
ANSWER_TIMEOUT_S: Final = 90.0
MAX_LINE: Final = 64 << 10

#: what the launcher does for a request: an answer such as {"ok": True, "message": ...}
Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


class ControlError(Exception):
    """A request the launcher refused, or could not be asked; said in one line."""


async def serve_control(
    data_dir: Path,
    handle: Handler,
    *,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Answer requests on a free loopback port, written to ``CONTROL_FILE``,
    until cancelled (the file then goes)."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    address = format_address(*listeners[0].socket.getsockname()[:2])
    path = data_dir / CONTROL_FILE
    path.write_text(json.dumps({"control": address}) + "\n")

    async def serve_one(stream: trio.SocketStream) -> None:
        async with stream:
            try:
                request = json.loads(await _read_line(stream))
                if not isinstance(request, dict):
                    raise ValueError("a request is a JSON object")
            except (ValueError, trio.BrokenResourceError) as error:
                answer: dict[str, Any] = {"ok": False, "message": f"bad request: {error}"}
            else:
                answer = await handle(request)
            # an asker that went away: what it asked is done all the same
            with contextlib.suppress(trio.BrokenResourceError):
                await stream.send_all(json.dumps(answer).encode() + b"\n")

    try:
        task_status.started(address)
        await trio.serve_listeners(serve_one, listeners)
    finally:
        path.unlink(missing_ok=True)


async def _read_line(stream: trio.SocketStream) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = await stream.receive_some(MAX_LINE)
        if not chunk:
            break
        data += chunk
        if len(data) > MAX_LINE:
            raise ValueError("request too long")
    return data.decode()


async def ask(data_dir: Path, request: dict[str, Any]) -> dict[str, Any]:
    """Send ``request`` to the launcher running on ``data_dir``; its answer."""
    try:
        address = json.loads((data_dir / CONTROL_FILE).read_text())["control"]
    except (OSError, ValueError, KeyError):
        raise ControlError(
            f"no sbp-cluster runs on {data_dir} (no {CONTROL_FILE} there): start it first, "
            "or give its --data-dir"
        ) from None
    host, port = parse_address(address)
    try:
        with trio.fail_after(ANSWER_TIMEOUT_S):
            stream = await trio.open_tcp_stream(host, port)
            async with stream:
                await stream.send_all(json.dumps(request).encode() + b"\n")
                line = await _read_line(stream)
    except OSError as error:
        raise ControlError(f"the sbp-cluster on {data_dir} does not answer: {error}") from None
    except trio.TooSlowError:
        raise ControlError(
            f"the sbp-cluster on {data_dir} did not answer in {ANSWER_TIMEOUT_S:g} s"
        ) from None
    try:
        answer = json.loads(line)
    except ValueError:
        raise ControlError(f"the sbp-cluster on {data_dir} answered {line!r}") from None
    if not isinstance(answer, dict):
        raise ControlError(f"the sbp-cluster on {data_dir} answered {line!r}")
    return answer


def _node_id(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a node id: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"node ids start at 1: {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sbp-cluster",
        description="Change the sbp-cluster running on a data directory (see docs/cli.md).",
    )
    parser.add_argument(
        "--data-dir", default="./var", help="the running cluster's directory (default: ./var)"
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    stop = actions.add_parser(
        "stop-node",
        help="stop one data node and keep it stopped (after `sbp nodes drain`, say)",
        description="Stop the data node gracefully; the launcher does not start it again "
        "until start-node (or its own next run). Drain it first (`sbp nodes drain N "
        "--wait`) to stop it without leaving ranges under-replicated.",
    )
    stop.add_argument("node", type=_node_id, metavar="NODE")
    stop.add_argument("--force", action="store_true", help="stop it even though it holds ranges")
    start = actions.add_parser("start-node", help="start a node stopped with stop-node again")
    start.add_argument("node", type=_node_id, metavar="NODE")
    add = actions.add_parser(
        "add-node",
        help="start one more data node (node-N for the next N)",
        description="Start one more data node on the launcher's next port and wait until "
        "the PM sees it alive. The launcher runs it on its next start too.",
    )
    listing = actions.add_parser("list-nodes", help="the launcher's data nodes and their state")
    for action in (stop, start, add, listing):
        # accepted after the action too
        action.add_argument("--data-dir", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(argv)
    request: dict[str, Any] = {"action": args.action}
    if hasattr(args, "node"):
        request["node"] = args.node
    if getattr(args, "force", False):
        request["force"] = True
    try:
        answer = trio.run(ask, Path(args.data_dir).resolve(), request)
    except ControlError as error:
        print(f"sbp-cluster: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    for line in answer.get("lines", []):
        print(line)
    if not answer.get("ok"):
        print(f"sbp-cluster: {answer.get('message', 'refused')}", file=sys.stderr)
        return 1
    if answer.get("message"):
        print(answer["message"])
    return 0
