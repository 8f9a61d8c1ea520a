"""The shard server (M26 §5.3): the engine's layer stack served over the transport's
sessions, with its decode-step batcher and limits checked before work.
"""
