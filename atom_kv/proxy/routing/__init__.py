"""Which instance (and DP rank) serves a leg: the routing policies, their prefix tree and the pick they return."""
