"""One chat end to end (M26 §5.3–§5.6): the request, the relay through every shard
session, the wire plan, sanity checks, failover and the frames streamed to the caller.
"""
