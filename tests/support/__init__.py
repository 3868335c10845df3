"""Helpers shared by the test tiers: tiny models, engine and router processes, driver runs, payloads."""
