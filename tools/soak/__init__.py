"""Parts of the chaos soak (``tools/chaos.py``): the fault schedule and the ledger of checks (pure),
the trainer's checkpoint workload, and the lease jobs the nodes run (``--job tools.soak.jobs:...``)."""
