"""Training recipes built on moe_comm (not part of the installed package)."""
