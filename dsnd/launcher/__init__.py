"""`dsnd launch`'s agents: one per host, starting, watching and restarting its ranks."""
