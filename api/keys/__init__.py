"""API keys and their limits: who is asking (auth, the throttle on failed authentications, the bootstrap key), how
fast a key may submit (rate, on a moving window), what it may hold open (caps) and store (quotas)."""
