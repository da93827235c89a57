"""The search for the fastest plan that fits: bounds, partitions, what-ifs, days and dollars."""
