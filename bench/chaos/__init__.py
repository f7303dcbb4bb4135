"""The fault-injection harness: ``python -m bench chaos``.

- ``proxy``: a TCP proxy per link that the harness can slow, blackhole,
  corrupt or cut;
- ``cluster``: a PM and data nodes as processes, every link through a proxy;
- ``workload``: producers with unique values and their outcomes, tailing
  consumers, seals, trims and new streams on the side;
- ``faults``: the seeded schedule and its injector;
- ``checker``: what the streams hold at the end against what was
  acknowledged and read;
- ``report``: JSON, markdown and a timeline plot;
- ``fuzz``: mutated frames against live servers;
- ``crowd``: many connections, idle ones and slow readers against a node;
- ``cli``: the command line.
"""
