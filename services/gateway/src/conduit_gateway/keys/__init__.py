"""API keys at the gateway: the keys file (names, limits), the live key store that SIGHUP reloads, and
the per-key rate limits (token buckets) with OpenAI's x-ratelimit-* headers."""
