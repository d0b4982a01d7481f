"""What a run shows: metrics rows and their sinks, the console, MFU, the environment, the profiler timeline."""
