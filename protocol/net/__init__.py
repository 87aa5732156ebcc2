"""Transport: the libp2p host and its guard, NAT traversal (dial-backs, relays, hole
punching, UPnP), discovery, gossip, peer scores, and bulk tensors over the direct data
channel (exchange, data_channel)."""
