"""The placement manager (docs/pm.md).

``records`` the PM's plain records; ``metadata`` their LMDB store;
``placement`` choosing nodes for a range; ``liveness`` the data nodes, their
heartbeats and load; ``manager`` the request logic over records;
``datanode_link`` the calls to data nodes; ``wire`` records to and from
messages; ``handlers`` one handler per opcode; ``metrics`` /metrics;
``config``, ``server`` and ``__main__`` the process.
"""
