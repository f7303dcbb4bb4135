"""Replication on the data node (SPEC §7): the primary's pipeline to its
followers (``primary``), the commit offsets FETCH waits on (``commits``) and
the catch-up of sealed ranges a replica is short of (``catchup``). The
follower's side of REPLICATE is a handler (``datanode.handlers.replicate``);
storage only stores stamped batches and drops excess (``storage.writes``)."""
