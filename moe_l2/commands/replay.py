"""`moe-l2 replay`."""

from moe_l2.cache.replay import add_arguments, run  # noqa: F401

HELP = "run routing traces through the daemon's store: hit rates vs LRU, LFU and Belady's MIN"
