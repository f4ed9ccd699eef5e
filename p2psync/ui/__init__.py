"""The live page served by the trainer node (``/ui``): the relay tree by region, each node's version
and transfer progress, updating every half second while artifacts flow.

- :mod:`p2psync.ui.service`: the node service (routes, cluster view, status polling, auth cookie).
- :mod:`p2psync.ui.state`: the JSON document the page draws, and its layout (pure).
- ``assets/``: the page (plain HTML, CSS and JavaScript drawing inline SVG; nothing fetched from outside).
"""
