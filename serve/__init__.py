"""moe_l2.serve."""
