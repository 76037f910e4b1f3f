"""`moe-l2 predict`."""

from moe_l2.cache.predictor import add_arguments, run  # noqa: F401

HELP = "name a prompt's domain with a profile's predictor"
