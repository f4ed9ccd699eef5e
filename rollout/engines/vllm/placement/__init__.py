"""Where a checkpoint tensor's elements live in a vLLM model, learnt from vLLM's own loaders.

:func:`.probe.placements` feeds element ids through ``load_weights`` into probes and reads
them back (:mod:`.readback`, compiled passes in :mod:`.kernels`) as compact strided boxes
(:mod:`.boxes`); vLLM's moves after loading are replayed or refused (:mod:`.repack`); the
vocabulary is placed by rule (:mod:`.vocab`); hand-written rules and :class:`.rules.LayoutError`
in :mod:`.rules`; derived placements kept on disk in :mod:`.cache`
(``$P2PSYNC_PLACEMENT_CACHE``)."""
