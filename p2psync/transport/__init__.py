"""Dissemination over HTTP: the server (:mod:`.server`), the client (:mod:`.client`), parent choice
(:mod:`.parents`), multi-stream fetching with failover (:mod:`.fetch`) and cut-through (:mod:`.board`)."""
