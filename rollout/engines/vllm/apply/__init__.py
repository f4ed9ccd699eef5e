"""Applying a verified artifact to vLLM's live parameters: :class:`.weights.LiveWeights` binds
the checkpoint table to the live words and decodes (:mod:`.slices`: a rank's share of a delta;
:mod:`.stream`: chunk by chunk as they arrive), :mod:`.commit` writes with an undo log and a
read-back fingerprint (compiled scatter loops in :mod:`.kernels`), :mod:`.ranks` keeps tensor-
and expert-parallel ranks in step so they commit or refuse together."""
