"""The measurement client behind `vfleet bench`, the performance gate and `vfleet tune`: no hosts,
no SSH."""
