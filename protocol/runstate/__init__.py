"""The run's shared state: the signed CRDT document and its strict reader, its anti-entropy
sync, the run's lifecycle on a node, and the info protocol a joiner asks first."""
