"""The hardware catalog: devices, links and systems, the GPU kernel model and its efficiencies."""
