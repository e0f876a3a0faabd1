"""Multi-process test harness for shardwise (see ``dist.launcher``)."""
