"""What the lessons use beside the engines: models, data sharding, the memory calculator, the profiler and its spans."""
