"""Routing to engine replicas: the node pool, each node's channel, health watch and load, DNS discovery, and
the strategies that pick an engine for a request."""
