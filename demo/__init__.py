"""``p2psync demo``: a whole RL run on one machine (trainer, relays and rollout nodes as local processes).

:mod:`.cluster` starts and stops the processes, :mod:`.monitor` watches them
(versions, fingerprints, dissemination times, rewards), :mod:`.dashboard`
draws the live terminal view and :mod:`.report` writes the figures and page at
the end. :mod:`.codec` is the earlier single-process codec demonstration
(``p2psync demo --codec``).
"""
