"""`moe-l2 profile`."""

from moe_l2.cache.profile import add_arguments, run  # noqa: F401

HELP = "build a domain profile from traces or the daemon's statistics"
