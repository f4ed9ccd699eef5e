"""What runs inside vLLM's worker processes: the ``p2psync`` weight-transfer backend
(:mod:`.backend`), the ``init_info`` / ``update_info`` it accepts (:mod:`.infos`), its verified
fetch from a p2psync parent (:mod:`.fetch`), staged updates (:mod:`.stage`), the CPUs an update
runs on (:mod:`.cpus`), warm-up at start (:mod:`.warm`) and the functions the engine calls
through ``collective_rpc`` (:mod:`.rpc`)."""
