"""Everything that talks to peers: the libp2p façade, discovery, gossip, run state."""
