"""How this process becomes a rank of a world that ringtrain started: joining separately started processes, and an elastic worker's link to its driver. Used by init(); below the core API."""
