"""HEARTBEAT on a data node: echo the caller's id, describe this node."""

from __future__ import annotations

from net.request import Request, Responder
from sbp import messages
from sbp.enums import ClientRole

from ..node import DataNode


class ControlHandlers:
    def __init__(self, node: DataNode) -> None:
        self._node = node

    async def heartbeat(self, request: Request, responder: Responder) -> None:
        header = request.header_as(messages.HeartbeatRequest)
        await responder.send(
            messages.HeartbeatResponse(
                client_id=header.client_id,
                client_role=ClientRole.DATA_NODE,
                data_node=self._node.identity(),
            )
        )
