"""What every node speaks, whatever it trains: ``net`` (the libp2p façade and transport),
``runstate`` (the replicated run document), and the shared foundations here (framing in
``wire``, signatures in ``keys``, ``errors``, ``ratelimit``). Each training algorithm's own
wire protocol lives beside its algorithm in node/algorithms/ (NoLoCo's pairing, ZO's log,
its sync, the state offers joiners fetch)."""
