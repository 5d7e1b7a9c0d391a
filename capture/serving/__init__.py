"""The overlap-scheduled serving loop, its workloads, statistics and command line."""
