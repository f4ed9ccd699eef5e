"""Bit-exact sparse delta and snapshot codec (see ``segment`` for the wire layout)."""
