"""MoE expert load balancing: load records, placements of logical experts on physical slots, the EPLB planner."""
