"""`moe-l2 pack`."""

from moe_l2.pack import add_arguments, run  # noqa: F401

HELP = "rewrite a checkpoint expert-major: one read per expert"
