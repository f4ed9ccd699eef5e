"""p2psync."""
