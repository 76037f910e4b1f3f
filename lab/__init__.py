"""moe_l2.lab."""
