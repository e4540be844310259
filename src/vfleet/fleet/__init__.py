"""Layer 4, operations on hosts over the inventory: doctor, swap, balancer, status, releases, gate,
tune."""
