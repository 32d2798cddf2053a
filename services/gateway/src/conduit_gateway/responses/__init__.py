"""The Responses API's state: the response store (memory or Redis) and the background runs of a replica."""
